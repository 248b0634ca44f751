"""Shared helpers for the workers tests: a tiny random Llama and synthetic rollout batches."""

from __future__ import annotations

import numpy as np

from jaxrl_hf.models import DecoderConfig

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


def tiny_decoder(**overrides) -> DecoderConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=128,
                tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,), pad_token_id=0)
    base.update(overrides)
    return DecoderConfig(**base)


def rollout_arrays(rows: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0,
                   min_response: int = 1) -> dict[str, np.ndarray]:
    """Left-padded prompts + right-padded responses of varied lengths, with the derived model inputs."""
    rng = np.random.default_rng(seed)
    prompts = np.zeros((rows, prompt_len), np.int32)
    prompt_mask = np.zeros((rows, prompt_len), np.int32)
    responses = np.zeros((rows, response_len), np.int32)
    response_mask = np.zeros((rows, response_len), np.int32)
    for i in range(rows):
        p = int(rng.integers(1, prompt_len + 1))
        r = int(rng.integers(min_response, response_len + 1))
        prompts[i, prompt_len - p:] = rng.integers(3, vocab, p)
        prompt_mask[i, prompt_len - p:] = 1
        responses[i, :r] = rng.integers(3, vocab, r)
        response_mask[i, :r] = 1
    attention_mask = np.concatenate([prompt_mask, response_mask], axis=1)
    position_ids = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0).astype(np.int32)
    return dict(prompts=prompts, prompt_mask=prompt_mask, responses=responses, response_mask=response_mask,
                input_ids=np.concatenate([prompts, responses], axis=1), attention_mask=attention_mask,
                position_ids=position_ids)
