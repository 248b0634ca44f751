"""Expert parallelism (`jaxrl_hf.models.expert_parallel`, rule set ``fsdp_tp_ep``) on a tiny random Qwen3-MoE with a
dense layer among its sparse ones.

The model on 4 simulated devices (tp 2 × dp 2): each tp device holds half of every MoE layer's experts, whole,
and the logits and gradients equal the unsharded model's (float32; tolerance from 3 layers of 32-wide sums). The
actor on 8: one GRPO update on one given batch gives the same loss, gradient norm and parameter change with the
experts unsplit (``fsdp``, dp 8), split per expert over tp (``fsdp_tp``, tp 2 × dp 4: expert tensor parallelism)
and split by experts over tp with ZeRO-3 over dp (``fsdp_tp_ep``, tp 2 × dp 4: EP 2 × FSDP 4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from _models_helpers import left_padded_update_columns, local_actor, random_params, tiny_config, write_tiny_hf_dir
from jaxrl_hf.controller import Batch
from jaxrl_hf.mesh.rule_sets import get_rule_set
from jaxrl_hf.mesh.rules import logical_to_specs
from jaxrl_hf.models.forward import (forward, hidden_states_and_routing, param_logical_axes,
                                     routed_experts_by_token)

CONFIG = tiny_config(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     qk_norm=True, vocab_size=64, head_dim=16, num_hidden_layers=3, mlp_only_layers=(1,),
                     norm_topk_prob=True)
P, R = 6, 5
TOL = 1e-5  # float32 over 3 layers of 32-wide reductions, summed in another order per layout


def test_expert_parallel_forward_and_gradients_equal_the_unsharded_model():
    params = jax.device_get(random_params(CONFIG, seed=5))
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 64, (4, 9)), jnp.int32)
    loss = lambda p, **kw: jnp.sum(forward(p, CONFIG, ids, **kw) ** 2) * 1e-3  # noqa: E731
    want_logits, want_grad = np.asarray(forward(params, CONFIG, ids)), jax.grad(loss)(params)
    rules = get_rule_set("fsdp_tp_ep")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 2, 2), ("pp", "tp", "dp"))
    specs = logical_to_specs(param_logical_axes(CONFIG), rules.params, shapes=params, mesh=mesh)
    gate = specs["model"]["layers"]["moe"]["gate_proj"]["kernel"]
    assert tuple(gate) == ("pp", "tp", "dp", None)  # [layers, expert, embed, mlp]: whole experts per tp device
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    shard = placed["model"]["layers"]["moe"]["gate_proj"]["kernel"].addressable_shards[0].data
    assert shard.shape == (3, 2, 16, 16)
    kw = dict(mesh=mesh, rules=rules.activations)
    logits = jax.jit(lambda p: forward(p, CONFIG, ids, **kw))(placed)
    np.testing.assert_allclose(np.asarray(logits), want_logits, atol=TOL)
    grads = jax.jit(jax.grad(lambda p: loss(p, **kw)))(placed)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grad)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_dir(tmp_path_factory.mktemp("moe_ep"), CONFIG, 0)


def _batch():
    """8 left-padded rows, with the experts an unsharded forward routes them to (`routed_experts`, replayed by
    ``actor.router_replay.mode=R2``): a near tie that one layout's rounding tips the other way would move a token
    to another expert, a difference no float tolerance covers; pinned, the layouts differ by rounding only."""
    columns = left_padded_update_columns(CONFIG.vocab_size, P, R, (0, 2, 3, 5, 1, 0, 4, 2))
    _, (_, experts) = hidden_states_and_routing(random_params(CONFIG, seed=0), CONFIG,
                                                jnp.asarray(columns["input_ids"]), jnp.asarray(columns["attention_mask"]))
    columns["routed_experts"] = np.asarray(routed_experts_by_token(experts, 8))
    return Batch.from_dict(columns, meta_info={"global_step": 1})


def _update(model_dir, strategy, tp):
    # eps 1: Adam's first step is g / (|g| + 1), smooth in the gradient, so layouts compare within their rounding;
    # one micro-batch of all 8 rows in every layout (the load-balancing loss is per micro-batch, not additive)
    actor = local_actor({
        "model": {"path": model_dir},
        "actor": {"strategy": strategy, "ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_device": tp,
                  "use_kl_loss": False, "router_aux_loss_coef": 0.01, "router_replay": {"mode": "R2"},
                  "optim": {"lr": 1.0, "eps": 1.0, "weight_decay": 0.0}},
        "rollout": {"name": "jax", "n": 1, "response_length": R, "max_prompt_length": P},
        "data": {"max_prompt_length": P, "max_response_length": R},
        "placement": {"num_processes": 1, "devices_per_process": 8, "train": {"pp": 1, "tp": tp, "dp": 8 // tp}}})
    before = jax.device_get(actor.state.params)
    metrics = actor.update_actor(_batch()).meta_info["metrics"]
    delta = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(actor.state.params), before)
    return metrics, delta


def test_the_same_update_with_experts_unsplit_tensor_split_and_expert_parallel(model_dir):
    runs = {name: _update(model_dir, name, tp) for name, tp in (("fsdp", 1), ("fsdp_tp", 2), ("fsdp_tp_ep", 2))}
    want_metrics, want_delta = runs["fsdp"]
    assert np.abs(want_delta["model"]["layers"]["moe"]["gate_proj"]["kernel"]).max() > 1e-4
    for name in ("fsdp_tp", "fsdp_tp_ep"):
        metrics, delta = runs[name]
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/moe/aux_loss"):
            np.testing.assert_allclose(metrics[key], want_metrics[key], rtol=TOL, err_msg=f"{name} {key}")
        for got, want in zip(jax.tree.leaves(delta), jax.tree.leaves(want_delta)):
            np.testing.assert_allclose(got, want, atol=TOL, err_msg=name)
