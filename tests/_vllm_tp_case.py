"""The shared case of the vLLM TP=2 check: model, weights, prompts and sampling (the worker ranks and the test's
native-engine reference build them from here, so both sides see the same inputs)."""

from __future__ import annotations

import jax
import numpy as np

from _models_helpers import random_params, tiny_config
from jaxrl_hf.rollout import SamplingParams

# vLLM's CPU attention needs head_dim in {32, 64, ...}; 4 heads / 2 kv heads / mlp 128 split over TP 2.
CONFIG = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, head_dim=32, eos_token_ids=(2,),
                     max_position_embeddings=128)
PAD = 0
# a mixed Qwen3-MoE (layer 1 dense): heads, the dense MLP and every expert (64 -> 32 a rank, vLLM's CPU
# experts' alignment) split over TP 2
MOE_CONFIG = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, head_dim=32, eos_token_ids=(2,),
                         max_position_embeddings=128, model_type="qwen3_moe", qk_norm=True, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=(1,),
                         num_hidden_layers=3)
CASES = {"dense": CONFIG, "moe": MOE_CONFIG}
OPTIONS = {"max_num_seqs": 32, "kv_cache_gib": 0.25, "tensor_parallel_size": 2}
SAMPLING = SamplingParams(greedy=True, max_new_tokens=12)


def reference_params(config=CONFIG):
    return random_params(config, seed=5)


def perturbed(scale: float = 0.05, seed: int = 1, config=CONFIG):
    leaves, tree = jax.tree.flatten(reference_params(config))
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(tree, [np.asarray(x) + rng.normal(0, scale, x.shape).astype(np.float32) for x in leaves])


def prompts(seed: int = 0, lengths=(5, 3, 9)):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, CONFIG.vocab_size, n))) for n in lengths]
