"""Decoder numerics on tiny random configs against transformers (independent torch reference)."""

from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import jit_forward, random_params, tiny_config
from jaxrl_hf.models import (DecoderConfig, forward, init_kv_cache, load_hf_dir, make_module, next_token_targets,
                             param_logical_axes, params_to_hf_state_dict, save_hf_dir, token_log_probs_and_entropy)
from jaxrl_hf.models.forward import lm_head_log_probs
from jaxrl_hf.models.llama import CausalLM, default_positions
from jaxrl_hf.models.logprobs import log_probs_and_entropy_from_hidden
from jaxrl_hf.models.rope import rope_frequencies
from jaxrl_hf.models.weights_hf import hf_state_dict_to_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf_model(tmp_path, params, config):
    save_hf_dir(tmp_path, params, config)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    return model.eval()


def _left_padded_batch(rng, vocab, lengths, width):
    ids = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = rng.integers(3, vocab, n)
        mask[i, width - n:] = 1
    return ids, mask


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("qwen2", True)])
def test_logits_match_transformers_left_padded(tmp_path, model_type, tied):
    config = tiny_config(model_type=model_type, tie_word_embeddings=tied, qkv_bias=model_type == "qwen2")
    params = random_params(config)
    hf = _hf_model(tmp_path, params, config)
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[model_type]
    rng = np.random.default_rng(1)
    ids, mask = _left_padded_batch(rng, config.vocab_size, [9, 5, 7], 9)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    ours = np.asarray(jit_forward(params, config, jnp.asarray(ids), jnp.asarray(mask)))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(positions, dtype=torch.long)).logits.numpy()
    valid = mask.astype(bool)
    assert np.abs(ours[valid] - ref[valid]).max() < 1e-4


def test_packed_segments_equal_separate_rows():
    """Rows packed into one sequence (attention_mask = segment ids 1, 2, ..., positions restarting per segment)
    give each row's logits exactly as its own unpadded forward (model.use_remove_padding's contract)."""
    config = tiny_config()
    params = random_params(config, seed=6)
    rng = np.random.default_rng(2)
    rows = [rng.integers(3, config.vocab_size, n).astype(np.int32) for n in (5, 7, 3)]
    packed = np.concatenate(rows)[None]
    segments = np.concatenate([np.full(len(r), i + 1, np.int32) for i, r in enumerate(rows)] + [np.zeros(2, np.int32)])
    packed = np.concatenate([packed, np.zeros((1, 2), np.int32)], axis=1)
    positions = np.concatenate([np.arange(len(r)) for r in rows] + [np.zeros(2, int)])[None].astype(np.int32)
    got = np.asarray(jit_forward(params, config, jnp.asarray(packed), jnp.asarray(segments[None]),
                                 jnp.asarray(positions)))[0]
    start = 0
    for r in rows:
        alone = np.asarray(jit_forward(params, config, jnp.asarray(r[None])))[0]
        np.testing.assert_allclose(got[start:start + len(r)], alone, atol=2e-5)
        start += len(r)


def test_safetensors_round_trip_bit_exact(tmp_path):
    config = tiny_config(qkv_bias=True, o_bias=True)
    params = random_params(config, seed=3)
    save_hf_dir(tmp_path, params, config)
    loaded_config, loaded = load_hf_dir(tmp_path)
    assert loaded_config == config
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(loaded)):
        assert np.array_equal(np.asarray(a), b), path
    hf_names = json.loads((tmp_path / "config.json").read_text())
    assert hf_names["attention_bias"] is True
    # and export(import(x)) == x on the HF side
    state = params_to_hf_state_dict(loaded, config)
    again = params_to_hf_state_dict(hf_state_dict_to_params(state, config), config)
    assert state.keys() == again.keys() and all(np.array_equal(state[k], again[k]) for k in state)


