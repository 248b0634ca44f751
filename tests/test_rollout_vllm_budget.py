"""vLLM's memory worked out before it starts (`jaxrl_hf.rollout.vllm_budget`): the footprint against its formula,
the error that names the keys, and the ``max_model_len`` a run's rollouts need (verl's prompt + response)."""

from __future__ import annotations

import numpy as np
import pytest

from _models_helpers import tiny_config
from jaxrl_hf.config import load_config
from jaxrl_hf.rollout.vllm_budget import (DEFAULT_MAX_BATCHED_TOKENS, GIB, VLLM_ACTIVATION_BYTES_PER_TOKEN,
                                          check_vllm_fits, kv_bytes_per_token, longest_sequence, vllm_footprint)
from jaxrl_hf.rollout.vllm_tp import tp_shard_shapes

CONFIG = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_hidden_layers=3)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_footprint_is_the_formula(tp, dtype):
    itemsize = 4 if dtype == "float32" else 2
    per_token = 2 * 3 * (2 // tp) * 16 * itemsize  # 2 (k, v) x layers x kv heads a rank x head_dim x itemsize
    assert kv_bytes_per_token(CONFIG, tp, dtype) == per_token
    weights = sum(int(np.prod(s)) for s in tp_shard_shapes(CONFIG, tp).values()) * itemsize
    device = 8 * GIB
    fp = vllm_footprint(CONFIG, tp=tp, dtype=dtype, max_model_len=300, share=0.5, device_bytes=device)
    activations = DEFAULT_MAX_BATCHED_TOKENS * VLLM_ACTIVATION_BYTES_PER_TOKEN
    assert (fp.weight_bytes, fp.activation_bytes) == (weights, activations)
    assert fp.kv_cache_bytes == int(0.5 * device) - weights - activations
    assert fp.kv_tokens == fp.kv_cache_bytes // per_token and fp.fits
    sized = vllm_footprint(CONFIG, tp=tp, dtype=dtype, max_model_len=300, kv_cache_gib=0.5, share=0.9,
                           device_bytes=device)  # an explicit cache size wins over the share
    assert sized.kv_cache_bytes == GIB // 2 and "rollout.kv_cache_gib=0.5" in sized.capacity


def test_a_cache_short_of_one_sequence_names_the_keys_and_numbers():
    per_token = kv_bytes_per_token(CONFIG, 1, "float32")
    just = 300 * per_token / GIB
    check_vllm_fits(vllm_footprint(CONFIG, tp=1, dtype="float32", max_model_len=300, kv_cache_gib=just))
    short = vllm_footprint(CONFIG, tp=1, dtype="float32", max_model_len=301, kv_cache_gib=just)
    with pytest.raises(ValueError) as err:
        check_vllm_fits(short)
    text = str(err.value)
    for needle in (f"rollout.kv_cache_gib={just:g}", "= 300 tokens", f"{per_token} bytes a token",
                   "rollout.max_model_len=301", "rollout.gpu_memory_utilization", "placement.generate.tp",
                   "data.max_response_length"):
        assert needle in text, (needle, text)
    gpu = vllm_footprint(CONFIG, tp=1, dtype="float32", max_model_len=300, share=0.01, device_bytes=GIB)
    with pytest.raises(ValueError, match=r"rollout.gpu_memory_utilization=0.01 of 1.00 GiB .* leaves 0.000 GiB = 0 "
                                         r"tokens"):
        check_vllm_fits(gpu)  # the share does not even hold the weights and activations
    with pytest.raises(ValueError, match="give kv_cache_gib"):
        vllm_footprint(CONFIG, tp=1, dtype="float32", max_model_len=1)


def test_longest_sequence_is_verls_prompt_plus_response():
    config = load_config("grpo", overrides=["data.max_prompt_length=100", "data.max_response_length=50",
                                            "data.val_max_prompt_length=120", "rollout.val.response_length=70"])
    assert longest_sequence(config) == 120 + 70
    config = load_config("grpo", overrides=["data.max_prompt_length=100", "data.max_response_length=50",
                                            "data.val_max_prompt_length=80"])
    assert longest_sequence(config) == 100 + max(50, config.rollout.val.response_length)
    multi = load_config("grpo", overrides=["rollout.multi_turn.enable=true"])
    assert longest_sequence(multi) is None  # turns and tool outputs are not bounded by the two limits
