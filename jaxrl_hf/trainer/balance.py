"""Balance a batch across data-parallel ranks by token count (verl's ``balance_batch``).

The DP protocols hand rank r the r-th contiguous chunk of the batch; reordering the rows so every chunk
holds about the same number of tokens evens out per-rank work (padding is per micro-batch anyway).
Equal-size partitions by longest-processing-time greedy: rows by length descending, each to the
lightest partition that still has room. Deterministic (ties broken by row index).
"""

from __future__ import annotations

import numpy as np


def balanced_partitions(lengths: np.ndarray, num_partitions: int) -> list[list[int]]:
    """Row indices split into ``num_partitions`` equal-count groups with near-equal token sums."""
    lengths = np.asarray(lengths)
    n = len(lengths)
    if num_partitions < 1 or n % num_partitions:
        raise ValueError(f"cannot split {n} rows into {num_partitions} equal partitions")
    cap = n // num_partitions
    parts: list[list[int]] = [[] for _ in range(num_partitions)]
    sums = np.zeros(num_partitions, np.int64)
    for i in sorted(range(n), key=lambda j: (-int(lengths[j]), j)):
        open_parts = [p for p in range(num_partitions) if len(parts[p]) < cap]
        target = min(open_parts, key=lambda p: (sums[p], p))
        parts[target].append(i)
        sums[target] += int(lengths[i])
    return [sorted(p) for p in parts]


def balance_permutation(attention_mask: np.ndarray, dp_size: int) -> tuple[np.ndarray, dict[str, float]]:
    """A permutation putting balanced partitions contiguously, and the before/after max-min token spread."""
    lengths = np.asarray(attention_mask).sum(-1)
    n = len(lengths)
    if dp_size <= 1 or n % dp_size:
        return np.arange(n), {}
    before = [int(c.sum()) for c in np.split(lengths, dp_size)]
    parts = balanced_partitions(lengths, dp_size)
    perm = np.concatenate([np.asarray(p, np.int64) for p in parts])
    after = [int(lengths[p].sum()) for p in parts]
    return perm, {"balance/tokens_spread_before": float(max(before) - min(before)),
                  "balance/tokens_spread_after": float(max(after) - min(after))}
