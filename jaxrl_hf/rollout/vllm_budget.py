"""vLLM's memory on one device, worked out before vLLM starts: its weight shard, its KV cache, one sequence's need.

vLLM sizes its KV cache once, at start:

* on a GPU it takes ``gpu_memory_utilization`` × the device's memory for its weights, its activation peak (the
  profile run) and the cache, so  ``kv_cache = share − weights − activations``;
* on CPU (and wherever ``rollout.kv_cache_gib`` is set) the cache is that many GiB (``kv_cache_memory_bytes``).

A cache that cannot hold one whole sequence of ``max_model_len`` tokens makes vLLM refuse to start, minutes into
the run and in its own option names. `check_vllm_fits` does the same arithmetic first and raises a `ValueError`
naming this project's keys and the numbers:

    kv_bytes_per_token = 2 · layers · (kv_heads / tp) · head_dim · itemsize(rollout dtype)
    weights            = Σ one rank's shard shapes (`jaxrl_hf.rollout.vllm_tp.tp_shard_shapes`) · itemsize
    activations        = `VLLM_ACTIVATION_BYTES_PER_TOKEN` · `DEFAULT_MAX_BATCHED_TOKENS`   (an estimate)

The memory plan (`jaxrl_hf.memory_plan.vllm_rollout`) reports the same `VllmFootprint`. Pure: no vLLM, no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.rollout.vllm_tp import tp_shard_shapes

GIB = 2 ** 30
VLLM_ACTIVATION_BYTES_PER_TOKEN = 64 * 1024
"""vLLM's activation peak per scheduled token (its profile run), for the KV-cache estimate. An estimate, not
measured on a GPU here."""
DEFAULT_MAX_BATCHED_TOKENS = 8192
"""vLLM's default ``max_num_batched_tokens`` with chunked prefill, the tokens its activation peak is sized for."""


@dataclasses.dataclass(frozen=True)
class VllmFootprint:
    """One device's share of a vLLM engine with ``tp`` ranks (module docstring for the formulas)."""

    tp: int
    weight_bytes: int
    activation_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    max_model_len: int
    capacity: str
    """How the cache was sized, in this project's keys (for messages)."""

    @property
    def kv_tokens(self) -> int:
        return max(self.kv_cache_bytes, 0) // self.kv_bytes_per_token

    @property
    def one_sequence_bytes(self) -> int:
        return self.max_model_len * self.kv_bytes_per_token

    @property
    def fits(self) -> bool:
        """The cache holds one whole sequence (vLLM's own start-up condition)."""
        return self.kv_tokens >= self.max_model_len


def kv_bytes_per_token(model: DecoderConfig, tp: int, dtype: str) -> int:
    """Keys and values of one token on one rank: ``2 · layers · kv_heads/tp · head_dim · itemsize``."""
    return 2 * model.num_hidden_layers * (model.num_key_value_heads // tp) * model.head_dim * jnp.dtype(dtype).itemsize


def vllm_footprint(model: DecoderConfig, *, tp: int, dtype: str, max_model_len: int,
                   kv_cache_gib: float | None = None, share: float | None = None,
                   device_bytes: int | None = None) -> VllmFootprint:
    """The footprint with the cache sized by ``kv_cache_gib`` if given, else by ``share`` of ``device_bytes``."""
    itemsize = jnp.dtype(dtype).itemsize
    weights = sum(int(np.prod(s)) for s in tp_shard_shapes(model, tp).values()) * itemsize
    activations = DEFAULT_MAX_BATCHED_TOKENS * VLLM_ACTIVATION_BYTES_PER_TOKEN
    if kv_cache_gib is not None:
        cache, capacity = int(kv_cache_gib * GIB), f"rollout.kv_cache_gib={kv_cache_gib:g}"
    elif share is not None and device_bytes is not None:
        cache = int(share * device_bytes) - weights - activations
        capacity = (f"rollout.gpu_memory_utilization={share:g} of {device_bytes / GIB:.2f} GiB = "
                    f"{share * device_bytes / GIB:.2f} GiB, less vLLM's weight shard {weights / GIB:.2f} GiB and "
                    f"activations {activations / GIB:.2f} GiB")
    else:
        raise ValueError("vllm_footprint: give kv_cache_gib, or share and device_bytes")
    return VllmFootprint(int(tp), int(weights), int(activations), int(cache), kv_bytes_per_token(model, tp, dtype),
                         int(max_model_len), capacity)


def longest_sequence(config: Any) -> int | None:
    """The longest prompt + response a run's single-turn rollouts produce (a resolved `RunConfig`): the longer of
    the training and validation prompt limits plus the longer response length, as verl sets vLLM's
    ``max_model_len``; ``None`` for a multi-turn loop, whose turns and tool outputs the two limits do not bound."""
    rollout, data = config.rollout, config.data
    if rollout.loop not in ("single_turn", "single_turn_agent"):
        return None
    prompt = max(rollout.max_prompt_length or data.max_prompt_length, data.val_max_prompt_length or 0)
    response = max(rollout.response_length or data.max_response_length, rollout.val.response_length or 0)
    return int(prompt + response)


def check_vllm_fits(footprint: VllmFootprint) -> None:
    """Raise a `ValueError` naming the keys and numbers unless vLLM's cache holds one sequence of
    ``max_model_len`` tokens."""
    if footprint.fits:
        return
    f = footprint
    need_gib = f.one_sequence_bytes / GIB
    raise ValueError(
        f"vLLM's KV cache cannot hold one sequence: {f.capacity} leaves {max(f.kv_cache_bytes, 0) / GIB:.3f} GiB "
        f"= {f.kv_tokens} tokens at {f.kv_bytes_per_token} bytes a token per rank (tensor parallel {f.tp}), but "
        f"rollout.max_model_len={f.max_model_len} (default: the longest prompt + response) needs {need_gib:.3f} GiB. "
        f"Raise rollout.kv_cache_gib to at least {need_gib:.3f} (CPU) or rollout.gpu_memory_utilization, raise "
        f"placement.generate.tp, or shorten data.max_prompt_length / data.max_response_length")


__all__ = ["DEFAULT_MAX_BATCHED_TOKENS", "VLLM_ACTIVATION_BYTES_PER_TOKEN", "VllmFootprint", "check_vllm_fits",
           "kv_bytes_per_token", "longest_sequence", "vllm_footprint"]
