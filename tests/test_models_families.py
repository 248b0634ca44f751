"""Model families beyond Llama/Qwen2 against transformers on tiny random weights: Qwen3 (q/k head norms), sliding
windows (Mistral, Qwen2 ``use_sliding_window``), Gemma 2 (sandwich norms, GeGLU, soft-caps, alternating windows),
Gemma 3 text (q/k norms, a RoPE base per layer type);
the windowed / soft-capped attention math against a float64 loop (outputs and gradients), KV-cache decoding with
a window, and the ``config.json`` readers' choices and refusals."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import jit_forward, random_params, tiny_config
from jaxrl_hf.models import DecoderConfig, init_kv_cache, load_hf_dir, make_module, save_hf_dir
from jaxrl_hf.models import attention as attn
from jaxrl_hf.models.forward import next_token_targets, token_log_probs_and_entropy
from jaxrl_hf.models.llama import default_positions

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GEMMA2 = dict(model_type="gemma2", hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, sliding_window=4,
              layer_types=("sliding_attention", "full_attention"), query_pre_attn_scalar=16.0,
              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
GEMMA3 = dict(model_type="gemma3_text", hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, qk_norm=True,
              sliding_window=4, layer_types=("sliding_attention", "full_attention"), query_pre_attn_scalar=16.0,
              final_logit_softcapping=3.0, rope_theta=1e6, rope_scaling=(("factor", 8.0), ("rope_type", "linear")),
              rope_local_theta=10000.0)
FAMILIES = {  # name -> (DecoderConfig overrides, transformers class)
    "qwen3": (dict(model_type="qwen3", qk_norm=True), "Qwen3ForCausalLM"),
    "qwen3_tied": (dict(model_type="qwen3", qk_norm=True, tie_word_embeddings=True), "Qwen3ForCausalLM"),
    "mistral_window4": (dict(model_type="mistral", sliding_window=4), "MistralForCausalLM"),
    "qwen2_window4_layer1": (dict(model_type="qwen2", qkv_bias=True, sliding_window=4,
                                  layer_types=("full_attention", "sliding_attention")), "Qwen2ForCausalLM"),
    "gemma2": (GEMMA2, "Gemma2ForCausalLM"),
    "gemma3_text": (GEMMA3, "Gemma3ForCausalLM"),
}


def _batch(config: DecoderConfig) -> tuple[np.ndarray, np.ndarray]:
    """Two rows of T=16: one full, one left-padded by 5."""
    ids = np.random.default_rng(0).integers(3, config.vocab_size, (2, 16)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :5] = 0
    return ids, mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    overrides, hf_class = FAMILIES[family]
    config = tiny_config(**overrides)
    params = random_params(config)
    save_hf_dir(tmp_path, params, config)
    assert load_hf_dir(tmp_path)[0] == config  # config.json round trip
    # transformers' sdpa path drops Gemma 2's attention soft-cap; its eager path is the reference
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert type(hf).__name__ == hf_class
    ids, mask = _batch(config)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(np.maximum(np.cumsum(mask, 1) - 1, 0))).logits.numpy()
    valid = mask.astype(bool)
    changes_attention = config.layer_windows is not None
    for impl in ("eager", "blockwise") if changes_attention else ("eager",):
        ours = np.asarray(jit_forward(params, config.replace(attn_implementation=impl), jnp.asarray(ids),
                                      jnp.asarray(mask)))
        assert np.abs(ours[valid] - ref[valid]).max() < 1e-4, impl
    if config.layer_windows is not None:  # the window changes the answer at T=16 > 4
        unwindowed = config.replace(sliding_window=None, layer_types=(), rope_local_theta=None)
        far = np.asarray(jit_forward(params, unwindowed, jnp.asarray(ids), jnp.asarray(mask)))
        assert np.abs(far[valid] - ref[valid]).max() > 1e-2


def _numpy_windowed_attention(q, k, v, seg, scale, window, softcap):
    """float64 loops: keys j with i - window < j <= i (window 0: all j <= i) in the query's segment; scores
    soft-capped as c * tanh(s / c)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros(q.shape)
    for b in range(q.shape[0]):
        for i in range(q.shape[1]):
            keys = [j for j in range(i + 1) if seg[b, j] != 0 and seg[b, j] == seg[b, i]
                    and (window == 0 or j > i - window)]
            for h in range(q.shape[2]):
                for g in range(q.shape[3]):
                    s = np.array([q[b, i, h, g] @ k[b, j, h] * scale for j in keys])
                    s = softcap * np.tanh(s / softcap) if softcap else s
                    w = np.exp(s - s.max()) if keys else s
                    out[b, i, h, g] = (w / w.sum()) @ v[b, keys, h] if keys else 0.0
    return out


