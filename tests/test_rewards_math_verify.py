"""``reward_model.scorer=math_verify``: Math-Verify's equivalence through the project's scorers, bounded by the
project's own time limit (Math-Verify's signal-based timeouts are off so they cannot replace it)."""

from __future__ import annotations

import time

import pytest

from jaxrl_hf.config import load_config
from jaxrl_hf.config.build import ConfigError
from jaxrl_hf.rewards import ScoreFnSpec
from jaxrl_hf.rewards.math_verify_scorer import score_details
from jaxrl_hf.rewards.pool import make_scorer

pytest.importorskip("math_verify")

SLOW = ("\\boxed{(x+1)^{3000}}", "(x+2)^{3000}")  # ~20 s of sympy expansion on this CPU, interruptible
STUCK = ("\\boxed{9^{9^{9^{9}}}}", "2")       # one bignum power in C: no signal handler runs until it ends


@pytest.mark.parametrize("response, truth, correct", [
    ("so the answer is $\\frac{1}{2}$", "0.5", True),
    ("The answer is \\boxed{x^2+2x}", "x(x+2)", True),
    ("The final answer is 42.", "42", True),
    ("The final answer is 41.", "42", False),
    ("$\\boxed{[1,2)}$", "[1, 2)", True),
    ("$\\boxed{(1,2)}$", "[1, 2)", False),
    ("no answer here", "42", False),
    ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", True),
])
def test_equivalence(response, truth, correct):
    details = score_details(response, truth)
    assert details["acc"] is correct and details["score"] == float(correct)


def test_the_scorer_applies_to_every_data_source_and_leaves_auto_alone():
    fn = ScoreFnSpec(scorer="math_verify").resolve()
    assert fn("openai/gsm8k", "It is \\frac{84}{2}", "42", None)["score"] == 1.0  # GSM8K's own scorer says 0
    assert ScoreFnSpec().resolve()("openai/gsm8k", "It is \\frac{84}{2}", "42", None)["score"] == 0.0


def test_the_project_time_limit_bounds_a_slow_comparison_in_process():
    scorer = make_scorer(ScoreFnSpec(scorer="math_verify"), num_workers=0, timeout_s=1.5)  # fast scores fit even on a loaded machine
    start = time.perf_counter()
    slow, fast = scorer.score([("math", *SLOW, None), ("math", "\\boxed{3}", "3", None)])
    assert time.perf_counter() - start < 5.0
    assert slow["timed_out"] and slow["score"] == 0.0 and fast["score"] == 1.0 and not fast["timed_out"]


@pytest.mark.slow
def test_the_pool_deadline_ends_a_comparison_no_signal_can_interrupt():
    scorer = make_scorer(ScoreFnSpec(scorer="math_verify"), num_workers=1, timeout_s=3.0)  # > a fresh worker's start
    try:
        start = time.perf_counter()
        stuck, fast = scorer.score([("math", *STUCK, None), ("math", "\\boxed{0.25}", "\\frac{1}{4}", None)])
        assert time.perf_counter() - start < 40
        assert stuck["timed_out"] and stuck["score"] == 0.0 and fast["score"] == 1.0
    finally:
        scorer.close()


def test_config_key_and_its_errors(tmp_path):
    config = load_config("grpo", preset="smoke", overrides=["reward_model.scorer=math_verify"])
    assert config.reward_model.scorer == "math_verify"
    custom = tmp_path / "score.py"
    custom.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with pytest.raises(ConfigError, match="reward_model.scorer.*pick one"):
        load_config("grpo", preset="smoke", overrides=["reward_model.scorer=math_verify",
                                                       f"custom_reward_function.path={custom}"])
    with pytest.raises(ConfigError, match="reward_model.scorer"):
        load_config("grpo", preset="smoke", overrides=["reward_model.scorer=sympy"])
