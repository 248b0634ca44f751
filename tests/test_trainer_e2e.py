"""End to end through ``launch/train.py``, Ray and the worker groups on the smoke preset (tiny random model).

* resume equality: a run stopped after its step-2 checkpoint and resumed with a larger ``trainer.total_steps``
  logs exactly the metrics of an uninterrupted run for the later steps (wall-clock metrics excluded);
* every algorithm runs 2 steps and logs verl's metric names;
* a DAPO step whose dynamic sampling needs refills (a scorer that random text passes about half the time).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from jaxrl_hf.trainer.metrics import is_wall_clock_metric

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ("step", "critic/score/mean", "response_length/mean", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
            "actor/grad_norm", "timing_s/step", "perf/throughput")


def train(algo: str, run_dir, *overrides: str, timeout: int = 240) -> list[dict]:
    """``python launch/train.py --algo A --preset smoke trainer.run_dir=DIR ...``; returns metrics.jsonl."""
    cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "--algo", algo, "--preset", "smoke",
           f"trainer.run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not is_wall_clock_metric(k)}


def test_resume_after_checkpoint_logs_the_same_metrics(tmp_path):
    full = train("grpo", tmp_path / "full", "trainer.total_steps=3", "trainer.save_freq=1")
    part = train("grpo", tmp_path / "part", "trainer.total_steps=2", "trainer.save_freq=1")
    assert os.path.isdir(tmp_path / "part" / "checkpoints" / "global_step_2" / "actor")
    resumed = train("grpo", tmp_path / "part", "trainer.total_steps=3", "trainer.save_freq=1")
    assert [r["step"] for r in full] == [1, 2, 3] and [r["step"] for r in part] == [1, 2]
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in REQUIRED:
        assert key in full[-1], f"metrics.jsonl lacks {key}"
    assert comparable(resumed[2]) == comparable(full[2])
    assert comparable(resumed[0]) == comparable(full[0])  # earlier records kept as they were
    assert full[1]["critic/score/mean"] == full[1]["critic/score/mean"]  # finite numbers
    assert all(math.isfinite(v) for v in comparable(full[2]).values() if isinstance(v, float))


@pytest.mark.parametrize("algo", ["dapo", "ppo", "remax", "rloo", "reinforce_pp", "gspo", "safe_rlhf"])
def test_every_algorithm_runs_two_smoke_steps(tmp_path, algo):
    records = train(algo, tmp_path / algo)
    assert [r["step"] for r in records] == [1, 2]
    for key in REQUIRED:
        assert key in records[-1], f"{algo}: metrics.jsonl lacks {key}"
    if algo in ("ppo", "safe_rlhf"):
        assert "critic/vf_loss" in records[-1] and "critic/values/mean" in records[-1]
    if algo in ("ppo", "remax", "rloo", "reinforce_pp", "safe_rlhf"):
        assert records[-1]["actor/reward_kl_penalty_coeff"] > 0
    if algo == "safe_rlhf":
        assert "safe_rlhf/lambda" in records[-1] and "cost_critic/vf_loss" in records[-1]
    assert os.path.isfile(tmp_path / algo / "checkpoints" / "global_step_2" / "trainer_state.json")


PARITY_SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the decoded response has an even number of characters: random text passes about half the time."""
    return float(len(solution_str) % 2 == 0)
'''


def test_dapo_dynamic_sampling_refills(tmp_path):
    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY_SCORER)
    records = train("dapo", tmp_path / "dapo", "trainer.total_steps=1", "algorithm.filter_groups.enable=true",
                    "algorithm.filter_groups.metric=score", "algorithm.filter_groups.max_num_gen_batches=12",
                    "data.gen_batch_size=2", f"custom_reward_function.path={scorer}",
                    "reward_model.overlong_buffer.enable=false", "trainer.val_before_train=false")
    rec = records[0]
    assert rec["dynamic_sampling/num_gen_batches"] >= 2  # 2 prompts per round, 4 informative groups needed
    assert rec["dynamic_sampling/num_informative_prompts"] >= 4
    assert 0 < rec["critic/score/mean"] < 1  # only mixed groups were trained on
