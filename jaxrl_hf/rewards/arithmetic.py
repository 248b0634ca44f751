"""Scorer for the synthetic arithmetic task (data source ``arithmetic``, see ``jaxrl_hf.data.arithmetic``).

The prompt asks for the final answer after ``Answer:``. A small chat model often answers in prose
("7 + 5 equals 12."), so extraction falls back step by step: the last ``Answer: n`` line, else the last
``\\boxed{n}``, else the last ``#### n``, else the last number of the response. The prediction is
correct when it equals the integer ground truth numerically (``12.0`` == ``12``, ``1,200`` == ``1200``).
Only the last 300 characters are read, and numbers are parsed with a digit bound.
"""

from __future__ import annotations

import re

from jaxrl_hf.rewards.numbers import canonical_number

SOLUTION_CLIP_CHARS = 300

_NUMBER = r"-?\$?\d[\d,]*(?:\.\d+)?"
_MARKED = (
    re.compile(r"(?i)answer\s*[:=]?\s*(?:is\s*)?(" + _NUMBER + ")"),
    re.compile(r"\\boxed\{\s*(" + _NUMBER + r")\s*\}"),
    re.compile(r"####\s*(" + _NUMBER + ")"),
)
_ANY_NUMBER = re.compile(_NUMBER)


def extract_answer(solution_str: str) -> str | None:
    """The canonical number the response gives as its answer, or None."""
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    for pattern in _MARKED:
        found = pattern.findall(tail)
        if found:
            return canonical_number(found[-1])
    found = _ANY_NUMBER.findall(tail)
    return canonical_number(found[-1]) if found else None


def score_details(solution_str: str, ground_truth: str | int) -> dict:
    """``{"score": 1.0/0.0, "acc", "pred"}``: does the extracted answer equal the ground truth."""
    truth = canonical_number(str(ground_truth))
    if truth is None:
        raise ValueError(f"arithmetic ground truth must be a number, got {ground_truth!r}")
    pred = extract_answer(solution_str)
    correct = pred is not None and pred == truth
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": pred or ""}


def strict_score_details(solution_str: str, ground_truth: str | int) -> dict:
    """``score_details`` reading only an explicit ``Answer: n`` (the ``calculator`` task: the scored text is the
    whole agent trajectory, so a bare number may be a tool's answer, not the model's)."""
    found = _MARKED[0].findall(solution_str[-SOLUTION_CLIP_CHARS:])
    return score_details(f"Answer: {found[-1]}" if found else "", ground_truth)


def compute_score(solution_str: str, ground_truth: str | int) -> float:
    """The arithmetic reward as a float (1.0 correct, 0.0 otherwise)."""
    return score_details(solution_str, ground_truth)["score"]
