"""The on-policy update (``actor.skip_old_log_prob_when_on_policy``): when a step's update is one optimizer step,
``update_actor`` without ``old_log_probs`` takes π_old = stop_gradient(π_θ) and gives the update that the separate
``compute_log_prob`` pass feeds (real actor worker in this process on 8 fake CPU devices, dp 4 x tp 2, tiny random
Llama, float32); where π_old is needed before the update, or there are several optimizer steps, the trainer keeps
the pass."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from _models_helpers import DP4_TP2_PLACEMENT, TINY_WORKER_MODEL, local_actor, random_prompts, tiny_worker_config
from jaxrl_hf.config import load_config
from jaxrl_hf.controller import Batch
from jaxrl_hf.trainer.step import StepContext

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")

P, R, PROMPTS, N = 5, 6, 2, 4


def make_actor(**actor):
    return local_actor(tiny_worker_config(lr=1e-2, n=N, response_length=R, seed=1, placement=DP4_TP2_PLACEMENT,
                                          actor={"ppo_mini_batch_size": PROMPTS, "ppo_micro_batch_size_per_device": 1,
                                                 "clip_ratio": 0.2, **actor}))


@pytest.fixture(scope="module")
def rollout():
    """8 sequences (2 prompts x 4), their advantages and the separate pass's ``old_log_probs``."""
    rows = PROMPTS * N
    rng = np.random.default_rng(4)
    prompts, prompt_mask = random_prompts(4, rows, P, TINY_WORKER_MODEL["vocab_size"])
    responses = rng.integers(3, TINY_WORKER_MODEL["vocab_size"], (rows, R)).astype(np.int32)
    response_mask = (np.arange(R)[None] < rng.integers(1, R + 1, (rows, 1))).astype(np.int32)
    attention_mask = np.concatenate([prompt_mask, response_mask], 1).astype(np.int32)
    batch = Batch.from_dict({
        "input_ids": np.concatenate([prompts, responses], 1), "attention_mask": attention_mask,
        "position_ids": np.maximum(np.cumsum(attention_mask, 1) - 1, 0).astype(np.int32),
        "responses": responses, "response_mask": response_mask,
        "advantages": (rng.normal(size=(rows, R)) * response_mask).astype(np.float32)})
    old = make_actor().compute_log_prob(batch)
    return batch, batch.union(old.select(["old_log_probs"], []))


def update(worker, batch):
    before = [np.asarray(x) for x in jax.tree.leaves(worker.state.params)]
    metrics = worker.update_actor(batch).meta_info["metrics"]
    delta = np.concatenate([(np.asarray(x) - b).ravel() for x, b in zip(jax.tree.leaves(worker.state.params), before)])
    return metrics, delta


def test_one_step_without_old_log_probs_is_the_recomputed_update(rollout):
    without, with_pass = rollout
    (got, delta), (ref, ref_delta) = update(make_actor(), without), update(make_actor(), with_pass)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert ref["actor/grad_norm"] > 0 and got["actor/num_updates"] == ref["actor/num_updates"] == 1
    assert got["actor/ppo_kl"] == 0.0 and got["actor/pg_clipfrac"] == 0.0  # the ratio is exactly 1
    assert np.linalg.norm(delta - ref_delta) < 1e-4 * np.linalg.norm(ref_delta)


@pytest.mark.parametrize("actor", [{"ppo_epochs": 2}, {"ppo_mini_batch_size": 1}], ids=["2-epochs", "2-mini-batches"])
def test_several_optimizer_steps_need_old_log_probs(rollout, actor):
    without, _ = rollout
    with pytest.raises(KeyError, match=r"old_log_probs.*(2 mini-batch\(es\) x 1 epoch|1 mini-batch\(es\) x 2 epoch)"):
        make_actor(**actor).update_actor(without)


@pytest.mark.parametrize("overrides, on_policy", [
    ([], True),
    (["actor.ppo_epochs=2"], False),
    (["actor.ppo_mini_batch_size=1"], False),
    (["actor.skip_old_log_prob_when_on_policy=false"], False),
    (["algorithm.use_kl_in_reward=true"], False),
    (["actor.rollout_correction.level=token"], False),
])
def test_the_trainer_skips_the_pass_only_for_one_on_policy_step(overrides, on_policy):
    config = load_config("grpo", "smoke", ["data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=4",
                                           *overrides])
    rows = Batch.from_dict({"response_mask": np.ones((8, 3), np.int32)})
    step = types.SimpleNamespace(config=config, async_rollout=None)
    assert StepContext.update_is_on_policy(step, rows) is on_policy
    assert not StepContext.update_is_on_policy(types.SimpleNamespace(config=config, async_rollout=object()), rows)
