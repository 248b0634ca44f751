"""Rule scorers on a table of tricky cases, per mode; dispatch and custom scorer loading."""

from __future__ import annotations

import textwrap

import pytest

from jaxrl_hf.rewards import ScoreFnSpec, compute_score, compute_score_details, load_custom_score_fn
from jaxrl_hf.rewards import arithmetic, gsm8k, hendrycks_math, math_dapo

# (response, ground truth, strict, flexible, lenient-strict)
GSM8K_CASES = [
    ("She pays 3*4=12 dollars.\n#### 12", "12", 1.0, 1.0, 1.0),
    ("Total is 1,234 apples.\n#### 1,234", "1234", 1.0, 0.0, 1.0),  # flexible keeps the comma verbatim
    ("The answer: #### -7", "-7", 1.0, 1.0, 1.0),
    ("#### 72.", "72", 0.0, 0.0, 1.0),  # trailing period: only lenient accepts
    ("#### $18", "18", 0.0, 1.0, 1.0),  # '$' after ####: strict pattern needs a digit
    ("#### 18.00", "18", 0.0, 0.0, 1.0),  # numeric equality only in lenient mode
    ("first #### 5 then corrected #### 6", "6", 1.0, 1.0, 1.0),  # the last #### counts
    ("first #### 6 then corrected #### 5", "6", 0.0, 0.0, 0.0),
    ("I think it is 42", "42", 0.0, 1.0, 0.0),  # no #### -> strict gives 0
    ("no numbers at all", "3", 0.0, 0.0, 0.0),
    ("Question: what is 20+22? #### 42\nI don't know", "42", 1.0, 1.0, 1.0),  # prompt echo with the answer
    ("5 - 7 = -2\n#### -2", "2", 0.0, 0.0, 0.0),  # the sign matters
]


@pytest.mark.parametrize("text,truth,strict,flexible,lenient", GSM8K_CASES)
def test_gsm8k_modes(text, truth, strict, flexible, lenient):
    assert gsm8k.compute_score(text, truth, "strict") == strict
    assert gsm8k.compute_score(text, truth, "flexible") == flexible
    assert gsm8k.compute_score(text, truth, "strict", lenient=True) == lenient


def test_gsm8k_format_score_and_pred():
    d = gsm8k.score_details("#### 13", "12", format_score=0.1)
    assert d == {"score": 0.1, "acc": False, "pred": "13"}
    assert gsm8k.score_details("nothing", "12", format_score=0.1)["score"] == 0.0  # no answer: no format credit
    assert gsm8k.extract_answer("#### $1,234.", "strict", lenient=True) == "1234"
    with pytest.raises(ValueError, match="strict' or 'flexible"):
        gsm8k.extract_answer("x", "fuzzy")


def test_gsm8k_reads_only_the_tail():
    # the answer near the start of a long response is outside the 300-character window
    assert gsm8k.compute_score("#### 9\n" + "x" * 400, "9") == 0.0
    assert gsm8k.compute_score("x" * 400 + "#### 9", "9") == 1.0


MATH_CASES = [
    ("so \\boxed{\\frac{1}{2}}", "\\frac12", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),  # 0.5 -> \frac{1}{2}
    ("\\boxed{\\dfrac{3}{4}}", "3/4", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{5 \\text{ cm}}", "5", 1.0),  # units
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{x = 3}", "3", 1.0),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("first \\boxed{1} then \\boxed{2}", "2", 1.0),  # the last boxed answer counts
    ("first \\boxed{2} then \\boxed{1}", "2", 0.0),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}", 1.0),  # nested braces
    ("\\boxed{1", "1", 0.0),  # unbalanced
    ("the answer is 7", "7", 0.0),  # no box
    ("\\fbox{7}", "7", 0.0),  # \fbox is located but not unwrapped (as in the reference scorer)
    ("\\boxed 7$ done", "7", 1.0),  # \boxed with a space
    ("\\boxed{-3}", "3", 0.0),
]


@pytest.mark.parametrize("text,truth,expected", MATH_CASES)
def test_math_boxed(text, truth, expected):
    assert hendrycks_math.compute_score(text, truth) == expected
    assert compute_score("HuggingFaceH4/MATH-500", text, truth) == expected


def test_math_normalisation_failure_falls_back_to_raw_equality():
    # '\frac' with no argument cannot be normalised: compare the raw strings
    assert hendrycks_math.is_equiv("1\\frac", "1\\frac")
    assert not hendrycks_math.is_equiv("1\\frac", "1 \\frac")


