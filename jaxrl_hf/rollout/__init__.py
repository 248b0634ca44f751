"""Rollout engines: the engine contract (`RolloutEngine`, `SamplingParams`, `GenerationOutput`), the native JAX
generation engine, the colocated vLLM engine, and the factory picking one. Rollout loops (what the actor runs on
an engine per ``generate_sequences``) live in `jaxrl_hf.rollout.loops`.

``VllmRolloutEngine`` / ``VllmOptions`` are imported lazily (``jaxrl_hf.rollout.vllm_engine``) so that
importing this package never imports vLLM or torch.
"""

from jaxrl_hf.rollout.base import GenerationOutput, RolloutEngine, SamplingParams
from jaxrl_hf.rollout.factory import ENGINE_NAMES, make_rollout_engine
from jaxrl_hf.rollout.jax_engine import JaxGenerationEngine
from jaxrl_hf.rollout.padding import left_pad_prompts
from jaxrl_hf.rollout.sampling import process_logits, sample_tokens, top_k_filter, top_p_filter

__all__ = ["ENGINE_NAMES", "GenerationOutput", "JaxGenerationEngine", "RolloutEngine", "SamplingParams",
           "VllmOptions", "VllmRolloutEngine", "left_pad_prompts", "make_rollout_engine", "process_logits",
           "sample_tokens", "top_k_filter", "top_p_filter"]


def __getattr__(name: str):
    if name in ("VllmRolloutEngine", "VllmOptions"):
        from jaxrl_hf.rollout import vllm_engine

        return getattr(vllm_engine, name)
    raise AttributeError(f"module 'jaxrl_hf.rollout' has no attribute {name!r}")
