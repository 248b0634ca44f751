"""Routing replay (``actor.router_replay.mode=R2``, `jaxrl_hf.workers.routing_replay`) on a tiny random Qwen3-MoE
with a dense layer among its sparse ones, saved as an HF directory, on one given batch of left-padded rows
(dp 4 × tp 2).

The model: replaying a pass's own routing reproduces it exactly; other experts change the output, are the
experts the pass reports, and get their weights from the router (numpy float64 formula), whose gradient flows.
The actor: ``compute_log_prob`` records the routing of its forward (equal to a separate forward's on every real
token, padded and packed layouts alike); an update replaying it equals the update without replay (same weights,
same routing), one replaying other experts does not; the packed update reads the same column; refusals name
the key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import DP4_TP2_PLACEMENT, local_actor, random_params, tiny_config, write_tiny_hf_dir
from jaxrl_hf.controller import Batch
from jaxrl_hf.models.forward import (hidden_states, hidden_states_and_routing, routed_experts_by_layer,
                                     routed_experts_by_token)
from jaxrl_hf.models.moe import route
from jaxrl_hf.workers.common import WorkerConfigError

CONFIG = tiny_config(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                     qk_norm=True, vocab_size=64, head_dim=16, num_hidden_layers=3, mlp_only_layers=(1,),
                     norm_topk_prob=True)
P, R = 6, 5


def test_replayed_routing_reproduces_the_pass_and_other_experts_take_the_routers_weights():
    params = jax.tree.map(jnp.asarray, random_params(CONFIG, seed=3))
    ids = jnp.asarray(np.random.default_rng(0).integers(3, 64, (2, 9)), jnp.int32)
    fn = jax.jit(hidden_states_and_routing, static_argnums=1)
    hidden, (_, experts) = fn(params, CONFIG, ids)
    assert experts.shape == (3, 18, 2) and bool((experts[1] == -1).all()) and bool((experts[0] >= 0).all())
    replayed, (_, same) = fn(params, CONFIG, ids, routed_experts=experts)
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(hidden))
    other = jnp.where(experts < 0, -1, (experts + 1) % 4)
    moved, (_, reported) = fn(params, CONFIG, ids, routed_experts=other)
    np.testing.assert_array_equal(np.asarray(reported), np.asarray(other))
    assert float(jnp.abs(moved - hidden).max()) > 1e-2
    grad = jax.grad(lambda p: jnp.sum(hidden_states(p, CONFIG, ids, routed_experts=other) ** 2))(params)
    assert float(jnp.abs(grad["model"]["layers"]["moe"]["router"]["kernel"]).sum()) > 0
    # the weights of given experts: softmax(x W_r) at those experts, renormalised (numpy float64)
    rng = np.random.default_rng(1)
    x, w, given = rng.normal(size=(5, 8)), rng.normal(size=(8, 4)), rng.integers(0, 4, (5, 2))
    got = route(jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32), 2, True, jnp.asarray(given))
    z = x @ w
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.take_along_axis(p, given, -1)
    np.testing.assert_allclose(np.asarray(got.weights), want / want.sum(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.experts), given)
    by_token = routed_experts_by_token(experts, 2)
    assert by_token.shape == (2, 9, 3, 2) and bool((routed_experts_by_layer(by_token) == experts).all())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_hf_dir(tmp_path_factory.mktemp("moe_replay"), CONFIG, 0)


def _batch():
    rng = np.random.default_rng(0)
    rows = 4
    ids = rng.integers(3, CONFIG.vocab_size, (rows, P + R)).astype(np.int32)
    mask = np.ones((rows, P + R), np.int32)
    for row, pad in enumerate((0, 2, 3, 5)):  # left-padded prompts of 6, 4, 3 and 1 tokens
        mask[row, :pad], ids[row, :pad] = 0, 0
    response_mask = np.ones((rows, R), np.float32)
    response_mask[1, 3:] = 0
    return Batch.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32),
        "responses": ids[:, P:], "response_mask": response_mask,
        "advantages": np.array([[1.0], [-1.0], [0.5], [-0.5]], np.float32) * response_mask,
    }, meta_info={"global_step": 1})


def _actor(model_dir, packed, mode="R2", epochs=1):
    return local_actor({
        "model": {"path": model_dir, "use_remove_padding": packed},
        "actor": {"ppo_mini_batch_size": 4, "ppo_epochs": epochs, "ppo_micro_batch_size_per_device": 1,
                  "use_kl_loss": False,
                  "router_replay": {"mode": mode}, "optim": {"lr": 1e-2}},
        "rollout": {"name": "jax", "n": 1, "response_length": R, "max_prompt_length": P},
        "data": {"max_prompt_length": P, "max_response_length": R}, "placement": DP4_TP2_PLACEMENT})


def _router_after_update(actor, batch):
    metrics = actor.update_actor(batch).meta_info["metrics"]
    return np.asarray(jax.device_get(actor.state.params)["model"]["layers"]["moe"]["router"]["kernel"]), metrics


@pytest.fixture(scope="module")
def recorded(model_dir):
    """Per layout: the actor's recorded routing of `_batch` and the router after an update replaying it, one
    replaying shifted experts and one without replay (the actor's weights put back between updates)."""
    out = {}
    for packed in (False, True):
        actor = _actor(model_dir, packed)
        start = jax.tree.map(jnp.copy, actor.state)
        batch = _batch()
        old = actor.compute_log_prob(batch)
        with_old = batch.union(old.select(["old_log_probs"], []))
        results = {"routed": np.asarray(old["routed_experts"]), "params": jax.device_get(start.params)}
        experts = results["routed"]
        shifted = np.where(experts < 0, -1, (experts + 1) % CONFIG.num_experts).astype(np.int32)
        for name, column in (("replayed", experts), ("shifted", shifted), ("none", None)):
            actor.state = jax.tree.map(jnp.copy, start)  # the step donates the state it is given
            b = with_old if column is None else with_old.union(Batch.from_dict({"routed_experts": column}))
            results[name] = _router_after_update(actor, b)
        out[packed] = results
    return out


def test_compute_log_prob_records_the_routing_of_its_forward(recorded):
    batch, real = _batch(), _batch()["attention_mask"].astype(bool)
    params = recorded[False]["params"]
    _, (_, experts) = hidden_states_and_routing(params, CONFIG.replace(dtype="float32"), jnp.asarray(batch["input_ids"]),
                                                jnp.asarray(batch["attention_mask"]), jnp.asarray(batch["position_ids"]))
    want = np.asarray(routed_experts_by_token(experts, 4))
    for packed in (False, True):
        got = recorded[packed]["routed"]
        assert got.shape == (4, P + R, 3, 2) and got.dtype == np.int32
        np.testing.assert_array_equal(got[real], want[real], err_msg=f"packed={packed}")


def test_an_update_replaying_the_recorded_routing_equals_one_without_replay(recorded):
    for packed in (False, True):
        r = recorded[packed]
        (replayed, m_replayed), (shifted, m_shifted), (none, m_none) = r["replayed"], r["shifted"], r["none"]
        np.testing.assert_allclose(replayed, none, atol=1e-6, err_msg=f"packed={packed}")
        assert abs(m_replayed["actor/ppo_kl"]) < 1e-5 and abs(m_none["actor/ppo_kl"]) < 1e-5
        assert np.abs(shifted - none).max() > 1e-4, packed  # the update's forward took the given experts
        assert abs(m_shifted["actor/ppo_kl"]) > 1e-4, packed
    np.testing.assert_allclose(recorded[True]["replayed"][0], recorded[False]["replayed"][0], atol=1e-5)


def test_refusals_name_the_key(model_dir, tmp_path):
    dense_dir = write_tiny_hf_dir(tmp_path / "dense", tiny_config(vocab_size=64, head_dim=16), 0)
    with pytest.raises(WorkerConfigError, match=r"'actor.router_replay.mode'='R2': routing replay needs a "
                                                r"mixture-of-experts policy"):
        _actor(dense_dir, packed=False)
    with pytest.raises(WorkerConfigError, match=r"'actor.router_replay.mode'='R3': R3 replays the rollout engine's"):
        _actor(model_dir, packed=False, mode="R3")
    actor = _actor(model_dir, packed=False, epochs=2)  # two optimizer steps: π_old's routing is needed
    batch = _batch()
    batch = batch.union(Batch.from_dict({"old_log_probs": np.zeros((4, R), np.float32)}))
    with pytest.raises(KeyError, match=r"router_replay.mode=R2 replays the old-policy forward's routing, but the "
                                       r"Batch has no 'routed_experts'"):
        actor.update_actor(batch)
