"""Group rows without padding: the host side of the packed shared-prompt forward (``actor.share_prompt_forward``
with ``model.use_remove_padding``).

A rollout's rows come in groups of ``n`` samples of one prompt, each row ``[prompt (P, left-padded) | response
(R, right-padded)]``. `pack_group_rows` lays each group out as one row of real tokens only:

    tokens:      [prompt's p tokens | sample 1's r_1 tokens | ... | sample n's r_n tokens | padding]   [G, T]
    segments:    [1 ... 1           | 2 ... 2               | ... | n + 1 ...             | 0 ...  ]
    positions:   the rollout's ``position_ids`` of each token (a sample's continue its prompt's)

with ``T`` = `packing.static_length` of the longest group's ``p + Σ r_i``, at most ``P + n·R`` (the padded group
row), so a varying load reuses a few compiled programs. ``group_logit_index [G, n·R]`` says which packed position
predicts each response column: the prompt's last token for column 0, the sample's previous token after it (the
padded forward's hidden state at column ``P + t - 1``), and the prompt's last token again for the response's
padding columns, whose outputs every caller masks. The model side is `jaxrl_hf.workers.shared_prompt`.

The default DAPO rows (prompts ~53 of 64 tokens, responses ~14 of 32, n = 4) are ~57% real: a group row of 192
positions carries ~110 tokens.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jaxrl_hf.workers import packing
from jaxrl_hf.workers.token_batches import agree_max

GROUP_KEYS = ("group_input_ids", "group_position_ids", "group_segments", "group_logit_index")
"""The arrays `pack_group_rows` adds to a micro-batch (they replace its ``input_ids`` / ``attention_mask`` /
``position_ids``)."""


def packable(attention_mask: np.ndarray, response_length: int) -> bool:
    """Whether rows can be packed and still predict every response token from the same keys: 0/1 masks, each
    prompt's last column real, and each response's real tokens a prefix of its columns (right padding)."""
    mask = np.asarray(attention_mask)
    prompt_len = mask.shape[1] - int(response_length)
    if prompt_len < 1 or not np.isin(mask, (0, 1)).all():
        return False
    response = mask[:, prompt_len:] != 0
    return bool((mask[:, prompt_len - 1] != 0).all() and (response[:, :-1] >= response[:, 1:]).all())


def group_row_length(attention_mask: np.ndarray, response_length: int, group: int) -> int:
    """``T`` of the packed group rows of ``attention_mask``'s rows (module docstring), the largest over the JAX
    processes (all of them call it in lockstep, once per micro-batch stack or chunk)."""
    mask = np.asarray(attention_mask) != 0
    rows, width = mask.shape
    prompt_len = width - int(response_length)
    prompts = mask[::group, :prompt_len].sum(axis=1)
    responses = mask[:, prompt_len:].sum(axis=1).reshape(rows // group, group).sum(axis=1)
    length = packing.static_length(int((prompts + responses).max()), prompt_len + group * int(response_length))
    return agree_max(length)[0]  # every process runs the same program


def pack_group_rows(arrays: Mapping[str, np.ndarray], response_length: int, group: int,
                    length: int) -> dict[str, np.ndarray]:
    """``arrays`` (``input_ids``, ``attention_mask``, ``position_ids`` ``[G·n, P + R]``, groups of ``n`` =
    ``group`` rows with one prompt, `packable`) -> `GROUP_KEYS` ``[G, length]`` / ``[G, n·R]`` (module
    docstring), with the other arrays unchanged."""
    ids, mask, positions = (np.asarray(arrays[k]) for k in ("input_ids", "attention_mask", "position_ids"))
    rows, width = ids.shape
    r = int(response_length)
    prompt_len, groups = width - r, rows // group
    out = {name: np.zeros((groups, length), np.int32) for name in GROUP_KEYS[:3]}
    index = np.zeros((groups, group * r), np.int32)
    for g in range(groups):
        first = g * group
        real = np.flatnonzero(mask[first, :prompt_len])
        cursor = len(real)
        pieces = [(first, real, 1)]
        for i in range(group):
            taken = int(np.count_nonzero(mask[first + i, prompt_len:]))
            predicts = np.full(r, len(real) - 1, np.int32)
            predicts[1:taken] = cursor + np.arange(taken - 1)
            index[g, i * r:(i + 1) * r] = predicts
            pieces.append((first + i, prompt_len + np.arange(taken), i + 2))
            cursor += taken
        if cursor > length:
            raise ValueError(f"pack_group_rows: group {g} holds {cursor} tokens, more than the packed length {length}")
        at = 0
        for row, columns, segment in pieces:
            span = slice(at, at + len(columns))
            out["group_input_ids"][g, span] = ids[row, columns]
            out["group_position_ids"][g, span] = positions[row, columns]
            out["group_segments"][g, span] = segment
            at += len(columns)
    out["group_logit_index"] = index
    return {**{k: v for k, v in arrays.items() if k not in ("input_ids", "attention_mask", "position_ids")}, **out}


def pack_micro_stack(mini: Mapping[str, np.ndarray], response_length: int, group: int) -> dict[str, np.ndarray]:
    """A stack of micro-batches ``[M, rows, ...]`` (`jaxrl_hf.workers.minibatch.iterate_minibatches`) packed
    micro-batch by micro-batch at one length (the stack's longest group), as the train step takes it."""
    count = np.shape(mini["attention_mask"])[0]
    flat_mask = np.asarray(mini["attention_mask"]).reshape(-1, np.shape(mini["attention_mask"])[-1])
    length = group_row_length(flat_mask, response_length, group)
    packed = [pack_group_rows({k: np.asarray(v)[m] for k, v in mini.items()}, response_length, group, length)
              for m in range(count)]
    return {k: np.stack([p[k] for p in packed]) for k in packed[0]}


def token_counts(packed: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """``(real tokens, token slots)`` of packed group rows (for ``actor/padding_ratio``)."""
    segments = np.asarray(packed["group_segments"])
    return int(np.count_nonzero(segments)), int(segments.size)
