"""Mixtral (``model_type: mixtral``) against transformers on tiny random weights: logits with and without a sliding
window, greedy generation token for token, the HF checkpoint (``block_sparse_moe.experts.{e}.w1/w2/w3``) -> params
-> HF round trip, and the config.json fields (transformers' defaults, the refused router noise)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_hf.models import DecoderConfig, load_hf_dir
from _models_helpers import assert_hf_round_trip, assert_logits_match_hf
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=2)


def _hf_model(path, **overrides):
    """A random float32 `MixtralForCausalLM` saved to ``path`` (every tensor perturbed, norms included)."""
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**TINY, **overrides})).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("window", [None, 4], ids=["full", "window_4"])
def test_logits_match_transformers(tmp_path, window):
    hf = _hf_model(tmp_path, sliding_window=window)
    config, params = load_hf_dir(tmp_path)
    assert config.model_type == "mixtral" and config.num_experts == 4 and all(config.moe_layers)
    assert config.moe_intermediate_size == TINY["intermediate_size"] and config.norm_topk_prob and not config.qk_norm
    assert config.sliding_window == window
    ids = np.random.default_rng(0).integers(3, TINY["vocab_size"], (2, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :4] = 0
    assert_logits_match_hf(hf, params, config, ids, mask)


def test_greedy_generation_is_token_identical(tmp_path):
    hf = _hf_model(tmp_path)
    config, params = load_hf_dir(tmp_path)
    prompt = [5, 17, 33, 9, 64]
    out = JaxGenerationEngine(config, params, pad_token_id=0, eos_token_ids=()).generate(
        [prompt], SamplingParams(greedy=True, max_new_tokens=10))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].numpy()
    np.testing.assert_array_equal(out.response_ids[0], ref)


def test_hf_round_trip_is_bit_exact(tmp_path):
    _hf_model(tmp_path / "hf")
    _, original = assert_hf_round_trip(tmp_path, "MixtralForCausalLM")
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in original


def test_config_json_fields_defaults_and_refusals():
    hf = {**TINY, "model_type": "mixtral"}
    config = DecoderConfig.from_hf_dict(hf)
    assert config.rope_theta == 1_000_000.0  # MixtralConfig's default
    out = config.to_hf_dict()
    assert out["architectures"] == ["MixtralForCausalLM"] and out["num_local_experts"] == 4
    assert out["router_jitter_noise"] == 0.0 and "layer_types" not in out
    assert DecoderConfig.from_hf_dict(out) == config
    assert DecoderConfig.from_hf_dict({k: v for k, v in hf.items() if k != "num_local_experts"}).num_experts == 8
    with pytest.raises(ValueError, match="router_jitter_noise=0.01"):
        DecoderConfig.from_hf_dict({**hf, "router_jitter_noise": 0.01})
    with pytest.raises(ValueError, match="model_type='mixtral'"):
        DecoderConfig(**{**{f: getattr(config, f) for f in ("vocab_size", "hidden_size", "intermediate_size",
                                                           "num_hidden_layers", "num_attention_heads",
                                                           "num_key_value_heads", "head_dim")},
                         "model_type": "mixtral", "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": (1,)})
    with pytest.raises(ValueError, match="num_experts=4 with model_type='llama'"):
        config.replace(model_type="llama")
