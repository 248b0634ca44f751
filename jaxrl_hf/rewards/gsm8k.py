"""GSM8K rule scorer (data source ``openai/gsm8k``).

Two extraction modes, as in the ReFT paper (Luong et al., 2024) and verl's GSM8K scorer:

* ``strict``: the answer must follow ``#### `` (the GSM8K format); the last such answer counts.
* ``flexible``: the last number-like token of the response counts.

With ``lenient=False`` (the default) extraction and comparison reproduce verl's scorer exactly
(string equality after dropping thousands separators in strict mode), so a jaxrl_hf run and a verl
run score the same generations the same way. ``lenient=True`` additionally accepts ``#### $1,234.``
(a dollar sign and a sentence-final period) and compares numerically (``72.00`` == ``72``).

Only the last ``SOLUTION_CLIP_CHARS`` characters are searched (the answer is at the end), which
also bounds the cost on adversarial megabyte outputs.
"""

from __future__ import annotations

import re
from typing import Literal

from jaxrl_hf.rewards.numbers import canonical_number

SOLUTION_CLIP_CHARS = 300
"""Characters from the end of the response that are searched for an answer (as verl does)."""

Method = Literal["strict", "flexible"]

_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER_LIKE = re.compile(r"-?[0-9.,]+")
_STRICT_LENIENT = re.compile(r"####\s*(-?\$?-?[0-9][0-9.,]*)")
_NUMBER_LENIENT = re.compile(r"-?\$?[0-9][0-9.,]*|-?\$?\.[0-9][0-9,]*")


def extract_answer(solution_str: str, method: Method = "strict", *, lenient: bool = False) -> str | None:
    """The answer string the model gave, or None when it gave none.

    ``strict``: the last ``#### n``, with commas removed. ``flexible``: the last number-like token
    that is not a lone ``.`` (kept verbatim, commas included, as verl does). In lenient mode the
    result is the canonical number (``$1,234.`` -> ``1234``) or None if it does not parse.
    """
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    if lenient:
        pattern = _STRICT_LENIENT if method == "strict" else _NUMBER_LENIENT
        for candidate in reversed(pattern.findall(tail)):
            value = canonical_number(candidate)
            if value is not None:
                return value
        return None
    if method == "strict":
        found = _STRICT.findall(tail)
        return found[-1].replace(",", "") if found else None
    found = _NUMBER_LIKE.findall(tail)
    if not found:
        return None
    for candidate in reversed(found):
        if candidate not in ("", "."):
            return candidate
    # every candidate was a lone "."; verl then keeps the first one it looked at last, which never
    # equals a ground truth: the response earns format_score.
    return found[0]


def score_details(
    solution_str: str,
    ground_truth: str,
    method: Method = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    *,
    lenient: bool = False,
) -> dict:
    """``{"score", "acc", "pred"}`` for one response.

    ``score``: ``score`` if the extracted answer equals the ground truth, ``format_score`` if an answer
    was found but is wrong, 0.0 if none was found. ``pred`` is the extracted answer ("" if none).
    """
    pred = extract_answer(solution_str, method, lenient=lenient)
    truth = str(ground_truth)
    if pred is None:
        return {"score": 0.0, "acc": False, "pred": ""}
    if lenient:
        truth_canon = canonical_number(truth)
        correct = truth_canon is not None and pred == truth_canon
    else:
        correct = pred == truth
    return {"score": float(score if correct else format_score), "acc": bool(correct), "pred": pred}


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: Method = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
    *,
    lenient: bool = False,
) -> float:
    """The GSM8K reward as a float (see ``score_details``)."""
    return score_details(solution_str, ground_truth, method, format_score, score, lenient=lenient)["score"]
