"""``make_rollout_engine``: the actor worker's one entry point to a rollout engine (``rollout.name``)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.rollout.base import RolloutEngine
from jaxrl_hf.rollout.jax_engine import JaxGenerationEngine

ENGINE_NAMES = ("jax", "vllm")


def make_rollout_engine(name: str, *, config: DecoderConfig, params: Any, pad_token_id: int,
                        eos_token_ids: Sequence[int] = (), mesh: Any = None, rules: Any = None,
                        model_dir: str | None = None, tokenizer_dir: str | None = None,
                        options: Mapping[str, Any] | None = None, tp_group: Any = None,
                        cpu_backend: str = "auto", record_routing: bool = False) -> RolloutEngine:
    """``'jax'`` -> ``JaxGenerationEngine``; ``'vllm'`` -> ``VllmRolloutEngine`` (both a `RolloutEngine`:
    ``set_params``, ``generate``, ``sleep``, ``engine_name``).

    ``options``: the ``rollout`` config section's vLLM keys (``jaxrl_hf.rollout.vllm_engine.VllmOptions``:
    logprobs_mode, allow_inexact_logprobs, kv_cache_gib, gpu_memory_utilization, max_model_len,
    max_num_seqs, enforce_eager, enable_prefix_caching, tensor_parallel_size, distributed_executor_backend,
    enable_sleep_mode, sleep_level, sleep_after_generate, dtype, seed); unknown keys raise listing the
    valid ones. The JAX engine takes no options (a non-empty mapping raises). ``tp_group``: vLLM with
    ``tensor_parallel_size > 1``, this process's rank (`jaxrl_hf.rollout.vllm_tp.TensorParallelGroup`). ``model_dir`` /
    ``tokenizer_dir`` are only used by vLLM (its config.json; tokenizer files copied along). ``cpu_backend``
    (``model.cpu_backend``): ``off`` runs the native engine with XLA's ops and the scanned layer loop only.
    ``record_routing`` (the native engine, a mixture-of-experts model): keep each token's experts
    (``GenerationOutput.routed_experts``, routing replay R3).
    """
    if name == "jax":
        if tp_group is not None:
            raise ValueError("rollout.name=jax takes no vLLM TP group")
        if options:
            raise ValueError(f"rollout.name=jax takes no vLLM options; got {sorted(options)}")
        off = {"unroll_layers": False, "cpu_kernels": False} if cpu_backend == "off" else {}
        return JaxGenerationEngine(config, params, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
                                   mesh=mesh, rules=rules, record_routing=record_routing, **off)
    if name == "vllm":
        if record_routing:
            raise ValueError("vLLM returns its routing (routed_experts) only with its model runner V2, which needs "
                             "Triton and a GPU; not wired here")
        from jaxrl_hf.rollout.vllm_engine import VllmOptions, VllmRolloutEngine

        opts = VllmOptions.from_mapping(options)  # option errors before the (slow) vLLM import
        return VllmRolloutEngine(config, params, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids, mesh=mesh,
                                 rules=rules, model_dir=model_dir, tokenizer_dir=tokenizer_dir, options=opts,
                                 tp_group=tp_group)
    raise ValueError(f"rollout.name={name!r}; valid: {list(ENGINE_NAMES)}")
