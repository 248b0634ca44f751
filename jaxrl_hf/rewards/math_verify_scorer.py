"""Math-Verify as a scorer (``reward_model.scorer=math_verify``): the answer is correct when Hugging Face's
``math-verify`` finds the response's final expression mathematically equal to the ground truth (sympy
equivalence of LaTeX or plain expressions: ``\\frac{1}{2}`` = ``0.5``, ``x^2+2x`` = ``x(x+2)``, sets, intervals).

As verl's ``math_verify.compute_score``: the ground truth is read as ``\\boxed{<ground truth>}`` with the LaTeX
extractor, the response with the expression and LaTeX extractors; score 1.0 if equal, else 0.0. The package's own
time limits use ``signal.alarm`` and would replace the alarm this project's scorer arms around every score
(``rewards/timeouts.py``), so both are switched off here (``parsing_timeout=None``, ``timeout_seconds=None``):
``reward_model.timeout_s`` is the one bound on a score, in process or on the scoring pool.

Optional dependency: ``pip install 'jaxrl_hf[math]'`` (``math-verify``).
"""

from __future__ import annotations

import logging
from typing import Any

SOLUTION_CLIP_CHARS = 1000
"""Characters from the end of the response that are searched (the final answer is at the end); bounds the
cost of an adversarial megabyte response."""

INSTALL_HINT = "reward_model.scorer=math_verify needs the math-verify package: pip install 'jaxrl_hf[math]'"


class _DropDisabledTimeoutNotice(logging.Filter):
    """math-verify warns once that its timeouts are off; here that is by design (see the module docstring)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutNotice())


def available() -> bool:
    """Whether ``math_verify`` imports."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def warm_up() -> None:
    """Import Math-Verify and build its parsers once (about a second), so that the first score of a process does
    not spend its time limit on imports."""
    score_details("\\boxed{1}", "1")


def score_details(solution_str: str, ground_truth: Any) -> dict:
    """``{"score": 1.0|0.0, "acc": bool, "pred": the extracted answer or None}``."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    truth = str(ground_truth)
    gold = parse(truth if "\\boxed" in truth else f"\\boxed{{{truth}}}",
                 extraction_config=(LatexExtractionConfig(),), parsing_timeout=None)
    pred = parse(solution_str[-SOLUTION_CLIP_CHARS:], extraction_config=(ExprExtractionConfig(), LatexExtractionConfig()),
                 parsing_timeout=None)
    correct = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))
    answer = (str(pred[-1]) if pred else None)
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": answer}


def compute_score_details(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                          **kwargs: Any) -> dict:
    """The dispatch signature (``rewards/dispatch.py``) for every data source: Math-Verify whatever the source."""
    del data_source, extra_info
    return score_details(solution_str, ground_truth, **kwargs)
