"""The ``rollout`` section (verl's ``actor_rollout_ref.rollout``) and its validation sampling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional


@dataclass
class RolloutValConfig:
    """Sampling for validation (verl ``val_kwargs``)."""

    n: int = 4
    temperature: float = 1.0
    top_p: float = 0.7
    greedy: bool = False
    """DAPO's evaluation: T=1.0, top-p 0.7, avg@k (here mean@4) — it tracks the sampling policy RL trains."""
    response_length: Optional[int] = 96
    """Longer than training's so GSM8K answers fit (null: ``rollout.response_length``)."""


@dataclass
class MultiTurnConfig:
    """Multi-turn tool-calling rollouts (verl ``actor_rollout_ref.rollout.multi_turn``; docs/AGENT.md)."""

    enable: bool = False
    """Run the ``multi_turn`` loop (set ``rollout.loop`` to it unless another loop is named)."""
    max_assistant_turns: Optional[int] = 4
    """Model turns per rollout (null: until no tool call or the response length is spent)."""
    tool_config_path: Optional[str] = None
    """verl's tool config file (YAML/JSON ``tools:`` list); null: the built-in ``calculator``."""
    max_parallel_calls: int = 1
    """Tool calls executed per turn (later ones in the same turn are ignored)."""
    max_user_turns: Optional[int] = None
    """Tool-answer rounds per rollout (verl's user turns; null: bounded by ``max_assistant_turns`` only)."""
    max_tool_response_length: int = 256
    """Characters of a tool's answer kept."""
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    """Which part of a longer answer is kept: ``left`` its head, ``right`` its tail, ``middle`` both ends (verl)."""
    format: str = "hermes"
    """Tool-call format: ``hermes`` (Qwen's ``<tool_call>{json}</tool_call>``), the only one."""


@dataclass
class RolloutConfig:
    """Generation (verl ``actor_rollout_ref.rollout``)."""

    name: Literal["jax", "vllm"] = "jax"
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    max_prompt_length: Optional[int] = None
    """Default: ``data.max_prompt_length``."""
    response_length: Optional[int] = None
    """Default: ``data.max_response_length``."""
    seed: int = 0
    """Sampling seed (per step, call and dp rank; with ``name=vllm`` also vLLM's engine seed)."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """``compute_log_prob`` micro-batches by tokens (default: ``actor.use_dynamic_bsz``)."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Its token budget per device (default: ``actor.ppo_max_token_len_per_gpu``)."""
    loop: str = "single_turn"
    """Rollout loop run on the engine per rollout (``jaxrl_hf.rollout.loops``): ``single_turn`` (alias
    ``single_turn_agent``) or any loop registered with ``register_rollout_loop``."""
    val: RolloutValConfig = field(default_factory=RolloutValConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # vLLM engine options (``name=vllm`` only; null = the engine's default, see
    # ``jaxrl_hf.rollout.vllm_engine.VllmOptions``). verl's names where it has them.
    tensor_parallel_size: Optional[int] = None
    """vLLM's TP size (the vLLM option's spelling of ``placement.generate.tp`` = verl's
    ``rollout.tensor_model_parallel_size``; both set must agree): one TP rank per actor process
    (`jaxrl_hf.rollout.vllm_tp`)."""
    gpu_memory_utilization: Optional[float] = None
    """GPU share for vLLM's weights + KV cache (GPU only; default 0.5)."""
    kv_cache_gib: Optional[float] = None
    """vLLM KV cache size in GiB (CPU default 1)."""
    max_model_len: Optional[int] = None
    max_num_seqs: Optional[int] = None
    enforce_eager: Optional[bool] = None
    """No torch.compile / CUDA graphs (default true: faster start)."""
    enable_prefix_caching: Optional[bool] = None
    enable_sleep_mode: Optional[bool] = None
    """Free vLLM's KV cache between rollouts (default: on where supported, i.e. CUDA; CPU cannot)."""
    sleep_level: Optional[int] = None
    """vLLM's sleep level on a GPU: 2 (default; weights discarded and re-fed by the next sync) or 1 (kept on host)."""
    sleep_after_generate: Optional[bool] = None
    logprobs_mode: Optional[str] = None
    """vLLM log-prob mode: ``processed_logprobs`` (default) or ``raw_logprobs``."""
    allow_inexact_logprobs: Optional[bool] = None
    dtype: Optional[str] = None
    """vLLM compute dtype (default: ``model.dtype``)."""
    distributed_executor_backend: Optional[str] = None
