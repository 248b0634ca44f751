"""vLLM (CPU build) serving a tiny random Qwen3-MoE and a tiny random Mixtral after the in-place weight sync: the
per-expert HF tensors fused by vLLM into its expert layout, greedy tokens equal to the native JAX engine's and
log-probs within 1e-4 of our forward, also after a second sync of other weights (which exercises the re-pack of
vLLM's CPU experts, `jaxrl_hf.rollout.vllm_reload.repack_cpu_moe_experts`); a mixed dense/sparse Qwen3-MoE
(``mlp_only_layers``); the refused cases name their keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import random_params, tiny_config
from jaxrl_hf.models import token_log_probs_and_entropy
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams, make_rollout_engine
from jaxrl_hf.rollout.vllm_tp import tp_shard_shapes

PAD, EOS = 0, 2
# vLLM's CPU attention needs head_dim in {32, 64, ...}; its CPU experts a multiple of 32 as moe_intermediate_size
MOE = dict(vocab_size=96, hidden_size=64, head_dim=32, eos_token_ids=(EOS,), max_position_embeddings=128,
           model_type="qwen3_moe", qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           norm_topk_prob=True, mlp_only_layers=(1,), num_hidden_layers=3)
MIXTRAL = dict(vocab_size=96, hidden_size=64, intermediate_size=32, head_dim=32, eos_token_ids=(EOS,),
               max_position_embeddings=128, model_type="mixtral", num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32, norm_topk_prob=True, num_hidden_layers=2)
FAMILIES = {"qwen3_moe": MOE, "mixtral": MIXTRAL}
OPTIONS = {"max_num_seqs": 16, "kv_cache_gib": 0.25}
PROMPTS = [list(map(int, np.random.default_rng(0).integers(3, MOE["vocab_size"], n))) for n in (5, 3, 9, 12)]


@pytest.fixture(scope="module")
def model():
    config = tiny_config(**MOE)
    assert list(config.moe_layers) == [True, False, True]
    return config, jax.tree.map(jnp.asarray, random_params(config, seed=5))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def served(request):
    """``(config, params, engine)`` of one family (one live vLLM engine at a time)."""
    pytest.importorskip("vllm")
    config = tiny_config(**FAMILIES[request.param])
    params = jax.tree.map(jnp.asarray, random_params(config, seed=5))
    eng = make_rollout_engine("vllm", config=config, params=params, pad_token_id=PAD, eos_token_ids=(EOS,),
                              options=OPTIONS)
    yield config, params, eng
    eng.close()


def _native(config, params, prompts, sampling):
    return JaxGenerationEngine(config, params, pad_token_id=PAD, eos_token_ids=(EOS,)).generate(prompts, sampling)


def _rescore(params, config, out):
    """Teacher-forced log softmax(logits) of every response token (our forward, no KV cache)."""
    ids = np.concatenate([out.prompt_ids, out.response_ids], 1)
    mask = np.concatenate([out.prompt_mask, out.response_mask], 1)
    targets = np.concatenate([ids[:, 1:], np.zeros((ids.shape[0], 1), ids.dtype)], 1)
    fn = jax.jit(token_log_probs_and_entropy, static_argnums=1)
    logp, _ = fn(params, config, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(mask))
    return np.asarray(logp)[:, out.prompt_ids.shape[1] - 1:-1] * out.response_mask


def test_greedy_and_logprobs_match_the_native_engine_after_each_sync(served):
    config, params, engine = served
    sp = SamplingParams(greedy=True, max_new_tokens=16)
    first = engine.generate(PROMPTS, sp)
    np.testing.assert_array_equal(first.response_ids, _native(config, params, PROMPTS, sp).response_ids)
    assert np.abs(first.log_probs - _rescore(params, config, first)).max() < 1e-4
    # a second sync of other weights: vLLM's reload copies the new experts in, the re-pack puts them in its layout
    rng = np.random.default_rng(1)
    new = jax.tree.map(lambda x: x + rng.normal(0, 0.05, x.shape).astype(np.float32), params)
    engine.set_params(new)
    try:
        second = engine.generate(PROMPTS, sp)
        np.testing.assert_array_equal(second.response_ids, _native(config, new, PROMPTS, sp).response_ids)
        assert np.abs(second.log_probs - _rescore(new, config, second)).max() < 1e-4
        assert (second.response_ids != first.response_ids).any()  # the new weights change the answer
        sampled = engine.generate(PROMPTS, SamplingParams(temperature=1.0, n=2, max_new_tokens=12, seed=3))
        assert sampled.response_mask.sum() > 40
        assert np.abs(sampled.log_probs - _rescore(new, config, sampled)).max() < 1e-4
    finally:
        engine.set_params(params)


def test_footprint_counts_the_experts(model):
    config, params = model
    shapes = tp_shard_shapes(config, 1)
    assert shapes["model.layers.0.mlp.gate.weight"] == (8, 64)
    assert shapes["model.layers.0.mlp.experts.7.down_proj.weight"] == (64, 32)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, config.intermediate_size)
    assert not any(k.startswith("model.layers.1.mlp.experts") for k in shapes)


def test_refusals_name_the_keys(model):
    pytest.importorskip("vllm")
    config, params = model
    odd = config.replace(moe_intermediate_size=48)
    with pytest.raises(ValueError, match=r"pad each rank's moe_intermediate_size=48 / tensor_parallel_size=1 to a "
                                         r"multiple of 32.*rollout.name=jax"):
        make_rollout_engine("vllm", config=odd, params=None, pad_token_id=PAD, options=OPTIONS)
    windowed = tiny_config(**{**MIXTRAL, "sliding_window": 4})
    with pytest.raises(ValueError, match=r"model_type 'mixtral' with sliding_window=4: vLLM's mixtral model has "
                                         r"no sliding window"):
        make_rollout_engine("vllm", config=windowed, params=None, pad_token_id=PAD, options=OPTIONS)
