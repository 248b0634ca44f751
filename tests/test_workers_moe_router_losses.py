"""The actor's update of a mixture-of-experts policy: its router losses and ``actor/moe/*`` metrics
(`jaxrl_hf.workers.losses.actor_loss`), on a tiny random Qwen3-MoE saved as an HF directory.

One given batch with left-padded rows of different lengths, one micro-batch (a row on each of dp 4 × tp 2): the logged aux loss equals
`load_balancing_loss` of a separate forward over the real tokens, the loss is ``pg_loss + coef · aux``, the padded
and the packed (``use_remove_padding``) forwards agree, and the aux term's gradient reaches the router."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import (DP4_TP2_PLACEMENT, left_padded_update_columns, local_actor, tiny_config,
                             write_tiny_hf_dir)
from jaxrl_hf.algos.router_losses import load_balancing_loss, router_z_loss
from jaxrl_hf.controller import Batch
from jaxrl_hf.models.forward import hidden_states_and_routing

CONFIG = tiny_config(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     qk_norm=True, vocab_size=64, head_dim=16)
P, R = 6, 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_dir(tmp_path_factory.mktemp("moe"), CONFIG, 0)


def _batch():
    columns = left_padded_update_columns(CONFIG.vocab_size, P, R, (0, 2, 3, 5), early_stop=(1, 3))
    columns["old_log_probs"] = np.full((4, R), -np.log(CONFIG.vocab_size), np.float32)
    return Batch.from_dict(columns, meta_info={"global_step": 1})


def _update(model_dir, coef, packed):
    actor = local_actor({
        "model": {"path": model_dir, "use_remove_padding": packed},
        "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_device": 1, "use_kl_loss": False,
                  "router_aux_loss_coef": coef, "router_z_loss_coef": coef / 10, "optim": {"lr": 1e-2}},
        "rollout": {"name": "jax", "n": 1, "response_length": R, "max_prompt_length": P},
        "data": {"max_prompt_length": P, "max_response_length": R}, "placement": DP4_TP2_PLACEMENT})
    before = jax.device_get(actor.state.params)
    metrics = actor.update_actor(_batch()).meta_info["metrics"]
    return before, jax.device_get(actor.state.params), metrics


def test_router_losses_and_metrics_of_the_update(model_dir):
    batch = _batch()
    before, _, m = _update(model_dir, 0.0, packed=False)
    _, (logits, experts) = hidden_states_and_routing(before, CONFIG.replace(dtype="float32"),
                                                     jnp.asarray(batch["input_ids"]), jnp.asarray(batch["attention_mask"]),
                                                     jnp.asarray(batch["position_ids"]))
    real = jnp.asarray(batch["attention_mask"].reshape(-1))
    aux, z = float(load_balancing_loss(logits, experts, real)), float(router_z_loss(logits, experts, real))
    np.testing.assert_allclose(m["actor/moe/aux_loss"], aux, rtol=1e-5)
    np.testing.assert_allclose(m["actor/moe/z_loss"], z, rtol=1e-5)
    assert m["actor/moe/tokens_dropped"] == 0.0 and 0 < m["actor/moe/expert_load_min"] <= 0.25 <= m["actor/moe/expert_load_max"]
    np.testing.assert_allclose(m["actor/loss"], m["actor/pg_loss"], rtol=1e-6)  # coefficients 0: logged, not added

    coef = 0.5
    _, after_padded, mp = _update(model_dir, coef, packed=False)
    _, after_packed, mk = _update(model_dir, coef, packed=True)
    for got in (mp, mk):
        np.testing.assert_allclose(got["actor/moe/aux_loss"], aux, rtol=1e-5)  # padding left out in both forms
        np.testing.assert_allclose(got["actor/loss"], got["actor/pg_loss"] + coef * aux + coef / 10 * z, rtol=1e-5)
    router = lambda p: p["model"]["layers"]["moe"]["router"]["kernel"]  # noqa: E731
    np.testing.assert_allclose(router(after_packed), router(after_padded), atol=1e-5)
    _, after_off, _ = _update(model_dir, 0.0, packed=False)
    assert np.abs(router(after_padded) - router(after_off)).max() > 1e-5  # the aux term moved the router


def test_a_negative_coefficient_is_refused_naming_the_key(model_dir):
    from jaxrl_hf.workers.common import WorkerConfigError

    with pytest.raises(WorkerConfigError, match=r"actor.router_aux_loss_coef=-0.1: must be >= 0"):
        local_actor({"model": {"path": model_dir}, "actor": {"router_aux_loss_coef": -0.1},
                     "rollout": {"name": "jax", "n": 1, "response_length": R}, "placement": DP4_TP2_PLACEMENT})
