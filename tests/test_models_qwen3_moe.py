"""Qwen3-MoE (``model_type: qwen3_moe``) against transformers on tiny random weights: logits with every layer sparse,
with ``mlp_only_layers`` and with ``decoder_sparse_step``; the HF checkpoint -> params -> HF round trip; the
routing and grouped experts against a per-token loop; the config.json fields and the refused MoE variants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf.mesh.rule_sets import FSDP, MEGATRON
from jaxrl_hf.mesh.rules import logical_to_specs
from jaxrl_hf.models import DecoderConfig, load_hf_dir
from jaxrl_hf.models.forward import forward, init_params, param_logical_axes, param_shapes
from jaxrl_hf.models.moe import grouped_experts, route
from jaxrl_hf.models.weights_hf import hf_state_dict_to_params
from _models_helpers import assert_hf_round_trip, assert_logits_match_hf, tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
VARIANTS = {"all_sparse": dict(norm_topk_prob=True), "mlp_only_1": dict(mlp_only_layers=[1]),
            "sparse_step_2": dict(decoder_sparse_step=2, norm_topk_prob=True)}


def _hf_model(tmp_path, **overrides):
    """A random float32 `Qwen3MoeForCausalLM` saved to ``tmp_path`` (every tensor perturbed, norms included)."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**{**TINY, **overrides})
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return model


def _batch():
    ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    return ids, mask


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(tmp_path, variant):
    hf = _hf_model(tmp_path, **VARIANTS[variant])
    config, params = load_hf_dir(tmp_path)
    assert config.model_type == "qwen3_moe" and config.num_experts == 8 and config.qk_norm
    assert list(config.moe_layers) == [hf.model.layers[i].mlp.__class__.__name__ == "Qwen3MoeSparseMoeBlock"
                                       for i in range(TINY["num_hidden_layers"])]
    ids, mask = _batch()
    assert_logits_match_hf(hf, params, config, ids, mask)


@pytest.mark.parametrize("variant", ["all_sparse", "mlp_only_1"])
def test_hf_round_trip_is_bit_exact(tmp_path, variant):
    _hf_model(tmp_path / "hf", **VARIANTS[variant])
    config, original = assert_hf_round_trip(tmp_path, "Qwen3MoeForCausalLM")
    with pytest.raises(KeyError, match="mlp.experts.3.up_proj"):
        hf_state_dict_to_params({k: v for k, v in original.items() if "layers.0.mlp.experts.3.up_proj" not in k},
                                config)


def test_routing_and_grouped_experts_match_a_token_loop():
    rng = np.random.default_rng(1)
    n, e, x, m, k = 9, 8, 5, 6, 2
    h = rng.normal(size=(n, e)).astype(np.float32)
    router = rng.normal(size=(e, x)).astype(np.float32)
    gate, up = rng.normal(size=(x, e, m)).astype(np.float32), rng.normal(size=(x, e, m)).astype(np.float32)
    down = rng.normal(size=(x, m, e)).astype(np.float32)
    for norm in (False, True):
        routing = route(jnp.asarray(h), jnp.asarray(router), k, norm)
        y = np.asarray(grouped_experts(jnp.asarray(h), routing.experts, routing.weights, gate, up, down))
        logits = h @ router
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        for t in range(n):
            top = np.argsort(-probs[t])[:k]
            w = probs[t, top] / (probs[t, top].sum() if norm else 1.0)
            assert list(np.asarray(routing.experts[t])) == list(top)
            np.testing.assert_allclose(np.asarray(routing.weights[t]), w, rtol=1e-5)
            silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
            ref = sum(wj * (silu(h[t] @ gate[j]) * (h[t] @ up[j])) @ down[j] for j, wj in zip(top, w))
            np.testing.assert_allclose(y[t], ref, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(routing.logits), logits, rtol=1e-5, atol=1e-5)


def test_config_json_fields_and_moe_layers():
    hf = {**TINY, "model_type": "qwen3_moe", "mlp_only_layers": [0], "decoder_sparse_step": 1}
    config = DecoderConfig.from_hf_dict(hf)
    assert config.moe_layers == (False, True, True, True) and config.is_moe
    out = config.to_hf_dict()
    assert out["architectures"] == ["Qwen3MoeForCausalLM"]
    assert {k: out[k] for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                "decoder_sparse_step", "mlp_only_layers")} == {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [0]}
    assert DecoderConfig.from_hf_dict(out) == config
    assert DecoderConfig.from_hf_dict({**hf, "decoder_sparse_step": 2, "mlp_only_layers": []}).moe_layers == (
        False, True, False, True)
    assert DecoderConfig.from_hf_dict({**hf, "num_experts": 0}).is_moe is False
    dense = DecoderConfig.from_hf_dict({**TINY, "model_type": "qwen3"})  # MoE keys of a dense family are ignored
    assert dense.num_experts == 0 and not dense.is_moe and "expert" not in str(param_logical_axes(dense))


