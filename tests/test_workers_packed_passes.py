"""Packed sequences (``model.use_remove_padding``) and token-budget micro-batches (``use_dynamic_bsz``) through the
real actor and critic workers in this process (8 fake CPU devices: dp 4 x tp 2, tiny random Llama): log-probs,
entropy, reference log-probs and values equal the padded path's; one update gives the padded path's loss, gradient
norm and parameters (token-mean and a seq-mean mode, KL loss on); the packed program runs on ``[dp, L]``."""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest

from _models_helpers import TINY_WORKER_MODEL, random_prompts, tiny_worker_config
from jaxrl_hf.controller import Batch
from jaxrl_hf.controller.worker import WorkerContext
from jaxrl_hf.models.row_layout import RowLayout
from jaxrl_hf.workers import ActorRolloutRefWorker, CriticWorker
from jaxrl_hf.workers.actor_programs import log_probs_program
from jaxrl_hf.workers.common import WorkerConfigError
from jaxrl_hf.workers.packed_forward import packed_config

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")

P, R, PROMPTS, N, BUDGET = 6, 8, 8, 2, 40
BASE = tiny_worker_config(
    lr=5e-3, n=N, response_length=R, seed=3,
    actor={"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_device": 2, "use_kl_loss": True,
           "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.1, "entropy_coeff": 0.01},
    critic={"value_head_init_std": 0.5, "ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_device": 2},
    placement={"num_processes": 1, "devices_per_process": 8, "train": {"pp": 1, "tp": 2, "dp": 4}})
PACKED = {"model": {"use_remove_padding": True},
          "actor": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": BUDGET},
          "critic": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": BUDGET}}
PACKED_FIXED_ROWS = {"model": {"use_remove_padding": True}}
DYNAMIC_PADDED = {"actor": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": BUDGET}}


def make(cls, args, layout=None, **actor):
    config = copy.deepcopy(BASE)
    for section, values in {**(layout or {})}.items():
        config[section] = {**config[section], **values}
    config["actor"].update(actor)
    worker = cls._instantiate(WorkerContext("w", "local", 0, 1), (config, *args), {})
    worker.init_model()
    return worker


def rollout_rows(seed, rows):
    """Rollout-shaped rows as `jaxrl_hf.rollout.loops.sequence_columns` lays them out: left-padded prompts of 2..P
    tokens, right-padded responses of 1..R tokens (a few fully masked, as overlong-filtered samples)."""
    rng = np.random.default_rng(seed)
    prompts, prompt_mask = random_prompts(seed, rows, P, TINY_WORKER_MODEL["vocab_size"])
    responses = rng.integers(3, TINY_WORKER_MODEL["vocab_size"], (rows, R)).astype(np.int32)
    response_mask = (np.arange(R)[None] < rng.integers(1, R + 1, (rows, 1))).astype(np.int32)
    response_mask[[3, 10]] = 0
    attention_mask = np.concatenate([prompt_mask, (np.arange(R)[None] < response_mask.sum(1, keepdims=True))], 1)
    return {"input_ids": np.concatenate([prompts, responses], 1), "attention_mask": attention_mask.astype(np.int32),
            "position_ids": np.maximum(np.cumsum(attention_mask, 1) - 1, 0).astype(np.int32),
            "responses": responses, "response_mask": response_mask}


@pytest.fixture(scope="module")
def rollout():
    """16 sequences with the padded path's old log-probs, entropy, reference log-probs (a perturbed copy, so the KL
    loss is not 0) and advantages/returns."""
    actor = make(ActorRolloutRefWorker, ("actor_rollout_ref",))
    batch = Batch.from_dict(rollout_rows(5, PROMPTS * N))
    batch = batch.union(actor.compute_log_prob(batch)).union(actor.compute_ref_log_prob(batch))
    rng = np.random.default_rng(0)
    mask = batch["response_mask"]
    adv = np.where(np.arange(len(batch))[:, None] % 3 == 0, 1.0, -0.5) * mask
    return batch.union(Batch.from_dict({
        "advantages": adv.astype(np.float32), "returns": (rng.normal(size=adv.shape) * mask).astype(np.float32),
        "perturbed_ref": (batch["ref_log_prob"] + 0.3 * rng.normal(size=adv.shape) * mask).astype(np.float32)}))


@pytest.mark.parametrize("layout", [PACKED, PACKED_FIXED_ROWS, DYNAMIC_PADDED], ids=["packed", "packed_fixed_rows",
                                                                                       "dynamic_padded"])
def test_log_probs_equal_the_padded_path(rollout, layout):
    batch = rollout
    worker = make(ActorRolloutRefWorker, ("actor_rollout_ref",), layout)
    valid = batch["response_mask"] != 0
    got = worker.compute_log_prob(batch).union(worker.compute_ref_log_prob(batch))
    for key, ref in (("old_log_probs", "old_log_probs"), ("entropys", "entropys"), ("ref_log_prob", "ref_log_prob")):
        np.testing.assert_allclose(got[key][valid], batch[ref][valid], atol=2e-5, err_msg=key)
        assert (got[key][~valid] == 0).all()


def test_packed_program_runs_on_dp_by_budget(rollout):
    batch = rollout
    worker = make(ActorRolloutRefWorker, ("actor_rollout",), PACKED)
    shapes = []

    def recording(params, micro, temperature):  # the real program, its input shapes noted
        shapes.append({k: v.shape for k, v in micro.items()})
        return log_probs_program(params, micro, temperature, log_prob_fn=worker.packed_log_prob_fn)

    arrays = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")}
    logp, _ = worker.batching["log_prob"].apply(recording, worker.state.params, arrays, worker.mesh, 1, np.float32(1))
    valid = batch["response_mask"] != 0
    np.testing.assert_allclose(logp[valid], batch["old_log_probs"][valid], atol=2e-5)
    lengths = (batch["attention_mask"] != 0).sum(1)
    assert len(shapes) >= -(-int(lengths.sum()) // (4 * BUDGET))
    for s in shapes:  # one [dp, L] sequence per data-parallel device, L the token budget
        assert s["pack_input_ids"] == s["pack_segment_ids"] == s["pack_position_ids"] == (4, BUDGET)
        assert "input_ids" not in s and s["responses"][1:] == (R,)
        # pack_rows: r rows per device of the padded width; attention ran one row at a time (r·T² <= L²)
        rows, width = s["pack_rows"][0] // 4, s["pack_rows"][1]
        assert width == P + R and rows * width * width <= BUDGET * BUDGET
        micro = {k: np.zeros(shape, np.int32) for k, shape in s.items()}
        assert packed_config(worker.model.config, micro).row_layout == RowLayout("packed", (rows, width))


def one_update(batch, layout, loss_agg_mode):
    """Metrics and the parameter change of one ``update_actor`` (two epochs: the second is off-policy, so the
    clipping is active) from the initial actor."""
    worker = make(ActorRolloutRefWorker, ("actor_rollout",), layout, loss_agg_mode=loss_agg_mode, ppo_epochs=2)
    before = [np.asarray(x) for x in jax.tree.leaves(worker.state.params)]
    worker.set_step(1)
    metrics = worker.update_actor(batch).meta_info["metrics"]
    delta = np.concatenate([(np.asarray(x) - b).ravel() for x, b in zip(jax.tree.leaves(worker.state.params), before)])
    return metrics, delta


PADDED_UPDATES = {}


@pytest.mark.parametrize("loss_agg_mode, layout", [("token-mean", PACKED), ("token-mean", DYNAMIC_PADDED),
                                                   ("seq-mean-token-sum-norm", PACKED)],
                         ids=["token-mean-packed", "token-mean-dynamic_padded", "seq-mean-token-sum-norm-packed"])
def test_update_equals_the_padded_path(rollout, loss_agg_mode, layout):
    batch = Batch.from_dict({**{k: rollout[k] for k in rollout.keys() if k != "ref_log_prob"},
                             "ref_log_prob": rollout["perturbed_ref"]})
    if loss_agg_mode not in PADDED_UPDATES:
        PADDED_UPDATES[loss_agg_mode] = one_update(batch, None, loss_agg_mode)
    (padded, padded_delta), (got, delta) = PADDED_UPDATES[loss_agg_mode], one_update(batch, layout, loss_agg_mode)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "actor/loss"):
        np.testing.assert_allclose(got[key], padded[key], rtol=1e-4, atol=1e-7, err_msg=key)
    assert padded["actor/grad_norm"] > 0 and padded["actor/kl_loss"] > 0 and padded["actor/pg_clipfrac"] > 0
    # the parameter updates agree as vectors (element-wise, Adam's g/(|g|+eps) magnifies float noise where g ~ 0)
    assert np.linalg.norm(delta - padded_delta) < 1e-3 * np.linalg.norm(padded_delta)
    # tokens computed: packed [dp, L] micro-batches waste less than the padded [rows, P + R] layout
    padding = 1 - (batch["attention_mask"] != 0).sum() / batch["attention_mask"].size
    assert "actor/padding_ratio" not in padded and 0 <= got["actor/padding_ratio"] < 1
    if layout is PACKED:
        assert got["actor/padding_ratio"] < padding


def test_critic_values_and_update_equal_the_padded_path(rollout):
    batch = rollout
    valid = batch["response_mask"] != 0
    padded, packed = make(CriticWorker, ()), make(CriticWorker, (), PACKED)
    values = padded.compute_values(batch)["values"]
    assert np.abs(values[valid]).max() > 0.1
    np.testing.assert_allclose(packed.compute_values(batch)["values"][valid], values[valid], atol=2e-5)
    batch = batch.union(Batch.from_dict({"values": values}))
    got = [w.update_critic(batch).meta_info["metrics"] for w in (padded, packed)]
    for key in ("critic/vf_loss", "critic/grad_norm"):
        np.testing.assert_allclose(got[1][key], got[0][key], rtol=1e-5, err_msg=key)


def test_a_budget_below_a_row_names_the_key(rollout):
    batch = rollout
    tight = {"model": {"use_remove_padding": True},
             "rollout": {"log_prob_use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": 9}}
    worker = make(ActorRolloutRefWorker, ("actor_rollout",), tight)
    longest = int((batch["attention_mask"] != 0).sum(1).max())
    with pytest.raises(WorkerConfigError, match=rf"rollout.log_prob_max_token_len_per_gpu=9 .* {longest} tokens"):
        worker.compute_log_prob(batch)
    with pytest.raises(WorkerConfigError, match=r"actor.ppo_max_token_len_per_gpu=None: use_dynamic_bsz"):
        make(ActorRolloutRefWorker, ("actor_rollout",), {"actor": {"use_dynamic_bsz": True}})