def test_import_errors_name_the_tensor():
    config = tiny_config()
    state = params_to_hf_state_dict(random_params(config), config)
    broken = dict(state)
    del broken["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        hf_state_dict_to_params(broken, config, source="ckpt")
    extra = dict(state, **{"model.layers.9.mlp.up_proj.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="unexpected tensor.*layers.9"):
        hf_state_dict_to_params(extra, config)
    bad = dict(state, **{"model.norm.weight": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match="model.norm.weight"):
        hf_state_dict_to_params(bad, config)


def test_config_validation_lists_valid_values():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny_config(num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ValueError, match="valid: .*bfloat16"):
        tiny_config(dtype="fp8")
    with pytest.raises(ValueError, match="supported: .*llama3"):
        tiny_config(rope_scaling=(("factor", 2.0), ("rope_type", "dynamic")))
    with pytest.raises(ValueError, match="unknown DecoderConfig field.*valid"):
        tiny_config().replace(hiden_size=3)
    with pytest.raises(ValueError, match="missing required key"):
        DecoderConfig.from_hf_dict({"model_type": "llama", "vocab_size": 3})


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
])
def test_rope_scaling_matches_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_dict = {"model_type": "llama", "vocab_size": 97, "hidden_size": 64, "intermediate_size": 64,
               "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 256,
               "rope_theta": 10000.0, "rope_scaling": rope}
    config = DecoderConfig.from_hf_dict(hf_dict)
    ours, scale = rope_frequencies(config)
    hf_config = transformers.LlamaConfig(**{k: v for k, v in hf_dict.items() if k != "model_type"})
    ref, ref_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
    assert scale == pytest.approx(ref_scale)


def test_log_probs_and_entropy_match_float64_reference():
    config = tiny_config()
    params = random_params(config, seed=5)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (2, 11)).astype(np.int32)
    targets = next_token_targets(jnp.asarray(ids))
    logits = np.asarray(jit_forward(params, config, jnp.asarray(ids)), np.float64) / 0.7
    logp_ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    probs = np.exp(logp_ref)
    ent_ref = -(probs * logp_ref).sum(-1)
    picked = np.take_along_axis(logp_ref, np.asarray(targets)[..., None], -1)[..., 0]
    fn = jax.jit(token_log_probs_and_entropy, static_argnums=1, static_argnames="chunk_size")
    logp, ent = fn(params, config, jnp.asarray(ids), targets, temperature=0.7,
                   chunk_size=4)  # 11 is not a multiple of 4: exercises padding
    np.testing.assert_allclose(np.asarray(logp), picked, atol=2e-5)
    np.testing.assert_allclose(np.asarray(ent), ent_ref, atol=2e-5)


def test_lm_head_of_one_chunk_is_not_rematerialised_and_matches_the_chunked_one():
    """A sequence that fits one chunk keeps its logits for the backward (no recomputed LM head); values and
    gradients equal those of the chunked, rematerialised path."""
    rng = np.random.default_rng(4)
    hidden = jnp.asarray(rng.normal(size=(3, 6, 8)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(8, 29)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 29, (3, 6)), jnp.int32)

    def loss(h, w, chunk):
        logp, ent = log_probs_and_entropy_from_hidden(h, w, targets, 0.7, chunk)
        return (logp * jnp.arange(6.0)).sum() + 0.1 * ent.sum()

    def remats(chunk):
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)), static_argnums=2)(hidden, kernel, chunk)
        return str(jaxpr).count("remat") + str(jaxpr).count("checkpoint")

    assert remats(6) == 0 and remats(64) == 0 and remats(4) > 0
    for whole in (6, 64):
        for a, b in zip(jax.grad(loss, argnums=(0, 1))(hidden, kernel, whole),
                        jax.grad(loss, argnums=(0, 1))(hidden, kernel, 4)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
        np.testing.assert_allclose(float(loss(hidden, kernel, whole)), float(loss(hidden, kernel, 4)), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_vocab_major_lm_head_gives_the_same_log_probs_and_gradients_without_a_transposed_gradient(dtype):
    """A tied LM head passed as the embedding ``[V, E]`` (``vocab_major``) equals the ``[E, V]`` kernel: log-probs,
    entropy and both gradients (float32: to rounding; bf16: to bf16 rounding of the weight gradient); its bf16
    gradient program never holds the ``[E, V]`` float32 gradient (the old form does: checked by hand)."""
    rng = np.random.default_rng(5)
    hidden = jnp.asarray(rng.normal(size=(2, 5, 16)), dtype)
    embedding = jnp.asarray(rng.normal(size=(1031, 16)) * 0.3, dtype)  # V > 1024: XLA:CPU's slow-row padding too
    targets = jnp.asarray(rng.integers(0, 1031, (2, 5)), jnp.int32)

    def loss(h, w, vocab_major):
        logp, ent = log_probs_and_entropy_from_hidden(h, w, targets, 0.7, 128, vocab_major=vocab_major)
        return (logp * jnp.arange(5.0)).sum() + 0.1 * ent.sum()

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    value_t, (dh_t, dw_t) = grad(hidden, embedding.T, False)
    value_v, (dh_v, dw_v) = grad(hidden, embedding, True)
    assert dw_v.shape == embedding.shape and dw_v.dtype == dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(float(value_v), float(value_t), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dh_v, np.float32), np.asarray(dh_t, np.float32), **tol)
    np.testing.assert_allclose(np.asarray(dw_v, np.float32), np.asarray(dw_t, np.float32).T, **tol)
    if dtype == jnp.bfloat16:
        hlo = grad.lower(hidden, embedding, True).compile().as_text()
        assert not re.search(r"= f32\[1031,16\][^ ]* (transpose|copy)\(", hlo)
        assert not re.search(r"= f32\[16,1031\]", hlo)  # the gradient is made [V, E], never [E, V]


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk_size", [128, 3])
def test_the_lm_head_gradient_of_float32_master_weights_stays_float32_under_bf16_compute(tied, chunk_size):
    """`lm_head_log_probs` with bf16 compute: the LM head's weight gradient is the float32 master weights' (no bf16
    rounding of the gradient, summed in float32 over the chunks), against numpy float64 on the same bf16 operands,
    within 2e-5 of its largest entry untied and 2.5e-4 tied (measured 9.5e-5: a tied embedding's gradient takes the
    logits' cotangent in bf16 away from the scored token, `matmul.lm_head_matmul`); the form before (the weight cast
    outside the product, a bf16 gradient) misses by 0.05-0.13."""
    config = tiny_config(tie_word_embeddings=tied, dtype="bfloat16")
    params = random_params(config, seed=4)
    rng = np.random.default_rng(6)
    hidden = jnp.asarray(rng.normal(size=(2, 7, config.hidden_size)), jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, config.vocab_size, (2, 7)), jnp.int32)
    weights = np.arange(7.0)

    def loss(p):
        return (lm_head_log_probs(p, config, hidden, targets, 0.7, chunk_size, False)[0] * weights).sum()

    grads = jax.jit(jax.grad(loss))(params)
    if tied:
        w = np.asarray(params["model"]["embed_tokens"]["embedding"]).T
        got = np.asarray(grads["model"]["embed_tokens"]["embedding"]).T
    else:
        w, got = np.asarray(params["lm_head"]["kernel"]), np.asarray(grads["lm_head"]["kernel"])
    assert got.dtype == np.float32
    h = np.asarray(hidden.astype(jnp.float32), np.float64).reshape(-1, config.hidden_size)
    logits = h @ np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32), np.float64) / 0.7
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    dlogits = (np.eye(config.vocab_size)[np.asarray(targets).reshape(-1)] - probs) * np.tile(weights, 2)[:, None]
    want = h.T @ dlogits / 0.7
    # the hidden states are given: a tied embedding's lookup adds nothing
    np.testing.assert_allclose(got, want, rtol=0, atol=(2.5e-4 if tied else 2e-5) * np.abs(want).max())