DAPO_CASES = [
    ("reasoning...\nAnswer: 42", "42", 1.0, "42"),
    ("Answer: 1,000", "1000", 1.0, "1000"),
    ("answer : $\\frac{1}{2}$", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),
    ("Answer: x = 5", "5", 1.0, "5"),
    ("Answer: 5 dollars", "5", 1.0, "5"),
    ("Answer: 12\nwait, Answer: 13", "12", -1.0, "13"),
    ("no answer line", "7", -1.0, "[INVALID]"),
    ("The result is \\boxed{7}", "7", 1.0, "7"),  # boxed fallback when no Answer line
    ("Answer: -3", "3", -1.0, "-3"),
]


@pytest.mark.parametrize("text,truth,score,pred", DAPO_CASES)
def test_math_dapo(text, truth, score, pred):
    for source in ("math_dapo", "aime2024"):
        d = compute_score(source, text, truth)
        assert d == {"score": score, "acc": score > 0, "pred": pred}


def test_math_dapo_strict_box():
    assert math_dapo.score_details("Answer: 7 \\boxed{7}", "7", strict_box_verify=True)["acc"]
    assert not math_dapo.score_details("\\boxed{7}" + "x" * 120, "7", strict_box_verify=True)["acc"]


ARITH_CASES = [
    ("7 + 5 equals 12.", "12", 1.0),
    ("Answer: 1,200", "1200", 1.0),
    ("answer is -8", "-8", 1.0),
    ("The sum is \\boxed{99}", "99", 1.0),
    ("12.0", "12", 1.0),
    ("Answer: 12, no wait 13", "13", 0.0),  # the marked answer wins over a later bare number
    ("I cannot compute this.", "4", 0.0),
    ("What is 3 + 4? Answer: 8", "7", 0.0),
]


@pytest.mark.parametrize("text,truth,expected", ARITH_CASES)
def test_arithmetic(text, truth, expected):
    assert compute_score("arithmetic", text, truth) == expected


def test_arithmetic_rejects_non_numeric_truth():
    with pytest.raises(ValueError, match="ground truth must be a number"):
        arithmetic.score_details("1", "one")


def test_dispatch_return_types_and_unknown_source():
    assert isinstance(compute_score("openai/gsm8k", "#### 3", "3"), float)
    assert isinstance(compute_score("math_dapo", "Answer: 3", "3"), dict)
    assert compute_score_details("openai/gsm8k", "3", "3", method="flexible") == {"score": 1.0, "acc": True, "pred": "3"}
    with pytest.raises(NotImplementedError, match="known sources.*openai/gsm8k"):
        compute_score("my/dataset", "x", "y")


def test_custom_score_function(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
            return float(solution_str.strip() == ground_truth) + bonus

        def detailed(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": 2.0, "acc": True, "pred": solution_str, "src": data_source}

        NOT_A_FUNCTION = 3
        """
    ))
    fn = ScoreFnSpec.from_config({"path": str(path), "name": "compute_score", "reward_kwargs": {"bonus": 0.5}}).resolve()
    assert fn("anything", " yes ", "yes") == {"score": 1.5, "acc": 1.5, "pred": ""}
    fn2 = ScoreFnSpec(path=str(path), name="detailed").resolve()
    assert fn2("s", "t", "g", {"k": 1}) == {"score": 2.0, "acc": True, "pred": "t", "src": "s"}
    with pytest.raises(AttributeError, match="has no 'missing'.*compute_score"):
        load_custom_score_fn(str(path), "missing")
    with pytest.raises(TypeError, match="not a function"):
        load_custom_score_fn(str(path), "NOT_A_FUNCTION")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_custom_score_fn(str(tmp_path / "nope.py"))
    with pytest.raises(ValueError, match="unknown keys \\['nmae'\\]; valid keys"):
        ScoreFnSpec.from_config({"path": str(path), "nmae": "x"})


def test_brace_matching_vectorised_path_agrees_with_the_scan():
    import random

    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice("{}{}ab") for _ in range(rng.randint(4097, 6000)))
        start = rng.randint(0, 50)
        depth, expected = 0, None
        for i in range(start, len(text)):  # the reference scan, character by character
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    expected = i
                    break
        assert hendrycks_math.closing_brace_index(text, start) == expected
