"""Rollout engines: the native JAX generation engine, the colocated vLLM engine, and the factory picking one.

``VllmRolloutEngine`` / ``VllmOptions`` are imported lazily (``jaxrl_hf.rollout.vllm_engine``) so that
importing this package never imports vLLM or torch.
"""

from jaxrl_hf.rollout.factory import ENGINE_NAMES, make_rollout_engine
from jaxrl_hf.rollout.jax_engine import GenerationOutput, JaxGenerationEngine, SamplingParams, left_pad_prompts
from jaxrl_hf.rollout.sampling import process_logits, sample_tokens, top_k_filter, top_p_filter

__all__ = ["ENGINE_NAMES", "GenerationOutput", "JaxGenerationEngine", "SamplingParams", "VllmOptions",
           "VllmRolloutEngine", "left_pad_prompts", "make_rollout_engine", "process_logits", "sample_tokens",
           "top_k_filter", "top_p_filter"]


def __getattr__(name: str):
    if name in ("VllmRolloutEngine", "VllmOptions"):
        from jaxrl_hf.rollout import vllm_engine

        return getattr(vllm_engine, name)
    raise AttributeError(f"module 'jaxrl_hf.rollout' has no attribute {name!r}")
