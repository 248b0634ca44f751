"""The native JAX engine holds no KV cache between generations: the cache lives inside one compiled
``generate`` program, so after each call the live device arrays are exactly those before it (the params)."""

from __future__ import annotations

import gc

import jax
import numpy as np

from _models_helpers import random_params, tiny_config
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams

CONFIG = tiny_config(vocab_size=61, eos_token_ids=())


def _live():
    gc.collect()
    return {id(a): (a.shape, a.dtype, a.nbytes) for a in jax.live_arrays()}


def test_kv_cache_is_freed_after_each_generation():
    engine = JaxGenerationEngine(CONFIG, jax.tree.map(jax.numpy.asarray, random_params(CONFIG, seed=3)),
                                 pad_token_id=0, eos_token_ids=())
    prompts = [[5, 6, 7, 8], [9, 10]]
    sampling = SamplingParams(n=4, max_new_tokens=24, seed=1)
    baseline = _live()
    for seed in (1, 2):  # the second call reuses the compiled program: still nothing left behind
        out = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=24, seed=seed))
        assert isinstance(out.response_ids, np.ndarray)  # results come back as host arrays
        assert _live() == baseline
    # the cache the call used: [layers, batch bucket, prompt bucket + max_new, kv_heads, head_dim], k and v
    rows = len(prompts) * sampling.n
    cache_shape = (CONFIG.num_hidden_layers, rows, out.prompt_ids.shape[1] + sampling.max_new_tokens,
                   CONFIG.num_key_value_heads, CONFIG.head_dim)
    assert not any(shape == cache_shape for shape, _, _ in _live().values())
    engine.sleep()  # nothing to free: the same interface as vLLM's engine
    assert _live() == baseline
