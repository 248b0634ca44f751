"""The policy forward with each prompt computed once for its samples (`jaxrl_hf.workers.shared_prompt`) against
the padded forward on the same rows: log-probs, entropies and gradients."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import assert_same_log_probs_and_grads, random_params, tiny_config
from jaxrl_hf.workers.losses import response_log_probs
from jaxrl_hf.workers.shared_prompt import groups_share_prompts, shared_prompt_log_probs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "bench"))
from bench_shared_prompt import grouped_rows  # noqa: E402  (rows as a rollout lays them out)


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True, "qkv_bias": True},
                                       {"dtype": "bfloat16"}])
def test_shared_prompt_forward_equals_the_padded_forward(overrides):
    config = tiny_config(**overrides)
    params = random_params(config.replace(dtype="float32"), seed=3)
    n, prompt, response = 3, 7, 5
    ids, mask, positions, valid = grouped_rows(2, n, prompt, response, config.vocab_size)
    args = (jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions))

    def plain(p):
        return response_log_probs(p, config, *args, response, temperature=0.7)

    def shared(p):
        return shared_prompt_log_probs(p, config, *args, response, n, temperature=0.7)

    assert_same_log_probs_and_grads(plain, shared, params, valid, config.dtype == "bfloat16")


def test_groups_share_prompts_checks_every_group_and_chunk():
    ids, mask, _, _ = grouped_rows(4, 2, 6, 3, 97)
    assert groups_share_prompts(ids, mask, 3, group=2, chunk_rows=4)
    assert groups_share_prompts(ids, mask, 3, group=2, chunk_rows=8)
    assert not groups_share_prompts(ids, mask, 3, group=2, chunk_rows=3)  # a chunk would split a group
    assert not groups_share_prompts(ids, mask, 3, group=4, chunk_rows=8)  # groups of 2, not 4
    assert not groups_share_prompts(ids, mask, 3, group=1, chunk_rows=8)  # nothing to share
    other = ids.copy()
    other[5, 5] += 1  # one sample's prompt token differs
    assert not groups_share_prompts(other, mask, 3, group=2, chunk_rows=4)
    assert groups_share_prompts(ids[:, :8], mask[:, :8], 2, group=2, chunk_rows=4)  # response columns differ freely
    assert not groups_share_prompts(ids, mask, 9, group=2, chunk_rows=4)  # no prompt columns
    _, _, positions, _ = grouped_rows(4, 2, 6, 3, 97)
    assert groups_share_prompts(ids, mask, 3, group=2, chunk_rows=4, position_ids=positions)
    shifted = positions.copy()
    shifted[3, :6] += 1  # the same tokens at other positions: not the same prompt activations
    assert not groups_share_prompts(ids, mask, 3, group=2, chunk_rows=4, position_ids=shifted)


# ------------------------------------------------------------------ the actor worker (8 fake CPU devices)
def make_actor(share: bool, **actor):
    from _models_helpers import DP4_TP2_PLACEMENT, local_actor, tiny_worker_config

    return local_actor(tiny_worker_config(lr=1e-2, n=2, response_length=5, seed=1, placement=DP4_TP2_PLACEMENT,
                                          actor={"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_device": 2,
                                                 "share_prompt_forward": share, **actor}))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")
def test_actor_worker_shares_grouped_prompts_with_the_same_update_and_log_probs():
    """dp 4 x tp 2, 4 prompts x 2 samples, one sample pair per device: the shared forward is taken (metric 1) and
    gives the padded forward's log-probs, loss, gradient norm and parameter change; rows out of their groups and
    ``share_prompt_forward: false`` take the padded one."""
    from _models_helpers import TINY_WORKER_MODEL, grouped_rollout_batch, log_probs_and_update

    ids, mask, positions, valid = grouped_rows(4, 2, 6, 5, TINY_WORKER_MODEL["vocab_size"], seed=2)
    batch = grouped_rollout_batch(ids, mask, positions, valid, 6)
    runs = {share: log_probs_and_update(make_actor(share), batch) for share in (True, False)}
    (logp, got, delta), (ref_logp, ref, ref_delta) = runs[True], runs[False]
    assert got["actor/shared_prompt_forward"] == 1.0 and ref["actor/shared_prompt_forward"] == 0.0
    np.testing.assert_allclose(logp, ref_logp, atol=2e-5)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert np.linalg.norm(delta - ref_delta) < 1e-3 * np.linalg.norm(ref_delta)
    shuffled = batch.take(np.array([1, 0, 2, 3, 4, 5, 7, 6]))  # groups intact, samples swapped: still shared
    assert make_actor(True).update_actor(shuffled).meta_info["metrics"]["actor/shared_prompt_forward"] == 1.0
    split = batch.take(np.array([0, 2, 1, 3, 4, 5, 6, 7]))  # two groups split across rows: padded forward
    assert make_actor(True).update_actor(split).meta_info["metrics"]["actor/shared_prompt_forward"] == 0.0


def test_shared_forward_is_taken_only_where_the_padded_attention_is_eager():
    from jaxrl_hf.workers.shared_prompt import SharedPromptForward

    ids, mask, _, _ = grouped_rows(2, 2, 6, 3, 97)
    arrays = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, 6:]}
    assert SharedPromptForward(tiny_config(), True, 2, 1).applies(arrays, 2)
    assert not SharedPromptForward(tiny_config(attn_implementation="blockwise"), True, 2, 1).applies(arrays, 2)
    assert not SharedPromptForward(tiny_config(), False, 2, 1).applies(arrays, 2)  # switched off
    assert SharedPromptForward(tiny_config(), True, 1, 1).log_prob_fn is None  # n = 1: nothing to share
    assert SharedPromptForward(tiny_config(), True, 2, 2).log_prob_fn is None  # sequence parallel
