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


def _bisect(reach: Callable[[int], int], lo: int, hi: int, c: int) -> int:
    """Smallest ``j`` in ``[lo, hi]`` with ``reach(j) >= c`` (``reach`` non-decreasing, ``reach(hi) >= c``)."""
    while lo < hi:
        m = (lo + hi) // 2
        if reach(m) >= c:
            hi = m
        else:
            lo = m + 1
    return lo


def step_end_tokens(decode: Callable[[list[int]], str], ids: Sequence[int], ends: Sequence[int]) -> list[int]:
    """Index into ``ids`` of the token that ends each character offset of ``ends`` (the placement equation;
    ``ends`` ascending, as `step_end_offsets` returns them).

    Each step's token is first guessed by bisecting on decodes of the tokens after the previous step's token only
    (cheap, exact for byte-level BPE), then checked on two full-prefix decodes (``j`` reaches ``c_k``, ``j - 1``
    does not); a guess that fails the check is replaced by a bisection on full-prefix decodes."""
    ids = [int(t) for t in ids]
    if not ids:
        if ends:
            raise ValueError(f"{len(ends)} step(s) but no response tokens to place them on")
        return []
    cache: dict[int, int] = {}

    def reach(j: int) -> int:  # characters decoded from ids[0..j], an incomplete trailing character not counted
        if j < 0:
            return 0
        if j not in cache:
            cache[j] = len(decode(ids[:j + 1]).rstrip(_PARTIAL))
        return cache[j]

    last, out, lo = len(ids) - 1, [], 0
    for c in ends:
        if reach(last) < c:
            out.append(last)
            lo = last
            continue
        base = reach(lo - 1)

        def window(j: int, start: int = lo, base: int = base) -> int:
            return base + len(decode(ids[start:j + 1]).rstrip(_PARTIAL))

        guess = _bisect(window, lo, last, c) if window(last) >= c else last
        if not (reach(guess) >= c and reach(guess - 1) < c):
            guess = _bisect(reach, lo, last, c)
        out.append(guess)
        lo = guess
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
