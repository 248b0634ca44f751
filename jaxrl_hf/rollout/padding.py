"""Prompt padding shared by the engines: prompts left-padded to the smallest length bucket that fits."""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np


def length_buckets(largest: int = 8192) -> tuple[int, ...]:
    """Prompt-length buckets: multiples of 8 from 16 to 64, then four steps per doubling (80, 96, 112, 128, 160, ...,
    ``largest``): a prompt of 9 or more tokens is padded by at most 7 tokens or a fifth of its bucket, against up
    to half with powers of two; each bucket used is one more compiled generate program."""
    sizes = list(range(16, 65, 8))
    while sizes[-1] < largest:
        base = sizes[-1]
        sizes.extend(base * k // 4 for k in (5, 6, 7, 8))
    return tuple(sizes)


DEFAULT_LENGTH_BUCKETS = length_buckets()


def bucket(value: int, buckets: Sequence[int], what: str, multiple: int = 1) -> int:
    """The smallest of the sorted ``buckets`` >= ``value``, rounded up to a ``multiple``; raises naming ``what``
    when ``value`` exceeds the largest."""
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{what} {value} exceeds the largest bucket {buckets[-1]}; pass larger buckets")
    size = buckets[i]
    return -(-size // multiple) * multiple


def left_pad_prompts(prompts: Sequence[Sequence[int]], pad_token_id: int, vocab_size: int,
                     length_buckets: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` ``[B, P]`` int32: prompts left-padded to the smallest length bucket ``P`` that fits.

    Empty prompts, token ids outside ``[0, vocab_size)`` and prompts longer than the largest bucket raise.
    """
    if len(prompts) == 0:
        raise ValueError("generate: empty prompt list")
    lengths = [len(p) for p in prompts]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ValueError(f"generate: prompt {i} is empty")
    width = bucket(max(lengths), tuple(sorted(length_buckets)), "prompt length")
    ids = np.full((len(prompts), width), pad_token_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        arr = np.asarray(p, np.int64)
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise ValueError(f"generate: prompt {i} has token ids outside [0, {vocab_size})")
        ids[i, width - len(p):] = arr
        mask[i, width - len(p):] = 1
    return ids, mask
