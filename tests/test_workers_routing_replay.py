"""Routing replay (``actor.router_replay.mode`` R2 and R3, `jaxrl_hf.workers.routing_replay`) on a tiny random Qwen3-MoE
with a dense layer among its sparse ones, saved as an HF directory, on one given batch of left-padded rows
(dp 4 × tp 2).

The model: replaying a pass's own routing reproduces it exactly; other experts change the output, are the
experts the pass reports, and get their weights from the router (numpy float64 formula), whose gradient flows.
The actor: ``compute_log_prob`` records the routing of its forward (equal to a separate forward's on every real
token, padded and packed layouts alike); an update replaying it equals the update without replay (same weights,
same routing), one replaying other experts does not; the packed update reads the same column; refusals name
the key. R3: the native engine records the routing our forward takes, and replaying it in bf16 brings the
old-policy log-probs nearer the sampler's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import (DP4_TP2_PLACEMENT, left_padded_update_columns, local_actor, random_params,
                             random_prompts, tiny_config, write_tiny_hf_dir)
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
    columns = left_padded_update_columns(CONFIG.vocab_size, P, R, (0, 2, 3, 5), early_stop=(1, 3))
    return Batch.from_dict(columns, meta_info={"global_step": 1})


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
    actor = _actor(model_dir, packed=False, epochs=2)  # two optimizer steps: π_old's routing is needed
    batch = _batch()
    batch = batch.union(Batch.from_dict({"old_log_probs": np.zeros((4, R), np.float32)}))
    with pytest.raises(KeyError, match=r"router_replay.mode=R2 replays recorded routing, but the Batch has no "
                                       r"'routed_experts' \(actor.compute_log_prob records it\)"):
        actor.update_actor(batch)


def _rollout_actor(model_dir, mode):
    return local_actor({
        "model": {"path": model_dir, "dtype": "bfloat16"},
        "actor": {"ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_device": 4, "use_kl_loss": False,
                  "router_replay": {"mode": mode}, "share_prompt_forward": False},
        "rollout": {"name": "jax", "n": 2, "response_length": R, "max_prompt_length": P, "temperature": 1.0},
        "data": {"max_prompt_length": P, "max_response_length": R}, "placement": DP4_TP2_PLACEMENT})


@pytest.fixture(scope="module")
def near_tie_dir(tmp_path_factory):
    """The tiny model with its router weights scaled by 0.002: near-uniform router probabilities, so bf16 rounding
    (the engine's one-token decode steps against the training forward's whole sequences) flips some choices."""
    from jaxrl_hf.models import save_hf_dir

    path = write_tiny_hf_dir(tmp_path_factory.mktemp("moe_near_tie"), CONFIG, 0)
    params = random_params(CONFIG, seed=0)
    router = params["model"]["layers"]["moe"]["router"]
    router["kernel"] = np.asarray(router["kernel"]) * 0.002
    save_hf_dir(path, params, CONFIG)
    return path


def test_r3_replays_the_native_engines_routing_and_shrinks_the_rollout_mismatch(near_tie_dir):
    """bf16, where the engine's decode (KV cache, one token per step) and the training forward route some tokens
    differently: R3's old-policy log-probs are nearer the sampler's than those of the same forward routing by
    itself. Both means are printed (docs/BENCHMARKS.md's MoE row)."""
    model_dir = near_tie_dir
    prompts, mask = random_prompts(0, 8, P, CONFIG.vocab_size)
    actor = _rollout_actor(model_dir, "R3")
    gen = actor.generate_sequences(Batch.from_dict({"prompts": prompts, "prompt_mask": mask},
                                                   meta_info={"global_step": 1}))
    routed, attention = np.asarray(gen["routed_experts"]), np.asarray(gen["attention_mask"]).astype(bool)
    assert routed.shape == (16, P + R, 3, 2)
    assert (routed[:, :, 1] == -1)[attention].all() and (routed[:, :, [0, 2]] >= 0)[attention].all()
    replayed = np.asarray(actor.compute_log_prob(gen)["old_log_probs"])
    plain_actor = _rollout_actor(model_dir, "disabled")
    plain = np.asarray(plain_actor.compute_log_prob(gen.select(
        [k for k in gen.keys() if k != "routed_experts"], []))["old_log_probs"])
    valid = np.asarray(gen["response_mask"]) != 0
    sampler = np.asarray(gen["rollout_log_probs"])
    with_r3, without = np.abs(replayed - sampler)[valid].mean(), np.abs(plain - sampler)[valid].mean()
    params = jax.device_get(actor.state.params)
    _, (_, own) = hidden_states_and_routing(params, CONFIG.replace(dtype="bfloat16"), jnp.asarray(gen["input_ids"]),
                                            jnp.asarray(gen["attention_mask"]), jnp.asarray(gen["position_ids"]))
    own = np.asarray(routed_experts_by_token(own, 16))
    agree = (np.sort(own, -1) == np.sort(routed, -1)).all(-1)[:, :, [0, 2]][attention].mean()
    print(f"\nR3 mismatch |old - rollout| {with_r3:.3e}, without {without:.3e}; training forward routes as the "
          f"engine on {agree:.4f} of (token, MoE layer) pairs")
    assert with_r3 <= without + 1e-6
    advantages = np.where(np.arange(16)[:, None] % 2, 1.0, -1.0).astype(np.float32) * valid
    update = actor.update_actor(gen.union(Batch.from_dict({"old_log_probs": replayed, "advantages": advantages})))
    update = update.meta_info["metrics"]
    assert np.isfinite(update["actor/pg_loss"]) and abs(update["actor/ppo_kl"]) < 1e-3


def test_the_native_engine_records_the_routing_a_teacher_forced_forward_takes():
    """float32 (no rounding flips): every prompt and sampled token's recorded experts equal those of our forward over
    the finished sequences; recording changes no sampled token."""
    from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams

    params = jax.tree.map(jnp.asarray, random_params(CONFIG, seed=5))
    prompts = [list(map(int, np.random.default_rng(0).integers(3, 64, n))) for n in (5, 3, 9, 12)]
    sampling = SamplingParams(temperature=1.0, n=2, max_new_tokens=8, seed=1)
    out = JaxGenerationEngine(CONFIG, params, pad_token_id=0, eos_token_ids=(2,), record_routing=True).generate(
        prompts, sampling)
    plain = JaxGenerationEngine(CONFIG, params, pad_token_id=0, eos_token_ids=(2,)).generate(prompts, sampling)
    np.testing.assert_array_equal(out.response_ids, plain.response_ids)
    ids = np.concatenate([out.prompt_ids, out.response_ids], 1)
    mask = np.concatenate([out.prompt_mask, out.response_mask], 1)
    assert out.routed_experts.shape == (8, ids.shape[1], 3, 2)
    _, (_, experts) = hidden_states_and_routing(params, CONFIG, jnp.asarray(ids), jnp.asarray(mask))
    want = np.asarray(routed_experts_by_token(experts, 8))
    np.testing.assert_array_equal(out.routed_experts[mask.astype(bool)], want[mask.astype(bool)])
    with pytest.raises(ValueError, match=r"record_routing=True\) needs a mixture-of-experts model"):
        JaxGenerationEngine(tiny_config(vocab_size=64, head_dim=16), None, pad_token_id=0, record_routing=True)


def test_sequence_parallel_padding_pads_the_routed_experts_on_their_token_axis():
    from jaxrl_hf.workers.common import pad_sequences_to

    columns = left_padded_update_columns(CONFIG.vocab_size, P, R, (0, 2, 3, 5))
    routed = np.arange(4 * (P + R) * 3 * 2, dtype=np.int32).reshape(4, P + R, 3, 2) + 1
    padded = pad_sequences_to({**columns, "routed_experts": routed}, 4)  # 11 tokens -> 12
    assert padded["input_ids"].shape == (4, 12) and padded["routed_experts"].shape == (4, 12, 3, 2)
    np.testing.assert_array_equal(padded["routed_experts"][:, 1:], routed)
    assert (padded["routed_experts"][:, 0] == 0).all()
