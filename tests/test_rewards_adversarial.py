"""Time bounds: megabyte adversarial outputs score fast; runaway scorers are cut off and score 0."""

from __future__ import annotations

import logging
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxrl_hf.rewards import NaiveRewardManager, ScoreFnSpec, compute_score, time_limit, ScoreTimeout

MB = 1_000_000
ADVERSARIAL = {
    "deep_open_braces": "\\boxed" + "{" * MB,
    "deep_balanced_braces": "\\boxed{" + "{" * (MB // 2) + "}" * (MB // 2),
    "many_boxes": "\\boxed{1}" * (MB // 9),
    "huge_number": "#### " + "9" * MB,
    "huge_number_commas": "#### " + "1," * (MB // 2),
    "answer_spaces": "Answer:" + " " * MB + "x",
    "answer_lines": "Answer: 1\n" * (MB // 10),
    "frac_chain": "\\boxed{" + "\\frac" * (MB // 5) + "}",
    "sqrt_chain": "\\boxed{" + "\\sqrt" * (MB // 5) + "1}",
    "text_units": "\\boxed{" + "\\text{ " * (MB // 7) + "}",
    "dollars": "$" * MB,
    "digits_dots": "1." * (MB // 2),
    "boxed_space": "\\boxed " * (MB // 7),
}
SOURCES = ["openai/gsm8k", "lighteval/MATH", "math_dapo", "arithmetic"]


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_megabyte_adversarial_outputs_score_well_under_a_second(name):
    text = ADVERSARIAL[name]
    assert len(text) >= 0.9 * MB
    for source in SOURCES:
        start = time.perf_counter()
        compute_score(source, text, "12")
        elapsed = time.perf_counter() - start
        assert elapsed < 0.5, f"{source} took {elapsed:.3f} s on {name}"


def test_time_limit_interrupts_python_code():
    start = time.perf_counter()
    with pytest.raises(ScoreTimeout):
        with time_limit(0.2):
            while True:
                pass
    assert time.perf_counter() - start < 1.0


class _SlowToCollect:
    spent = 0.0

    def __del__(self):  # Python ignores an exception raised in here ("Exception ignored in ...")
        start = time.perf_counter()
        try:
            while time.perf_counter() < start + 0.5:
                pass
        finally:
            _SlowToCollect.spent = time.perf_counter() - start


def test_time_limit_raises_again_when_its_first_raise_lands_where_python_ignores_it(monkeypatch):
    """The limit's first SIGALRM arrives inside a ``__del__`` (as inside JAX's gc callback in a real run), where
    the raise is ignored; the timer fires again and the call still stops soon after the limit (a one-shot timer
    would let the loop below run its 3 s). The ignored raise is not reported: no "Exception ignored" line, and no
    pytest unraisable-exception failure (this test no longer filters that warning)."""
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", reports.append)
    start = time.perf_counter()
    with pytest.raises(ScoreTimeout):
        with time_limit(0.2):
            _SlowToCollect()  # collected at once: its __del__ spans the limit and swallows the first raise
            while time.perf_counter() < start + 3.0:
                pass
    assert _SlowToCollect.spent < 0.45  # the first raise did land in __del__ (and was ignored there)
    assert time.perf_counter() - start < 1.0
    assert reports == [] and sys.unraisablehook == reports.append  # dropped while armed; the hook is restored


class _FailsToCollect:
    def __del__(self):
        raise ValueError("a scorer's own error in __del__")


def test_time_limit_passes_other_ignored_errors_on_and_never_interrupts_their_report(monkeypatch):
    """Another error Python ignores inside the body still reaches the previous ``sys.unraisablehook``, and a retry
    due while that hook runs (here it spans the limit, as pytest's traceback formatting did in CI) waits until the
    hook returns: the report is written whole, then the body stops."""
    reports = []

    def slow_hook(unraisable):
        until = time.perf_counter() + 0.4
        while time.perf_counter() < until:
            pass
        reports.append(unraisable.exc_type)

    monkeypatch.setattr(sys, "unraisablehook", slow_hook)
    start = time.perf_counter()
    with pytest.raises(ScoreTimeout):
        with time_limit(0.2):
            _FailsToCollect()
            while time.perf_counter() < start + 3.0:
                pass
    assert reports == [ValueError]
    assert time.perf_counter() - start < 1.0


SLOW_SCORER = textwrap.dedent(
    """
    import hashlib

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "LOOP":
            while True:  # a runaway pure-Python scorer: SIGALRM interrupts it
                pass
        if solution_str == "C_CALL":
            # minutes inside one C call that never checks for signals: SIGALRM cannot interrupt it
            hashlib.pbkdf2_hmac("sha256", b"x", b"y", 2**31 - 1)
        return float(solution_str == ground_truth)
    """
)


def _batch(texts):
    n, t = len(texts), 4
    ids = np.ones((n, t), np.int64)
    mask = np.ones((n, t), np.int64)
    return ids, mask, ["custom"] * n, ["ok"] * n, None, texts


def test_serial_manager_cuts_off_runaway_scorer(tmp_path, caplog):
    path = tmp_path / "slow.py"
    path.write_text(SLOW_SCORER)
    manager = NaiveRewardManager(ScoreFnSpec(path=str(path)), timeout_s=0.3)
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="jaxrl_hf.rewards"):
        out = manager(*_batch(["ok", "LOOP", "bad"]))
    assert time.perf_counter() - start < 3.0
    assert out.extras["score"] == [1.0, 0.0, 0.0]
    assert out.extras["timed_out"] == [False, True, False]
    assert out.metrics["reward/timeouts"] == 1.0
    assert any("exceeded" in r.getMessage() and "scored 0" in r.getMessage() for r in caplog.records)


def test_pool_manager_survives_a_hang_inside_a_c_call(tmp_path, caplog):
    path = tmp_path / "slow.py"
    path.write_text(SLOW_SCORER)
    texts = ["ok", "LOOP", "ok", "C_CALL", "bad", "ok"]
    with NaiveRewardManager(ScoreFnSpec(path=str(path)), num_workers=2, timeout_s=0.5) as manager:
        with caplog.at_level(logging.WARNING, logger="jaxrl_hf.rewards"):
            start = time.perf_counter()
            out = manager(*_batch(texts))
            elapsed = time.perf_counter() - start
        # the pool is rebuilt after terminating the stuck worker and keeps scoring
        again = manager(*_batch(["ok", "bad"]))
    assert out.extras["score"] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert out.extras["timed_out"] == [False, True, False, True, False, False]
    assert elapsed < 30.0
    assert again.extras["score"] == [1.0, 0.0]
    assert any("rescoring them one per task" in r.getMessage() for r in caplog.records)