def test_remat_and_bf16_options():
    config = tiny_config()
    params = random_params(config, seed=2)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 8)), jnp.int32)
    targets = next_token_targets(ids)

    def loss(p, cfg):
        return token_log_probs_and_entropy(p, cfg, ids, targets, chunk_size=3)[0].sum()

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g_plain = grad(params, config)
    g_remat = grad(params, config.replace(remat="full"))
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_remat)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    f32 = np.asarray(jit_forward(params, config, ids))
    bf16 = np.asarray(jit_forward(params, config.replace(dtype="bfloat16"), ids))
    assert bf16.dtype == np.float32
    assert np.abs(bf16 - f32).max() < 0.1 * np.abs(f32).max()


@pytest.mark.parametrize("tied", [True, False])
def test_bf16_lm_head_gives_float32_logits_of_the_bf16_operands(tied):
    """The LM head in a 16-bit compute dtype accumulates in float32 and returns float32 logits (not rounded to
    bf16: those differed from the float64 product by up to 2^-9 relative), tied (``embedding.T``) or not."""
    config = tiny_config(tie_word_embeddings=tied, dtype="bfloat16")
    params = random_params(config, seed=5)
    hidden = jnp.asarray(np.random.default_rng(4).normal(0, 3, (2, 5, config.hidden_size)), jnp.bfloat16)
    logits = make_module(config).apply({"params": params}, hidden, method=CausalLM.logits_from_hidden)
    kernel = params["model"]["embed_tokens"]["embedding"].T if tied else params["lm_head"]["kernel"]
    ref = np.asarray(hidden, np.float64) @ np.asarray(jnp.asarray(kernel, jnp.bfloat16), np.float64)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits, np.float64), ref, rtol=1e-5, atol=1e-5)


