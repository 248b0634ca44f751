"""Where per-step PRM scores land in a policy response (``reward_model.prm.aggregation=per_step``).

Step ``k`` of a response text ends at character offset ``c_k`` (`prm_data.step_end_offsets`: the step's text and
the step tag after it, as the PRM was trained). Its score goes on the response token ``t_k`` whose decoded
prefix first reaches ``c_k``:

    t_k = min { j : |decode(y_0 .. y_j)| >= c_k }                                    (placement)

so a boundary inside a token lands on the token that contains it; a decoded prefix ending in an incomplete
UTF-8 character (U+FFFD) counts without it, so a boundary after a character split over tokens lands on the
token that completes it. The token-level PRM reward is then

    r_t = w · Σ_{k : t_k = t} p_k ,    Σ_t r_t = w · Σ_k p_k                          (per-step reward)

two steps ending on one token both count. An offset past the decoded text (a tokenizer whose prefixes do not
decode to prefixes of the text) goes on the last token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

_PARTIAL = "\ufffd"  # what a byte-level decoder shows for an incomplete UTF-8 character


def step_end_tokens(decode: Callable[[list[int]], str], ids: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Index into ``ids`` of the token that ends each character offset of ``ends`` (the placement equation;
    ``ends`` ascending, as `step_end_offsets` returns them). Binary search over decoded prefixes."""
    ids = [int(t) for t in ids]
    if not ids:
        if ends:
            raise ValueError(f"{len(ends)} step(s) but no response tokens to place them on")
        return []
    reached: dict[int, int] = {}

    def reach(j: int) -> int:
        if j not in reached:
            reached[j] = len(decode(ids[:j + 1]).rstrip(_PARTIAL))
        return reached[j]

    last, out, lo = len(ids) - 1, [], 0
    for c in ends:
        if reach(last) < c:
            out.append(last)
            lo = last
            continue
        a, b = lo, last
        while a < b:
            m = (a + b) // 2
            if reach(m) >= c:
                b = m
            else:
                a = m + 1
        out.append(a)
        lo = a
    return out


def place_step_scores(step_scores: np.ndarray, step_mask: np.ndarray, step_positions: Sequence[Sequence[int]],
                      width: int, weight: float = 1.0) -> np.ndarray:
    """``[B, width]`` float64 per-step reward: ``weight · step_scores[i, k]`` added at column
    ``step_positions[i][k]`` for each step with ``step_mask`` 1 (the per-step reward equation)."""
    scores = np.asarray(step_scores, np.float64)
    mask = np.asarray(step_mask).astype(bool)
    out = np.zeros((scores.shape[0], width), np.float64)
    for i, positions in enumerate(step_positions):
        k = np.flatnonzero(mask[i])
        if len(k) != len(positions):
            raise ValueError(f"response {i}: {len(k)} step score(s) but {len(positions)} step position(s)")
        np.add.at(out[i], np.asarray(positions, np.int64), weight * scores[i, k])
    return out
