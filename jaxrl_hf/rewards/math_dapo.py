"""DAPO math scorer (``math_dapo``, ``math``, ``math_dapo_reasoning``, ``aime*``): +1 / -1 and ``acc``.

DAPO (Yu et al., 2025, §3 "rule-based reward") rewards +1 when the final answer is equivalent to the
ground truth and -1 otherwise. The answer is the last ``Answer: ...`` line, normalised with the Minerva
rules (Lewkowycz et al., 2022, appendix D.1: drop units and filler words, unwrap ``\\text{}``/``\\boxed{}``
and ``$...$``, brace ``\\frac``/``\\sqrt`` shorthand, drop thousands separators). When no ``Answer:``
line exists, the last ``\\boxed{...}`` among the final 100 characters is compared verbatim.
Only the last 300 characters are read (the longest MATH-500 answer has 159), bounding the cost.
Behaviour matches verl's ``math_dapo`` scorer.
"""

from __future__ import annotations

import re

from jaxrl_hf.rewards.hendrycks_math import closing_brace_index

SOLUTION_CLIP_CHARS = 300
BOX_WINDOW_CHARS = 100
INVALID = "[INVALID]"

ANSWER_PATTERN = r"(?i)Answer\s*:\s*([^\n]+)"

# Minerva normalisation tables (data, applied in this order).
_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_REMOVED_EXPRESSIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots",
    "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters",
    "meals", "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}",
    "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ",
    "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_INNER_MATH = re.compile(r".*?\$(.*?)\$.*")
_UNWRAP = tuple(re.compile(p) for p in (r"\\text\{(.*?)\}", r"\\textbf\{(.*?)\}", r"\\overline\{(.*?)\}"))
_UNWRAP_BOXED = re.compile(r"\\boxed\{(.*)\}")
_FRAC_SHORTHAND = re.compile(r"frac([^{])(.)")
_SQRT_SHORTHAND = re.compile(r"sqrt([^{])")


def normalize_final_answer(answer: str) -> str:
    """Minerva normalisation of a final answer (the right side of its last ``=``)."""
    answer = answer.split("=")[-1]
    for old, new in _SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for expr in _REMOVED_EXPRESSIONS:
        answer = answer.replace(expr, "")
    answer = _INNER_MATH.sub(r"$\1$", answer)
    for pattern in _UNWRAP:
        answer = pattern.sub(r"\1", answer)
    answer = _UNWRAP_BOXED.sub(r"\1", answer)
    answer = _FRAC_SHORTHAND.sub(r"frac{\1}{\2}", answer)
    answer = _SQRT_SHORTHAND.sub(r"sqrt{\1}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def last_boxed_argument(text: str) -> str | None:
    """The argument of the last brace-matched ``\\boxed{...}`` in ``text``, or None."""
    idx = text.rfind("\\boxed{")
    if idx < 0:
        return None
    end = closing_brace_index(text, idx)
    return None if end is None else text[idx + len("\\boxed{") : end]


def _answer_line_check(solution: str, truth: str, pattern: str) -> tuple[bool, str]:
    found = re.findall(pattern, solution)
    pred = normalize_final_answer(found[-1] if found else INVALID)
    return pred == normalize_final_answer(truth), pred


def _strict_box_check(solution: str, truth: str, pause_tokens_index: list[int] | None) -> tuple[bool, str | None]:
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must hold 4 indices, got {len(pause_tokens_index)}")
        window = solution[pause_tokens_index[-1] - BOX_WINDOW_CHARS :]
    else:
        window = solution[-BOX_WINDOW_CHARS:]
    pred = last_boxed_argument(window)
    return pred == truth, pred


def score_details(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict:
    """``{"score": +1.0/-1.0, "acc": bool, "pred": str}`` for one response (DAPO's rule reward).

    ``strict_box_verify``: only the last boxed answer (final 100 characters) counts, compared verbatim.
    """
    solution = solution_str[-SOLUTION_CLIP_CHARS:]
    truth = str(ground_truth)
    if strict_box_verify:
        correct, pred = _strict_box_check(solution, truth, pause_tokens_index)
    else:
        correct, pred = _answer_line_check(solution, truth, ANSWER_PATTERN)
        if pred == INVALID:
            box_correct, box_pred = _strict_box_check(solution, truth, pause_tokens_index)
            if box_pred is not None:
                correct, pred = box_correct, box_pred
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}


compute_score = score_details
"""DAPO's scorer returns the dict itself (``score``, ``acc``, ``pred``), like verl's."""
