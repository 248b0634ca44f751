"""Validation metrics per data source: mean@N, best@N, maj@N over N samples per prompt (verl's names).

For each data source and each per-sample variable (``acc``, ``score``):

* ``val-core/<source>/<var>/mean@N`` — the mean over all samples (= expected single-sample value);
* ``val-aux/<source>/<var>/best@N/mean`` — per prompt the best of its N samples, averaged over prompts;
* ``val-aux/<source>/<var>/maj@N/mean`` — per prompt the value of a sample carrying the majority answer
  (``pred``; ties -> the answer seen first), averaged over prompts (only when N > 1 and predictions exist);
* ``val-aux/<source>/<var>/std@N/mean`` — per prompt the std over its samples (N > 1).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import numpy as np


def majority_value(preds: Sequence[str | None], values: Sequence[float]) -> float:
    """The value of the first sample whose prediction is the most common non-empty one (0 if none)."""
    votes = Counter(p for p in preds if p not in (None, ""))
    if not votes:
        return 0.0
    top = max(votes.values())
    winner = next(p for p in preds if p not in (None, "") and votes[p] == top)
    return float(values[list(preds).index(winner)])


def aggregate_validation(data_sources: Sequence[str], uids: Sequence[int], variables: dict[str, np.ndarray],
                         preds: Sequence[str | None] | None, n: int) -> dict[str, float]:
    """The metrics above from per-sample arrays (samples of one prompt share a ``uid``)."""
    groups: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for i, (source, uid) in enumerate(zip(data_sources, uids)):
        groups[str(source)][int(uid)].append(i)
    out: dict[str, float] = {}
    for source, by_prompt in sorted(groups.items()):
        rows = [i for idx in by_prompt.values() for i in idx]
        for var, values in variables.items():
            values = np.asarray(values, np.float64)
            out[f"val-core/{source}/{var}/mean@{n}"] = float(values[rows].mean())
            if n > 1:
                out[f"val-aux/{source}/{var}/best@{n}/mean"] = float(np.mean([values[idx].max() for idx in by_prompt.values()]))
                out[f"val-aux/{source}/{var}/std@{n}/mean"] = float(np.mean([values[idx].std() for idx in by_prompt.values()]))
                if preds is not None:
                    out[f"val-aux/{source}/{var}/maj@{n}/mean"] = float(np.mean(
                        [majority_value([preds[i] for i in idx], values[idx]) for idx in by_prompt.values()]))
        out[f"val-aux/{source}/num_prompts"] = float(len(by_prompt))
    return out
