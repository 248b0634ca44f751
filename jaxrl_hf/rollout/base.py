"""The rollout engine contract: `SamplingParams` in, `GenerationOutput` out, and the `RolloutEngine` protocol
that the native JAX engine and the vLLM engine both implement.

What the actor worker drives (its whole use of an engine):

* ``generate(prompts, sampling)`` — ``sampling.n`` responses per prompt (lists of token ids, unpadded), rows
  interleaved (prompt ``i`` -> rows ``i*n .. i*n+n-1``); called by a rollout loop
  (`jaxrl_hf.rollout.loops`), possibly several times per rollout (multi-turn);
* ``set_params(params)`` — the weight update after every optimizer step (and after a checkpoint load);
* ``sleep()`` — after a rollout: free what only generation needs (vLLM's KV cache; nothing for the JAX engine,
  whose cache lives inside one ``generate`` call). The next ``generate`` / ``set_params`` wakes the engine;
* ``weights_discarded`` — true after a sleep that dropped the weights (vLLM's level 2): the next ``set_params``
  must come before ``generate``;
* ``engine_name``, ``pad_token_id``, ``eos_token_ids`` — what a loop needs to pad and to recognise a stop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from jaxrl_hf.rollout.sampling import LOGPROBS_MODES


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling options. ``temperature == 0`` or ``greedy=True`` means argmax decoding."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    max_new_tokens: int = 128
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0
    logprobs_mode: str = "temperature"

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0 (0 disables), got {self.top_k}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"SamplingParams.logprobs_mode={self.logprobs_mode!r}; valid: {LOGPROBS_MODES}")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0.0


@dataclasses.dataclass
class GenerationOutput:
    """Host (numpy) results for ``B * n`` rows, row ``i`` answering prompt ``i // n``."""

    prompt_ids: np.ndarray       # [B*n, P] int32, left-padded with pad_token_id
    prompt_mask: np.ndarray      # [B*n, P] int32
    response_ids: np.ndarray     # [B*n, max_new] int32, pad_token_id after the stop token
    response_mask: np.ndarray    # [B*n, max_new] int32, 1 up to and including the stop token
    log_probs: np.ndarray        # [B*n, max_new] float32 sampler log-probs, 0 where the mask is 0
    finish_reason: list[str]     # "stop" (hit a stop token) or "length"
    routed_experts: np.ndarray | None = None  # [B*n, P + max_new, layers, k] int32: an MoE engine's routing, if kept

    def rows(self, start: int, stop: int) -> "GenerationOutput":
        """Rows ``start:stop`` (views)."""
        return GenerationOutput(self.prompt_ids[start:stop], self.prompt_mask[start:stop],
                                self.response_ids[start:stop], self.response_mask[start:stop],
                                self.log_probs[start:stop], list(self.finish_reason[start:stop]),
                                None if self.routed_experts is None else self.routed_experts[start:stop])

    @property
    def response_lengths(self) -> np.ndarray:
        return self.response_mask.sum(axis=1)


@runtime_checkable
class RolloutEngine(Protocol):
    """What every rollout engine offers (module docstring); ``isinstance`` checks the names are there."""

    engine_name: str
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    weights_discarded: bool

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = ...) -> GenerationOutput:
        """``sampling.n`` responses per prompt, interleaved; a stop token ends a row and is kept in its mask."""
        ...

    def set_params(self, params: Any) -> None:
        """Serve ``params`` (a flax param tree) from the next ``generate`` on."""
        ...

    def sleep(self) -> None:
        """Free generation-only memory until the next ``generate`` / ``set_params``."""
        ...
