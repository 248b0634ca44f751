"""vLLM (CPU build) serving Qwen3, Gemma 2 / Gemma 3 text (and Qwen2, Mistral: `slow`) after an in-place weight sync, and loading their HF
exports: greedy tokens equal to the native JAX engine's, log-probs within 1e-4 of our teacher-forced forward, the
sliding window in effect. One engine per family (a module-scoped, parametrized fixture: pytest runs a family's
tests together and closes its engine before the next family's starts). The refusal of Qwen2/Qwen3 windows on some
layers only (`jaxrl_hf.models.vllm_support`) needs no vLLM."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from _models_helpers import random_params, tiny_config
from jaxrl_hf.models import token_log_probs_and_entropy
from jaxrl_hf.models.hf_export import write_hf_model_dir
from jaxrl_hf.models.vllm_support import vllm_support_problem
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams, make_rollout_engine

# vLLM's CPU attention needs head_dim in {32, 64, ...}; a window of 6 is crossed by every prompt + response below
BASE = dict(vocab_size=96, hidden_size=64, head_dim=32, eos_token_ids=(2,), max_position_embeddings=128)
GEMMA = dict(hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, sliding_window=6,
             layer_types=("sliding_attention", "full_attention"), query_pre_attn_scalar=24.0)
FAMILIES = {
    # Qwen3-0.6B's layout (tied embeddings, q/k norms), with a window on every layer (the case vLLM's Qwen3 reads)
    "qwen3": dict(model_type="qwen3", qk_norm=True, tie_word_embeddings=True, sliding_window=6),
    # Qwen2.5's layout (QKV bias, no window, head_dim = hidden_size / heads: vLLM's Qwen2 derives it so)
    "qwen2": dict(model_type="qwen2", qkv_bias=True, hidden_size=128),
    "mistral": dict(model_type="mistral", sliding_window=6),
    "gemma2": dict(model_type="gemma2", attn_logit_softcapping=8.0, final_logit_softcapping=10.0, **GEMMA),
    "gemma3_text": dict(model_type="gemma3_text", qk_norm=True, rope_theta=1e6, rope_local_theta=10000.0,
                        rope_scaling=(("factor", 8.0), ("rope_type", "linear")), **GEMMA),
}
PAD, EOS = 0, 2
OPTIONS = {"max_num_seqs": 16, "kv_cache_gib": 0.25}
PROMPTS = [list(map(int, np.random.default_rng(0).integers(3, BASE["vocab_size"], n))) for n in (5, 3, 9, 12)]


DEFAULT_FAMILIES = ("gemma2", "qwen3")
FAMILY_PARAMS = [pytest.param(name, marks=[] if name in DEFAULT_FAMILIES else [pytest.mark.slow])
                 for name in sorted(FAMILIES)]
"""About a minute of CI time per family: Qwen3 and Gemma 2 run by default, the others are `slow`."""


@pytest.fixture(scope="module", params=FAMILY_PARAMS)
def family(request):
    config = tiny_config(**{**BASE, **FAMILIES[request.param]})
    return request.param, config, jax.tree.map(jnp.asarray, random_params(config, seed=5))


@pytest.fixture(scope="module")
def engine(family):
    pytest.importorskip("vllm")
    name, config, params = family
    t0 = time.perf_counter()
    eng = make_rollout_engine("vllm", config=config, params=params, pad_token_id=PAD, eos_token_ids=(EOS,),
                              options=OPTIONS)
    print(f"\n{name}: vLLM engine init {eng.init_s:.1f}s, + first sync {time.perf_counter() - t0:.1f}s")
    yield eng
    eng.close()


def _native(config, params):
    return JaxGenerationEngine(config, params, pad_token_id=PAD, eos_token_ids=(EOS,))


def _rescore(params, config, out, temperature=1.0):
    """Teacher-forced log softmax(logits / T) of every response token (our forward, no KV cache)."""
    ids = np.concatenate([out.prompt_ids, out.response_ids], 1)
    mask = np.concatenate([out.prompt_mask, out.response_mask], 1)
    targets = np.concatenate([ids[:, 1:], np.zeros((ids.shape[0], 1), ids.dtype)], 1)
    fn = jax.jit(token_log_probs_and_entropy, static_argnums=1)
    logp, _ = fn(params, config, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(mask), temperature=temperature)
    return np.asarray(logp)[:, out.prompt_ids.shape[1] - 1:-1] * out.response_mask


def _perturbed(params, seed=1):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: x + rng.normal(0, 0.05, x.shape).astype(np.float32), params)


def test_greedy_matches_native_engine_and_the_window_is_in_effect(family, engine):
    name, config, params = family
    sp = SamplingParams(greedy=True, max_new_tokens=16)
    ours, ref = engine.generate(PROMPTS, sp), _native(config, params).generate(PROMPTS, sp)
    np.testing.assert_array_equal(ours.response_ids, ref.response_ids)
    np.testing.assert_array_equal(ours.response_mask, ref.response_mask)
    forward = _rescore(params, config, ours)
    assert np.abs(ours.log_probs - forward).max() < 1e-4
    if config.layer_windows is not None:  # the same forward with no window scores these tokens differently
        unwindowed = config.replace(sliding_window=None, layer_types=(), rope_local_theta=None)
        assert np.abs(ours.log_probs - _rescore(params, unwindowed, ours)).max() > 1e-2, name


def test_sampled_logprobs_match_forward(family, engine):
    _, config, params = family
    out = engine.generate(PROMPTS, SamplingParams(temperature=1.0, n=2, max_new_tokens=12, seed=3))
    assert out.response_mask.sum() > 40
    assert np.abs(out.log_probs - _rescore(params, config, out)).max() < 1e-4


def test_weight_sync_serves_the_new_weights(family, engine):
    _, config, params = family
    new = _perturbed(params)
    sp = SamplingParams(greedy=True, max_new_tokens=12)
    engine.set_params(new)
    try:
        ours, ref = engine.generate(PROMPTS, sp), _native(config, new).generate(PROMPTS, sp)
        np.testing.assert_array_equal(ours.response_ids, ref.response_ids)
        assert np.abs(ours.log_probs - _rescore(new, config, ours)).max() < 1e-4
        before = _native(config, params).generate(PROMPTS, sp)
        assert (before.response_ids != ours.response_ids).any()  # the perturbation changes the answer
    finally:
        engine.set_params(params)


def test_export_loads_in_transformers_and_vllm_with_greedy_identical_output(family, engine, tmp_path):
    """The bf16 HF export (`write_hf_model_dir`, what launch/export_hf.py writes) read back by transformers and by
    vLLM from disk; both decode greedily as the native engine on the same bf16-rounded weights. Closes the family's
    engine first (one in-process vLLM engine at a time); runs last for that reason."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    name, config, params = family
    engine.close()
    out = write_hf_model_dir(tmp_path / "hf", jax.device_get(params), config, dtype="bfloat16")
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32), params)
    sp = SamplingParams(greedy=True, max_new_tokens=12)
    ref = _native(config, rounded).generate(PROMPTS, sp)
    expected = [ref.response_ids[r, :ref.response_mask[r].sum()].tolist() for r in range(len(PROMPTS))]

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    for prompt, want in zip(PROMPTS, expected):
        with torch.no_grad():
            seq = hf.eval().generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, pad_token_id=PAD,
                                     eos_token_id=EOS)
        assert seq[0, len(prompt):].tolist() == want, (name, "transformers", prompt)

    from jaxrl_hf.rollout.vllm_engine import import_vllm

    vllm = import_vllm()
    llm = vllm.LLM(model=out, dtype="float32", skip_tokenizer_init=True, max_model_len=64, max_num_seqs=4,
                   enforce_eager=True, kv_cache_memory_bytes=1 << 26, generation_config="vllm")
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            vllm.SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[EOS],
                                                detokenize=False), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected, (name, "vLLM")
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_windows_on_some_qwen_layers_are_refused_before_vllm_starts():
    mixed = tiny_config(**BASE, model_type="qwen3", qk_norm=True, sliding_window=6,
                        layer_types=("full_attention", "sliding_attention"))
    assert "ignores layer_types" in vllm_support_problem(mixed)
    for family_overrides in FAMILIES.values():
        assert vllm_support_problem(tiny_config(**{**BASE, **family_overrides})) is None
    odd_head_dim = tiny_config(**BASE, model_type="qwen2", qkv_bias=True)  # hidden 64 = 4 heads x 16, head_dim 32
    assert "ignores config.json head_dim" in vllm_support_problem(odd_head_dim)
    with pytest.raises(ValueError, match=r"rollout.name=vllm: model_type 'qwen3' with sliding_window=6 on layers "
                                         r"\[1\] only"):
        make_rollout_engine("vllm", config=mixed, params=None, pad_token_id=PAD, options=OPTIONS)
