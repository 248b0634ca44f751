"""Differential test: jaxrl_hf's rule scorers give verl's scores on the same responses.

verl (test-only, ``pip install --no-deps verl``) is the reference the issue names. Inputs: the real
GSM8K reference solutions (and variants a model writes: trailing periods, ``$``, prose after the
answer, no ``####``), plus a seeded random corpus assembled from the tokens the scorers react to
(``####``, ``\\boxed{``, ``Answer:``, ``\\frac``, units, ``$``, braces, commas, signs, newlines).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random

import pytest

from _rewards_verl_reference import load_verl_scorers
from jaxrl_hf.rewards import gsm8k, hendrycks_math, math_dapo
from jaxrl_hf.data.gsm8k import default_gsm8k_dir

VERL = load_verl_scorers()
pytestmark = pytest.mark.skipif(VERL is None, reason="verl is not installed (pip install --no-deps verl)")

GSM8K_TEST = os.path.join(default_gsm8k_dir(), "test.jsonl")

TOKENS = [
    "1", "2", "3", "0", "7", "12", "0.5", ".5", "1,234", "-", ",", ".", "####", "#### ", " ", "$", "\\$",
    "\\boxed{", "\\boxed ", "\\fbox{", "}", "{", "\\frac", "\\frac12", "\\dfrac{1}{2}", "\\tfrac", "\\sqrt",
    "\\sqrt2", "\\text{ ", "\\text{cm}", "\\text{", "Answer:", "answer :", "ANSWER: ", "\n", "=", "k=", "x = ",
    "\\left(", "\\right)", "^\\circ", "^{\\circ}", "\\%", "%", "/", "3/4", "a ", "an ", "dollars", "units",
    "\\!", "\\\\", "\\mbox{and}", "\\text{and}", "\\ldots", "\\overline{", "\\textbf{", "{,}", ",\\!", '"',
    "00", "-0", "+3", "x", "\\pi", "inf", "\t",
]
TRUTHS = ["12", "0.5", "\\frac{1}{2}", "1234", "-3", "3/4", "\\frac34", "\\sqrt{2}", "0", "5 \\text{ cm}",
          "1,234", "\\dfrac{3}{4}", "x=3", "\\$5", "90^\\circ"]


def _quiet(fn, *args, **kwargs):
    with contextlib.redirect_stdout(io.StringIO()):  # verl's MATH scorer prints caught exceptions
        return fn(*args, **kwargs)


def _assert_same(text: str, truth: str) -> None:
    for method in ("strict", "flexible"):
        assert gsm8k.compute_score(text, truth, method) == VERL["gsm8k"].compute_score(text, truth, method=method), (method, text, truth)
    assert hendrycks_math.compute_score(text, truth) == _quiet(VERL["math"].compute_score, text, truth), (text, truth)
    mine, ref = math_dapo.compute_score(text, truth), VERL["math_dapo"].compute_score(text, truth)
    assert (mine["score"], mine["acc"], mine["pred"]) == (ref["score"], ref["acc"], ref["pred"]), (text, truth)


def test_parity_on_gsm8k_reference_solutions_and_model_style_variants():
    with open(GSM8K_TEST, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh][:400]
    rng = random.Random(0)
    variants = [
        lambda a, t: a,
        lambda a, t: a + ".",
        lambda a, t: a.replace("#### ", "#### $"),
        lambda a, t: a.replace("#### ", "The answer is ") + " dollars.",
        lambda a, t: a + "\n\nAnswer: " + t,
        lambda a, t: a.replace(f"#### {t}", f"\\boxed{{{t}}}"),
        lambda a, t: "Question: ... #### 0\n" + a.rsplit("####", 1)[0],
    ]
    for row in rows:
        answer = row["answer"]
        truth = answer.rsplit("#### ", 1)[1].replace(",", "")
        variant = rng.choice(variants)
        _assert_same(variant(answer, truth), truth)
        _assert_same(answer, truth)


def test_parity_on_random_token_soup():
    rng = random.Random(1234)
    for _ in range(4000):
        text = "".join(rng.choice(TOKENS) for _ in range(rng.randint(0, 40)))
        truth = rng.choice(TRUTHS) if rng.random() < 0.7 else "".join(rng.choice(TOKENS) for _ in range(rng.randint(1, 5)))
        if rng.random() < 0.3:
            text += rng.choice(["\\boxed{", "Answer: ", "#### "]) + truth + rng.choice(["}", "", ".", "$", " ", "\n"])
        _assert_same(text, truth)