def test_kv_cache_decode_equals_full_forward():
    config = tiny_config()
    params = random_params(config, seed=4)
    rng = np.random.default_rng(2)
    ids, mask = _left_padded_batch(rng, config.vocab_size, [6, 3], 6)
    extra = rng.integers(3, config.vocab_size, (2, 3)).astype(np.int32)
    full_ids = np.concatenate([ids, extra], 1)
    full_mask = np.concatenate([mask, np.ones((2, 3), np.int32)], 1)
    ref = np.asarray(jit_forward(params, config, jnp.asarray(full_ids), jnp.asarray(full_mask)))
    module = make_module(config)
    apply = jax.jit(lambda p, *args: module.apply({"params": p}, *args))
    cache = init_kv_cache(config, 2, 9)
    pos = default_positions(jnp.asarray(full_mask))
    logits, cache = apply(params, jnp.asarray(ids), pos[:, :6], jnp.asarray(full_mask), cache, 0)
    np.testing.assert_allclose(np.asarray(logits)[mask > 0], ref[:, :6][mask > 0], atol=1e-5)
    for t in range(3):
        step_logits, cache = apply(params, jnp.asarray(extra[:, t:t + 1]), pos[:, 6 + t:7 + t],
                                          jnp.asarray(full_mask), cache, 6 + t)
        np.testing.assert_allclose(np.asarray(step_logits)[:, 0], ref[:, 6 + t], atol=1e-5)


