"""Non-finite numbers end a run by name: a NaN reward from a scorer at once, non-finite updates after
trainer.max_nonfinite_steps skipped steps in a row (each skipped update leaves the weights unchanged)."""

import json

import pytest

from jaxrl_hf.errors import ExitCode
from jaxrl_hf.trainer.nonfinite import NonFiniteGuard, non_finite_quantities

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("trainer_session")]

NAN_SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")
'''


def _run(tmp_path, *overrides):
    from jaxrl_hf.trainer import run

    return run("grpo", preset="smoke", overrides=[f"trainer.run_dir={tmp_path / 'run'}", "trainer.save_freq=0",
                                                  "trainer.val_before_train=false", *overrides])


def test_a_nan_reward_stops_the_run_naming_the_source_and_row(tmp_path, capsys):
    scorer = tmp_path / "nan_scorer.py"
    scorer.write_text(NAN_SCORER)
    assert _run(tmp_path, f"custom_reward_function.path={scorer}") == ExitCode.NON_FINITE
    err = capsys.readouterr().err
    assert "data source 'arithmetic' returned nan for row 0" in err and "Traceback" not in err


def test_updates_that_keep_going_non_finite_stop_after_max_nonfinite_steps(tmp_path, capsys):
    # lr 1e30: the first Adam update moves every weight by ~1e30, so from step 2 on the loss overflows to nan/inf
    code = _run(tmp_path, "actor.optim.lr=1e30", "actor.optim.warmup_steps=0", "trainer.total_steps=6",
                "trainer.max_nonfinite_steps=2", "trainer.test_freq=0")
    err = capsys.readouterr().err
    assert code == ExitCode.NON_FINITE, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["actor/skipped"] < 1.0  # step 1: its first update is finite and applied
    assert [r["actor/skipped"] for r in records[1:]] == [1.0, 1.0] and len(records) == 3  # logged, then stopped
    assert "step 3: the actor skipped every update for 2 steps in a row" in err
    assert "non-finite at step 3: grad norm: actor/grad_norm" in err and "trainer.max_nonfinite_steps=2" in err


def test_the_guard_counts_only_consecutive_fully_skipped_steps():
    guard = NonFiniteGuard(2)
    guard.check(1, {"actor/skipped": 1.0, "actor/pg_loss": "nan"})
    guard.check(2, {"actor/skipped": 0.5})  # some updates applied: the streak restarts
    guard.check(3, {"actor/skipped": 1.0})
    with pytest.raises(Exception, match="critic skipped every update for 2 steps"):
        guard.check(4, {"actor/skipped": 0.0, "critic/skipped": 1.0, "critic/vf_loss": float("inf")}) or \
            guard.check(5, {"critic/skipped": 1.0, "critic/vf_loss": float("inf")})
    assert non_finite_quantities({"actor/grad_norm": "nan", "critic/advantages/max": float("inf"),
                                  "timing_s/gen": float("nan"), "actor/entropy": 1.0}) == {
        "grad norm": ["actor/grad_norm"], "advantages": ["critic/advantages/max"]}