@pytest.mark.parametrize("window,softcap", [(5, None), (3, 1.5)])
def test_windowed_softcapped_attention_blockwise_eager_float64(window, softcap):
    t = 21
    rng = np.random.default_rng(window)
    q = jnp.asarray(rng.normal(size=(2, t, 2, 2, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, t, 2, 8)), jnp.float32) for _ in range(2))
    seg = np.ones((2, t), np.int32)
    seg[0, :4], seg[1, 12:] = 0, 2  # left padding; two packed segments
    scale, w = 8 ** -0.5, jnp.int32(window)
    ref = _numpy_windowed_attention(q, k, v, seg, scale, window, softcap)
    valid = (seg != 0)[:, :, None, None, None]
    eager = lambda q, k, v: attn.eager_attention(q, k, v, jnp.asarray(seg), scale, w, softcap)  # noqa: E731
    block = lambda q, k, v: attn.blockwise_attention(q, k, v, jnp.asarray(seg), scale, 8, 4, w, softcap)  # noqa: E731
    for fn in (eager, block):
        np.testing.assert_allclose(np.where(valid, np.asarray(fn(q, k, v)), 0), np.where(valid, ref, 0), atol=2e-5)
    cotangent = jnp.asarray(rng.normal(size=q.shape) * valid, jnp.float32)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a) * cotangent)  # noqa: E731
    grads_eager = jax.grad(loss(eager), argnums=(0, 1, 2))(q, k, v)
    grads_block = jax.jit(jax.grad(loss(block), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(grads_eager, grads_block):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=3e-5)


def test_auto_avoids_cudnn_and_explicit_cudnn_refuses_windows():
    assert attn.resolve_implementation("auto", 16, jnp.bfloat16, 64, windowed=True) == "eager"
    with pytest.raises(ValueError, match="model.attn_implementation.*sliding_window"):
        attn.resolve_implementation("cudnn", 16, jnp.bfloat16, 64, windowed=True)
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        attn.resolve_implementation("cudnn", 16, jnp.bfloat16, 64, softcapped=True)


@pytest.mark.parametrize("family", ["mistral_window4", "gemma2", "gemma3_text"])
def test_kv_cache_decode_with_window_equals_full_forward(family):
    config = tiny_config(**FAMILIES[family][0])
    params = random_params(config, seed=1)
    ids, mask = _batch(config)
    ref = np.asarray(jit_forward(params, config, jnp.asarray(ids), jnp.asarray(mask)))
    module = make_module(config)
    apply = jax.jit(lambda p, *args: module.apply({"params": p}, *args))
    cache, pos, full_mask = init_kv_cache(config, 2, 16), default_positions(jnp.asarray(mask)), jnp.asarray(mask)
    logits, cache = apply(params, jnp.asarray(ids[:, :9]), pos[:, :9], full_mask, cache, 0)
    np.testing.assert_allclose(np.asarray(logits)[mask[:, :9] > 0], ref[:, :9][mask[:, :9] > 0], atol=1e-5)
    for t in range(9, 16):  # one token at a time: the window slides over the cache
        step, cache = apply(params, jnp.asarray(ids[:, t:t + 1]), pos[:, t:t + 1], full_mask, cache, t)
        np.testing.assert_allclose(np.asarray(step)[:, 0], ref[:, t], atol=1e-5)


def test_gemma2_log_probs_apply_the_final_soft_cap():
    config = tiny_config(**GEMMA2)
    params = random_params(config, seed=2)
    ids, mask = _batch(config)
    logits = np.asarray(jit_forward(params, config, jnp.asarray(ids), jnp.asarray(mask)), np.float64)
    assert np.abs(logits).max() <= 3.0 + 1e-6
    targets = np.asarray(next_token_targets(jnp.asarray(ids)))
    logp, _ = token_log_probs_and_entropy(params, config, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(mask),
                                          temperature=0.7)
    z = logits / 0.7
    expected = np.take_along_axis(z, targets[..., None], -1)[..., 0] - np.log(np.exp(z).sum(-1))
    np.testing.assert_allclose(np.asarray(logp)[mask > 0], expected[mask > 0], atol=1e-5)


@pytest.mark.parametrize("family,hf_class", [("gemma2", "Gemma2ForSequenceClassification"),
                                             ("gemma3_text", "Gemma3TextForSequenceClassification")])
def test_gemma_value_head_matches_transformers_sequence_classification(tmp_path, family, hf_class):
    from safetensors.numpy import save_file

    from jaxrl_hf.models.value_head import value_forward, value_params_from_lm, value_params_to_hf_state_dict
    from jaxrl_hf.rewards.rm_io import reward_model_hf_config

    config = tiny_config(**FAMILIES[family][0])
    critic = value_params_from_lm(random_params(config, seed=3), config, rng=1, head_std=0.5)
    save_file(value_params_to_hf_state_dict(critic, config), str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(reward_model_hf_config(config)))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    assert type(hf).__name__ == hf_class and hf.config.architectures == [hf_class]
    ids = np.random.default_rng(0).integers(3, config.vocab_size, (2, 9)).astype(np.int32)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()[:, 0]
    np.testing.assert_allclose(np.asarray(value_forward(critic, config, jnp.asarray(ids)))[:, -1], ref, atol=1e-5)


def _hf(model_type: str, **extra) -> dict:
    return dict(model_type=model_type, vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra)


def test_config_json_sliding_window_rules():
    # Qwen2/Qwen3: only with use_sliding_window, from max_window_layers on
    assert DecoderConfig.from_hf_dict(_hf("qwen2", sliding_window=8)).layer_windows is None
    qwen = DecoderConfig.from_hf_dict(_hf("qwen3", sliding_window=8, use_sliding_window=True, max_window_layers=2))
    assert qwen.layer_windows == (0, 0, 8, 8) and qwen.qk_norm and not qwen.qkv_bias
    # Mistral: every layer when set; a window as long as max_position_embeddings hides nothing and is dropped
    assert DecoderConfig.from_hf_dict(_hf("mistral", sliding_window=8)).layer_windows == (8,) * 4
    assert DecoderConfig.from_hf_dict(_hf("mistral", sliding_window=64)).layer_windows is None
    assert DecoderConfig.from_hf_dict(_hf("mistral", sliding_window=None)).layer_windows is None
    # Gemma 2: even layers slide by default; transformers' defaults for the scalars
    gemma = DecoderConfig.from_hf_dict(_hf("gemma2", sliding_window=8, head_dim=8))
    assert gemma.layer_windows == (8, 0, 8, 0) and gemma.tie_word_embeddings
    assert (gemma.query_pre_attn_scalar, gemma.attn_logit_softcapping, gemma.final_logit_softcapping) == (
        256.0, 50.0, 30.0)
    with pytest.raises(ValueError, match="layer_types"):
        DecoderConfig.from_hf_dict(_hf("gemma2", layer_types=["sliding_attention"], sliding_window=8))
    # Gemma 3, a hub config.json of the transformers 4 era: one full layer in sliding_window_pattern, the sliding
    # layers' RoPE base from rope_local_base_freq, the linear scaling for the full layers only
    legacy = _hf("gemma3_text", sliding_window=8, sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4,
                 rope_scaling={"rope_type": "linear", "factor": 8.0}, attn_logit_softcapping=None)
    gemma3 = DecoderConfig.from_hf_dict(legacy)
    assert gemma3.layer_windows == (8, 0, 8, 0) and gemma3.qk_norm and gemma3.rope_local_theta == 1e4
    assert gemma3.rope_type == "linear" and gemma3.attn_logit_softcapping is None
    assert DecoderConfig.from_hf_dict(gemma3.to_hf_dict()) == gemma3
    with pytest.raises(ValueError, match="sliding_window=-1"):
        DecoderConfig.from_hf_dict(_hf("mistral", sliding_window=-1))


def test_config_json_refusals_name_model_type_and_missing_features():
    with pytest.raises(ValueError, match="model_type='gemma3'.*vision tower.*gemma3_text"):
        DecoderConfig.from_hf_dict(_hf("gemma3"))
    with pytest.raises(ValueError, match="model_type='gemma'.*not implemented"):
        DecoderConfig.from_hf_dict(_hf("gemma"))
    with pytest.raises(ValueError, match="attn_logit_softcapping=5.0 for gemma3_text"):
        DecoderConfig.from_hf_dict(_hf("gemma3_text", attn_logit_softcapping=5.0))
    with pytest.raises(ValueError, match="model_type='phi3'.*supported: .*qwen3.*gemma2.*gemma3_text"):
        DecoderConfig.from_hf_dict(_hf("phi3"))
    with pytest.raises(ValueError, match="hidden_act='gelu'.*llama"):
        DecoderConfig.from_hf_dict(_hf("llama", hidden_act="gelu"))
    with pytest.raises(ValueError, match="sliding_window"):
        tiny_config(layer_types=("sliding_attention", "full_attention"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_num_params_counts_every_tensor(family):
    from jaxrl_hf.models.forward import param_shapes

    config = tiny_config(**FAMILIES[family][0])
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes(config))) == config.num_params()