def test_kv_cache_chunk_over_cached_slots_equals_full_forward_and_bit_pattern_cache_is_exact():
    """A 3-token chunk over 6 cached slots (the T > 1 path of `cached_attention`: one [groups*T, D] matrix per row
    and kv head) equals the full forward; in bf16 the uint16 bit-pattern cache gives the logits of a bf16 cache
    bit for bit, and the cache holds the same keys/values."""
    config = tiny_config()
    params = random_params(config, seed=4)
    rng = np.random.default_rng(3)
    ids, mask = _left_padded_batch(rng, config.vocab_size, [6, 4], 6)
    extra = rng.integers(3, config.vocab_size, (2, 3)).astype(np.int32)
    full_ids, full_mask = np.concatenate([ids, extra], 1), np.concatenate([mask, np.ones((2, 3), np.int32)], 1)
    ref = np.asarray(jit_forward(params, config, jnp.asarray(full_ids), jnp.asarray(full_mask)))
    pos = default_positions(jnp.asarray(full_mask))

    def run(cfg, cache_dtype):
        module = make_module(cfg)
        apply = jax.jit(lambda p, *args: module.apply({"params": p}, *args))
        cache = init_kv_cache(cfg, 2, 9, cache_dtype)
        assert cache["k"].shape == (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 9, cfg.head_dim)
        _, cache = apply(params, jnp.asarray(ids), pos[:, :6], jnp.asarray(full_mask), cache, 0)
        logits, cache = apply(params, jnp.asarray(extra), pos[:, 6:], jnp.asarray(full_mask), cache, 6)
        return np.asarray(logits), cache

    logits, _ = run(config, None)
    np.testing.assert_allclose(logits, ref[:, 6:], atol=1e-5)
    bf16 = config.replace(dtype="bfloat16")
    plain, plain_cache = run(bf16, "bfloat16")
    bits, bits_cache = run(bf16, "uint16")
    assert bits_cache["k"].dtype == jnp.uint16
    np.testing.assert_array_equal(bits, plain)
    for name in ("k", "v"):
        np.testing.assert_array_equal(jax.lax.bitcast_convert_type(bits_cache[name], jnp.bfloat16),
                                      plain_cache[name])
    with pytest.raises(ValueError, match="16-bit compute dtype"):
        init_kv_cache(config, 2, 9, "uint16")


@pytest.mark.parametrize("overrides", [dict(qkv_bias=True), dict(model_type="qwen3", qk_norm=True),
                                       dict(model_type="gemma2", hidden_act="gelu_pytorch_tanh"),
                                       dict(model_type="gemma3_text", hidden_act="gelu_pytorch_tanh", qk_norm=True)])
def test_logical_axes_cover_every_param(overrides):
    config = tiny_config(**overrides)
    axes = param_logical_axes(config)
    params = random_params(config)
    allowed = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "layers"}
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    assert jax.tree.structure(params) == jax.tree.structure(
        axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    for spec, leaf in zip(flat_axes, jax.tree.leaves(params)):
        assert len(spec) == np.ndim(leaf) and set(spec) <= allowed
    assert tuple(axes["model"]["layers"]["self_attn"]["q_proj"]["kernel"]) == ("layers", "embed", "heads", "head_dim")
    assert tuple(axes["model"]["embed_tokens"]["embedding"]) == ("vocab", "embed")


def test_value_head_matches_transformers_sequence_classification(tmp_path):
    from safetensors.numpy import save_file

    from jaxrl_hf.models.value_head import (hf_state_dict_to_value_params, value_forward, value_params_from_lm,
                                            value_params_to_hf_state_dict)

    config = tiny_config(tie_word_embeddings=True)
    lm = random_params(config, seed=7)
    critic = value_params_from_lm(lm, config, rng=1, head_std=0.5)
    assert critic["model"] is lm["model"]
    state = value_params_to_hf_state_dict(critic, config)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = dict(config.to_hf_dict(), architectures=["LlamaForSequenceClassification"], num_labels=1)
    (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
    hf = transformers.LlamaForSequenceClassification.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = np.random.default_rng(0).integers(3, config.vocab_size, (2, 7)).astype(np.int32)
    values = np.asarray(value_forward(critic, config, jnp.asarray(ids)))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()[:, 0]
    np.testing.assert_allclose(values[:, -1], ref, atol=1e-5)
    back = hf_state_dict_to_value_params(state, config)
    assert np.array_equal(back["score"]["kernel"], np.asarray(critic["score"]["kernel"]))
