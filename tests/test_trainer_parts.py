"""Driver-side trainer pieces against independent numpy references: advantages and KL-in-reward on Batches,
dynamic-sampling refill, dp balancing, validation aggregation, checkpoint bookkeeping, jsonl truncation."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxrl_hf.config import load_config
from jaxrl_hf.controller import Batch
from jaxrl_hf.trainer.advantage import (KLController, compute_advantage, dense_uid, kl_in_reward, safe_rlhf_advantage,
                                        update_lagrange)
from jaxrl_hf.trainer.balance import balance_permutation, balanced_partitions
from jaxrl_hf.trainer.checkpointing import CheckpointError, CheckpointManager, list_checkpoints, load_trainer_state
from jaxrl_hf.trainer.dynamic_sampling import DynamicSamplingError, collect_informative_groups
from jaxrl_hf.trainer.logging import MetricLogger, read_jsonl
from jaxrl_hf.trainer.validation import aggregate_validation, majority_value


def _outcome_batch(scores, lengths, uids, width=6):
    mask = (np.arange(width)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    tls = np.zeros((len(scores), width), np.float32)
    tls[np.arange(len(scores)), np.asarray(lengths) - 1] = scores
    return Batch.from_dict({"token_level_rewards": tls, "token_level_scores": tls, "response_mask": mask,
                            "uid": np.asarray(uids, np.int64)})


def test_grpo_advantage_on_a_batch_matches_numpy():
    rng = np.random.default_rng(0)
    uids = np.repeat([7_000_000, 7_000_001, 7_010_000], 4)
    scores = rng.normal(size=12).astype(np.float32)
    lengths = rng.integers(1, 7, size=12)
    batch = _outcome_batch(scores, lengths, uids)
    cfg = load_config("grpo").algorithm
    adv = compute_advantage(batch, cfg)["advantages"]
    ref = np.zeros(12)
    for g in np.unique(uids):
        idx = uids == g
        s = scores[idx].astype(np.float64)
        ref[idx] = (s - s.mean()) / (s.std(ddof=1) + 1e-6)
    expected = ref[:, None] * batch["response_mask"]
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-5)
    assert dense_uid(uids).tolist() == [0] * 4 + [1] * 4 + [2] * 4


def test_kl_in_reward_and_adaptive_controller_match_formula():
    rng = np.random.default_rng(1)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.int32)
    old, ref = rng.normal(size=(2, 4)).astype(np.float32), rng.normal(size=(2, 4)).astype(np.float32)
    scores = np.array([[0, 0, 1.0, 0], [0, 0.5, 0, 0]], np.float32)
    batch = Batch.from_dict({"token_level_scores": scores, "old_log_probs": old, "ref_log_prob": ref, "response_mask": mask})
    ctrl = KLController(value=0.1, kind="adaptive", target_kl=0.05, horizon=100.0)
    shaped, metrics = kl_in_reward(batch, ctrl, "kl")
    kl = (old.astype(np.float64) - ref) * mask
    np.testing.assert_allclose(shaped["token_level_rewards"], scores - 0.1 * kl, rtol=1e-5, atol=1e-6)
    current = np.mean(kl.sum(-1) / mask.sum(-1))
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current, rel=1e-5)
    err = np.clip(current / 0.05 - 1, -0.2, 0.2)
    assert ctrl.value == pytest.approx(0.1 * (1 + err * 2 / 100.0), rel=1e-6)
    state = ctrl.state_dict()
    other = KLController.from_config(load_config("ppo").algorithm.kl_ctrl)
    other.load_state_dict(json.loads(json.dumps(state)))
    assert other == ctrl


def test_safe_rlhf_lagrangian_pieces():
    ra, ca = np.array([1.0, -2.0]), np.array([0.5, 1.0])
    np.testing.assert_allclose(safe_rlhf_advantage(ra, ca, 1.0), [(1 - 0.5) / 2, (-2 - 1) / 2])
    assert update_lagrange(1.0, mean_cost=2.0, cost_limit=0.0, lr=0.1, lambda_max=10) == pytest.approx(1.2)
    assert update_lagrange(0.05, mean_cost=-1.0, cost_limit=0.0, lr=0.1, lambda_max=10) == 0.0


def _scripted_round(acc_rows_by_round, n):
    """Generation rounds whose per-sample accuracies are given (a stand-in for generate+score data)."""
    def generate_round(r):
        accs = np.asarray(acc_rows_by_round[r], np.float32)
        groups = len(accs) // n
        uids = np.repeat(np.arange(groups) + 10_000 * r, n)
        return Batch.from_dict({"acc": accs, "seq_score": accs, "uid": uids, "response_mask": np.ones((len(accs), 2), np.int32)})
    return generate_round


def test_dynamic_sampling_refills_until_enough_informative_groups():
    n = 2  # rounds of 3 prompts x 2 samples; informative = groups with mixed accuracy
    rounds = [[0, 0, 1, 0, 1, 1],      # 1 informative (group 1)
              [1, 1, 0, 0, 0, 0],      # 0 informative
              [0, 1, 1, 0, 0, 1]]      # 3 informative
    batch, metrics = collect_informative_groups(_scripted_round(rounds, n), target_prompts=3, samples_per_prompt=n,
                                                metric="acc", max_num_gen_batches=4)
    assert metrics["dynamic_sampling/num_gen_batches"] == 3
    assert metrics["dynamic_sampling/num_informative_prompts"] == 4
    assert len(batch) == 6  # exactly train_batch_size * n
    assert batch["uid"].tolist() == [1, 1, 20_000, 20_000, 20_001, 20_001]  # first kept groups, whole groups
    for g in range(3):
        assert batch["acc"][2 * g] != batch["acc"][2 * g + 1]


def test_dynamic_sampling_gives_up_with_a_clear_error():
    rounds = [[0, 0, 1, 1]] * 5
    with pytest.raises(DynamicSamplingError, match=r"max_num_gen_batches \(now 2\)") as err:
        collect_informative_groups(_scripted_round(rounds, 2), 2, 2, "acc", max_num_gen_batches=2)
    assert "only 0 of the 2 prompt groups" in str(err.value) and "after 2 generation rounds" in str(err.value)


def test_balanced_partitions_equal_counts_and_tight_spread():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 200, size=32)
    parts = balanced_partitions(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(32))
    assert all(len(p) == 8 for p in parts)
    sums = [int(lengths[p].sum()) for p in parts]
    assert max(sums) - min(sums) <= lengths.max()  # LPT bound: within one item
    mask = (np.arange(200)[None] < lengths[:, None]).astype(np.int32)
    perm, metrics = balance_permutation(mask, 4)
    assert metrics["balance/tokens_spread_after"] <= metrics["balance/tokens_spread_before"]
    assert sorted(perm.tolist()) == list(range(32))


def test_validation_aggregation_by_source():
    sources = ["a"] * 6 + ["b"] * 3
    uids = [0, 0, 0, 1, 1, 1, 2, 2, 2]
    acc = np.array([1, 0, 0, 1, 1, 0, 0, 0, 0], np.float32)
    preds = ["5", "6", "6", "9", "9", None, "1", "2", "3"]
    m = aggregate_validation(sources, uids, {"acc": acc}, preds, n=3)
    assert m["val-core/a/acc/mean@3"] == pytest.approx(3 / 6)
    assert m["val-aux/a/acc/best@3/mean"] == pytest.approx(1.0)
    assert m["val-aux/a/acc/maj@3/mean"] == pytest.approx((0 + 1) / 2)  # majority '6' is wrong, '9' right
    assert m["val-core/b/acc/mean@3"] == 0.0 and m["val-aux/b/num_prompts"] == 1
    assert majority_value([None, None], [1.0, 1.0]) == 0.0


def _writer(payload):
    def save(path):
        os.makedirs(path)
        with open(os.path.join(path, "weights.txt"), "w") as fh:
            fh.write(payload)
    return save


def test_checkpoint_manager_atomic_commit_retention_and_resume(tmp_path):
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), max_to_keep=2)
    assert ckpt.resume_path("auto") is None
    for step in (1, 2, 3):
        ckpt.save(step, {"actor": _writer(f"w{step}")}, {"global_step": step})
    assert list_checkpoints(ckpt.ckpt_dir) == [2, 3]  # step 1 pruned
    assert ckpt.latest_step() == 3

    def crash(path):
        os.makedirs(path)
        raise RuntimeError("killed mid-save")

    with pytest.raises(RuntimeError):
        ckpt.save(4, {"actor": _writer("w4"), "critic": crash}, {"global_step": 4})
    assert ckpt.latest_step() == 3  # the half-written step 4 is not visible
    latest = ckpt.resume_path("auto")
    assert load_trainer_state(latest)["global_step"] == 3
    assert open(os.path.join(latest, "actor", "weights.txt")).read() == "w3"
    ckpt.save(4, {"actor": _writer("w4")}, {"global_step": 4})  # leftovers of the crash are cleaned
    assert not [n for n in os.listdir(ckpt.ckpt_dir) if n.startswith(".tmp_")]
    assert ckpt.resume_path("disable") is None
    assert ckpt.resume_path("resume_path", os.path.join(ckpt.ckpt_dir, "global_step_3")).endswith("global_step_3")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        ckpt.resume_path("resume_path", str(tmp_path / "nope"))


def test_metric_logger_truncates_on_resume(tmp_path):
    log = MetricLogger(str(tmp_path), ["jsonl"])
    for step in (1, 2, 3):
        log.log(step, {"critic/score/mean": step / 10, "actor/grad_norm": float("nan")})
    log.close()
    MetricLogger(str(tmp_path), ["jsonl"], resume_step=2).close()  # resumed from the step-2 checkpoint
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2] and records[0]["actor/grad_norm"] == "nan"
    MetricLogger(str(tmp_path), ["jsonl"]).close()  # a fresh run starts a fresh file
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_mfu_counts_weights_and_causal_attention_over_real_tokens():
    """perf/mfu/actor against a float64 count, token by token: 6·N per token plus, per layer, 2·a FLOPs for QKᵀ and
    2·a for AV per key a token attends to, ×3 for forward + backward; padding counts nothing."""
    from jaxrl_hf.trainer.metrics import mfu_metric

    mask = np.zeros((3, 10), np.int32)
    mask[0, :10], mask[1, 2:9], mask[2, 5:6] = 1, 1, 1  # 10, 7 and 1 real tokens, left and right padding
    n, layers, a, epochs, devices, peak, seconds = 1_000_000, 4, 64, 2, 2, 1e9, 2.0
    expected = 0.0
    for length in (10, 7, 1):
        for position in range(1, length + 1):  # the token at `position` attends to `position` keys
            expected += 3 * (2 * n + layers * (2 * a * position + 2 * a * position))
    expected *= epochs
    info = {"model_params": n, "num_layers": layers, "attn_dim": a, "peak_flops_per_device": peak}
    m = mfu_metric(Batch.from_dict({"attention_mask": mask}), {"update_actor": seconds}, info, epochs, devices)
    assert m["perf/mfu/actor"] == pytest.approx(expected / (seconds * devices * peak), rel=1e-12)
    assert m["perf/peak_flops_per_device"] == peak
    assert mfu_metric(Batch.from_dict({"attention_mask": mask}), {"update_actor": seconds},
                      {**info, "peak_flops_per_device": None}, 1, 1) == {}


def test_mfu_of_a_shared_prompt_update_counts_each_prompt_once():
    """With ``actor.share_prompt_forward`` the update computes a group's prompt once: the count is a float64 one of
    the prompt once per group plus every sample's response attending over prompt and response."""
    from jaxrl_hf.trainer.metrics import mfu_metric

    P, R = 6, 4
    mask = np.zeros((4, P + R), np.int32)  # 2 groups of 2 samples: prompts of 4 and 6 tokens
    mask[0:2, 2:P] = mask[2:4, 0:P] = 1
    for row, r in enumerate((4, 2, 1, 3)):
        mask[row, P:P + r] = 1
    n, layers, a, devices, peak, seconds = 1_000_000, 4, 64, 1, 1e9, 1.0
    pair = 3 * layers * 4 * a  # one query-key pair: QKᵀ and AV, 2·a each, forward + backward
    expected = 0.0
    for p, responses in ((4, (4, 2)), (6, (1, 3))):
        expected += 6 * n * p + pair * p * (p + 1) / 2
        for r in responses:
            expected += 6 * n * r + pair * sum(p + t for t in range(1, r + 1))
    info = {"model_params": n, "num_layers": layers, "attn_dim": a, "peak_flops_per_device": peak}
    batch = Batch.from_dict({"attention_mask": mask, "responses": np.zeros((4, R), np.int32)})
    m = mfu_metric(batch, {"update_actor": seconds}, info, 1, devices, shared_group=2)
    assert m["perf/mfu/actor"] == pytest.approx(expected / (seconds * devices * peak), rel=1e-12)
    unshared = mfu_metric(batch, {"update_actor": seconds}, info, 1, devices)["perf/mfu/actor"]
    assert unshared > m["perf/mfu/actor"]