@pytest.mark.parametrize("key, value, what", [
    ("shared_expert_intermediate_size", 64, "shared experts"), ("n_shared_experts", 1, "shared experts"),
    ("kv_lora_rank", 16, "MLA"), ("q_lora_rank", 16, "MLA"), ("n_group", 4, "grouped top-k"),
    ("topk_group", 2, "grouped top-k")])
def test_unsupported_moe_variants_are_refused_naming_the_field(key, value, what):
    hf = {**TINY, "model_type": "qwen3_moe", key: value}
    with pytest.raises(ValueError, match=f"{key}={value}.*{what}"):
        DecoderConfig.from_hf_dict(hf)
    with pytest.raises(ValueError, match=key):  # whatever the model_type says (DeepSeek's, Qwen2-MoE's)
        DecoderConfig.from_hf_dict({**hf, "model_type": "deepseek_v3"})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        DecoderConfig.from_hf_dict({**TINY, "model_type": "qwen3_moe", "num_experts_per_tok": 9})


def test_moe_params_resolve_replicated_over_experts_under_the_rule_sets():
    config = DecoderConfig.from_hf_dict({**TINY, "model_type": "qwen3_moe", "mlp_only_layers": [1]})
    axes = param_logical_axes(config)
    assert tuple(axes["model"]["layers"]["moe"]["gate_proj"]["kernel"]) == ("layers", "expert", "embed", "mlp")
    for rules in (MEGATRON.params, FSDP.params):
        specs = logical_to_specs(axes, rules)
        assert specs["model"]["layers"]["moe"]["gate_proj"]["kernel"][1] is None  # experts replicated
    shapes = param_shapes(config)["model"]["layers"]
    assert shapes["moe"]["down_proj"]["kernel"].shape == (4, 8, 32, 64)
    assert shapes["mlp"]["down_proj"]["kernel"].shape == (4, 96, 64)
    params = init_params(config)  # init runs both branches; the same tree as the shapes
    assert jax.tree.structure(params) == jax.tree.structure(param_shapes(config))


def test_kv_cache_decode_unrolled_layers_and_gradients(variant="mlp_only_1"):
    from jaxrl_hf.models import init_kv_cache, make_module
    from jaxrl_hf.backends.cpu import layer_unrolled
    from jaxrl_hf.models.llama import default_positions

    hf = {**TINY, "model_type": "qwen3_moe", **VARIANTS[variant]}
    config = DecoderConfig.from_hf_dict(hf)
    params = init_params(config, 1)
    ids, mask = _batch()
    ref = np.asarray(jax.jit(forward, static_argnums=1)(params, config, jnp.asarray(ids), jnp.asarray(mask)))
    module = make_module(config)
    apply = jax.jit(lambda p, *args: module.apply({"params": p}, *args))
    cache, pos, full = init_kv_cache(config, 2, 12), default_positions(jnp.asarray(mask)), jnp.asarray(mask)
    logits, cache = apply(params, jnp.asarray(ids[:, :8]), pos[:, :8], full, cache, 0)
    for t in range(8, 10):
        step, cache = apply(params, jnp.asarray(ids[:, t:t + 1]), pos[:, t:t + 1], full, cache, t)
        np.testing.assert_allclose(np.asarray(step)[:, 0], ref[:, t], atol=1e-4)
    split = layer_unrolled.split_layers(params, config.num_hidden_layers)
    caches = layer_unrolled.init_layer_caches(config, 2, 12, jnp.float32)
    hidden, _ = jax.jit(lambda s, c: layer_unrolled.hidden_states(module, s, jnp.asarray(ids), pos, full, c, 0, False))(
        split, caches)
    logits = module.apply({"params": params}, hidden, method=lambda m, h: m.logits_from_hidden(h))
    np.testing.assert_allclose(np.asarray(logits)[mask > 0], ref[mask > 0], atol=1e-4)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(forward(p, config, jnp.asarray(ids), jnp.asarray(mask)) ** 2) * 1e-3))(params)
    g = grads["model"]["layers"]["moe"]
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(g))
    assert float(jnp.abs(g["gate_proj"]["kernel"]).sum()) > 0 and float(jnp.abs(g["router"]["kernel"]).sum()) > 0


@pytest.mark.parametrize("variant", ["all_sparse", "mlp_only_1"])
def test_parameter_counts_total_as_transformers_and_active_for_the_mfu(tmp_path, variant):
    from jaxrl_hf.workers.peak_flops import mfu_summary

    hf = _hf_model(tmp_path, **VARIANTS[variant])
    config, params = load_hf_dir(tmp_path)
    assert config.num_params() == hf.num_parameters()
    e, k, m = TINY["hidden_size"], TINY["num_experts_per_tok"], TINY["moe_intermediate_size"]
    unused = sum(sparse for sparse in config.moe_layers) * 3 * (TINY["num_experts"] - k) * e * m
    assert config.num_params(active=True) == hf.num_parameters() - unused
    summary = mfu_summary(config, params, 1e12, 1)  # 6 · N_active per token, the untied input embedding left out
    assert summary["model_params"] == config.num_params(active=True) - TINY["vocab_size"] * e
