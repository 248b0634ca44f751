"""Rollout engines: the native JAX generation engine and its pure sampling functions."""

from jaxrl_hf.rollout.jax_engine import GenerationOutput, JaxGenerationEngine, SamplingParams
from jaxrl_hf.rollout.sampling import process_logits, sample_tokens, top_k_filter, top_p_filter

__all__ = ["GenerationOutput", "JaxGenerationEngine", "SamplingParams", "process_logits", "sample_tokens",
           "top_k_filter", "top_p_filter"]
