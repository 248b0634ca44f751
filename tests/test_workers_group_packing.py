"""Group rows without padding (`jaxrl_hf.workers.group_packing`, the packed shared-prompt forward) against the
padded forward on the same rows: the layout, log-probs, entropies, gradients, and the actor worker's passes."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import assert_same_log_probs_and_grads, random_params, tiny_config
from jaxrl_hf.workers import group_packing
from jaxrl_hf.workers.losses import response_log_probs
from jaxrl_hf.workers.shared_prompt import SharedPromptForward, packed_group_log_probs

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "bench"))
from bench_shared_prompt import grouped_rows  # noqa: E402  (rows as a rollout lays them out)


def packed(ids, mask, positions, response, n, length=None, per_row=1):
    arrays = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "responses": ids[:, -response:]}
    length = length or group_packing.group_row_length(mask, response, n)
    return group_packing.pack_group_rows(arrays, response, n, length, per_row=per_row)


def test_a_group_row_holds_the_prompt_then_each_sample_and_names_the_predicting_positions():
    ids = np.array([[0, 0, 11, 12, 21, 22, 0], [0, 0, 11, 12, 31, 0, 0]], np.int32)
    mask = (ids != 0).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    out = packed(ids, mask, positions, 3, 2, length=8)
    assert set(out) == {"responses", *group_packing.GROUP_KEYS}
    np.testing.assert_array_equal(out["group_input_ids"], [[11, 12, 21, 22, 31, 0, 0, 0]])
    np.testing.assert_array_equal(out["group_segments"], [[1, 1, 2, 2, 3, 0, 0, 0]])
    np.testing.assert_array_equal(out["group_position_ids"], [[0, 1, 2, 3, 2, 0, 0, 0]])
    # the real response tokens only: sample 1's y0 from the prompt's last token (1), y1 from y0 (2); sample 2's
    # y0 from 1; S = 6 slots (at most n·R), the unused ones 0; a padding column's slot is S
    np.testing.assert_array_equal(out["group_logit_index"], [[1, 2, 1, 0, 0, 0]])
    np.testing.assert_array_equal(out["group_score_targets"], [[21, 22, 31, 0, 0, 0]])
    np.testing.assert_array_equal(out["group_score_slot"], [[0, 1, 6, 2, 6, 6]])
    arrays = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    tight = group_packing.pack_group_rows(arrays, 3, 2, 8, scored=3)
    np.testing.assert_array_equal(tight["group_logit_index"], [[1, 2, 1]])
    np.testing.assert_array_equal(tight["group_score_slot"], [[0, 1, 3, 2, 3, 3]])
    with pytest.raises(ValueError, match="group 0 has more than 2 response tokens to score"):
        group_packing.pack_group_rows(arrays, 3, 2, 8, scored=2)
    assert group_packing.token_counts(out) == (5, 8)
    with pytest.raises(ValueError, match="group 0 holds 5 tokens, more than the packed length 4"):
        packed(ids, mask, positions, 3, 2, length=4)


def test_two_groups_share_a_row_one_after_the_other_with_their_segments_offset():
    ids = np.array([[0, 11, 21, 22], [0, 11, 31, 0], [41, 42, 51, 0], [41, 42, 61, 62]], np.int32)
    mask = (ids != 0).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    out = packed(ids, mask, positions, 2, 2, per_row=2)
    # group 0: 4 tokens, group 1: 5; T and L at their caps (P + n·R = 6 and twice that) under the 32-token quantum
    np.testing.assert_array_equal(out["group_input_ids"], [[11, 21, 22, 31, 41, 42, 51, 61, 62, 0, 0, 0]])
    np.testing.assert_array_equal(out["group_segments"], [[1, 2, 2, 3, 4, 4, 5, 6, 6, 0, 0, 0]])  # + (n + 1)
    np.testing.assert_array_equal(out["group_position_ids"], [[0, 1, 2, 1, 0, 1, 2, 2, 3, 0, 0, 0]])
    np.testing.assert_array_equal(out["group_windows"], [[0, 1, 2, 3, 0, 0], [4, 5, 6, 7, 8, 0]])
    np.testing.assert_array_equal(out["group_logit_index"], [[0, 1, 0, 0], [1, 1, 3, 0]])  # in each run
    np.testing.assert_array_equal(out["group_score_targets"], [[21, 22, 31, 0], [51, 61, 62, 0]])
    with pytest.raises(ValueError, match="3 groups do not fill rows of 2 groups"):
        packed(np.concatenate([ids, ids[:2]]), np.concatenate([mask, mask[:2]]),
               np.concatenate([positions, positions[:2]]), 2, 2, per_row=2)


def rows_of(prompt_real: int, response_real: list[int], prompt: int = 64, response: int = 32):
    mask = np.zeros((len(response_real), prompt + response), np.int32)
    mask[:, prompt - prompt_real:prompt] = 1
    for row, r in enumerate(response_real):
        mask[row, prompt:prompt + r] = 1
    return mask


def test_packable_rows_and_their_length():
    # the default DAPO run's shapes: P = 64, R = 32, n = 4 (a padded group row: 192 positions)
    assert group_packing.group_row_length(rows_of(50, [10, 10, 10, 10]), 32, 4) == 96  # 90 real
    assert group_packing.group_row_length(rows_of(50, [10, 20, 10, 20]), 32, 4) == 128  # 110 real
    assert group_packing.group_row_length(rows_of(50, [30, 30, 30, 30]), 32, 4) == 192  # 170: the padded row
    two = np.concatenate([rows_of(50, [10, 10, 10, 10]), rows_of(60, [32, 2, 2, 2])])
    assert group_packing.group_row_length(two, 32, 4) == 128  # the longer group (98)
    assert group_packing.packed_row_length(two, 32, 4, 2) == 192  # both in one row: 188 real, not 2 x 128
    # the LM head's slots per group: the largest group's response tokens, at most n·R
    assert group_packing.group_scored_length(rows_of(50, [10, 10, 10, 10]), 32, 4) == 64  # 40 tokens
    assert group_packing.group_scored_length(two, 32, 4) == 64  # 40 and 38
    assert group_packing.group_scored_length(rows_of(50, [30, 30, 30, 30]), 32, 4) == 128  # 120: all n·R
    ids, mask, _, _ = grouped_rows(3, 2, 8, 6, 97, seed=4)
    assert group_packing.packable(mask, 6)
    holed = mask.copy()
    holed[0, 9], holed[0, 10] = 0, 1  # a hole inside a response: its tokens would move
    assert not group_packing.packable(holed, 6)
    no_last = mask.copy()
    no_last[:, 7] = 0  # the prompt's last column is padding: nothing predicts y0
    assert not group_packing.packable(no_last, 6)
    assert not group_packing.packable(mask * 2, 6)  # segment ids, not a 0/1 mask
    assert not group_packing.packable(mask, 14)  # no prompt columns


@pytest.mark.parametrize("overrides", [{}, {"dtype": "bfloat16", "tie_word_embeddings": True},
                                       {"sliding_window": 3, "layer_types": ("sliding_attention", "full_attention"),
                                        "attn_logit_softcapping": 5.0}])
@pytest.mark.parametrize("per_row", [1, 2])
def test_packed_group_rows_give_the_padded_forward(overrides, per_row):
    config = tiny_config(**overrides)
    params = random_params(config.replace(dtype="float32"), seed=3)
    n, prompt, response = 3, 7, 5
    ids, mask, positions, valid = grouped_rows(2, n, prompt, response, config.vocab_size, seed=6)
    micro = {k: jnp.asarray(v) for k, v in packed(ids, mask, positions, response, n, per_row=per_row).items()}
    assert micro["group_input_ids"].shape[0] == 2 // per_row
    args = (jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(positions))

    def plain(p):
        return response_log_probs(p, config, *args, response, temperature=0.7)

    def shared(p):
        return packed_group_log_probs(p, config, micro, n, temperature=0.7)

    assert_same_log_probs_and_grads(plain, shared, params, valid, config.dtype == "bfloat16")


def test_the_forward_packs_only_where_asked_and_possible():
    ids, mask, positions, _ = grouped_rows(2, 2, 6, 3, 97)
    arrays = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "responses": ids[:, 6:]}
    assert SharedPromptForward(tiny_config(), True, 2, 1, packed=True).packs(arrays)
    assert not SharedPromptForward(tiny_config(), True, 2, 1).packs(arrays)  # use_remove_padding off
    holed = dict(arrays, attention_mask=mask.copy())
    holed["attention_mask"][0, 6:] = [0, 1, 1]  # a response that does not start at its first column
    assert not SharedPromptForward(tiny_config(), True, 2, 1, packed=True).packs(holed)
    out = SharedPromptForward(tiny_config(), True, 2, 1, packed=True).pack(arrays, devices=2)
    assert out["group_input_ids"].shape[0] == 2 and "input_ids" not in out  # a row per device
    out = SharedPromptForward(tiny_config(), True, 2, 1, packed=True).pack(arrays)
    assert out["group_input_ids"].shape[0] == 1 and out["group_windows"].shape[0] == 2  # both groups in one row


# ------------------------------------------------------------------ the actor worker (8 fake CPU devices)
@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")
@pytest.mark.parametrize("prompts,micro_rows", [(4, 2), (8, 4)])
def test_actor_worker_packs_group_rows_with_the_padded_update_and_log_probs(prompts, micro_rows):
    """dp 4 x tp 2, 4 or 8 prompts x 2 samples, ``model.use_remove_padding``: the update and the log-prob pass take
    packed group rows (metric 1, a padding ratio below the padded rows') and give the padded forward's log-probs,
    loss, gradient norm and parameter change; ``micro_rows`` 4 puts two groups in each device's packed row."""
    from _models_helpers import (DP4_TP2_PLACEMENT, TINY_WORKER_MODEL, grouped_rollout_batch, local_actor,
                                 log_probs_and_update, tiny_worker_config)

    ids, mask, positions, valid = grouped_rows(prompts, 2, 6, 5, TINY_WORKER_MODEL["vocab_size"], seed=2)
    batch = grouped_rollout_batch(ids, mask, positions, valid, 6)
    runs = {}
    for share in (True, False):
        worker = local_actor(tiny_worker_config(
            lr=1e-2, n=2, response_length=5, seed=1, placement=DP4_TP2_PLACEMENT,
            model={"use_remove_padding": share},
            actor={"ppo_mini_batch_size": prompts, "ppo_micro_batch_size_per_device": micro_rows,
                   "log_prob_micro_batch_size_per_device": micro_rows, "share_prompt_forward": share}))
        packs = []
        pack = worker.shared_prompt.pack

        def recorded(arrays, devices):
            out = pack(arrays, devices)
            packs.append((len(arrays["input_ids"]), out["group_windows"].shape[0] // out["group_input_ids"].shape[0]))
            return out
        worker.shared_prompt.pack = recorded
        runs[share] = log_probs_and_update(worker, batch)
        assert sum(rows for rows, _ in packs) == (len(ids) if share else 0)  # the log-prob pass packed every group
        assert {per_row for _, per_row in packs} == ({micro_rows // 2} if share else set())  # groups a device row
    (logp, got, delta), (ref_logp, ref, ref_delta) = runs[True], runs[False]
    assert got["actor/packed_group_rows"] == 1.0 and ref["actor/packed_group_rows"] == 0.0
    assert 0.0 <= got["actor/padding_ratio"] < 1.0 - valid.sum() / (prompts * (6 + 2 * 5))
    np.testing.assert_allclose(logp, ref_logp, atol=2e-5)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        np.testing.assert_allclose(got[key], ref[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert np.linalg.norm(delta - ref_delta) < 1e-3 * np.linalg.norm(ref_delta)
