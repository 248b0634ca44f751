"""Routing replay of a mixture-of-experts policy (``actor.router_replay.mode``, verl's names).

The update's forward passes route each token to recorded experts instead of the router's current top-k; the
router's probabilities at those experts still weight them, so the router keeps its gradient
(`jaxrl_hf.models.moe.route`). ``R2`` records the old-policy forward (``actor.compute_log_prob``): the column
`ROUTED_EXPERTS` ``[rows, P+R, layers, k]`` int32, the experts of every token of every layer (``-1`` in a dense
layer of a mixed model), which the update's micro-batches carry (packed: ``pack_routed_experts``). Across the
mini-batches and epochs of a step the routing then stays π_old's, so the importance ratio compares the same
experts. ``R3`` replays the rollout engine's routing instead, in the old-policy forward and the update: the
native engine records it (`jaxrl_hf.rollout.jax_engine`, ``record_routing``) as the same column, so π_old and π_θ
route every prompt and sampled token as the sampler did and the train-rollout log-prob mismatch loses its
routing part (single-turn loops, one process; vLLM's routing needs its GPU-only model runner V2).
"""

from __future__ import annotations

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.workers.common import WorkerConfigError

ROUTED_EXPERTS = "routed_experts"
"""The batch column of the recorded experts (the name verl and vLLM give them)."""
MODES = ("disabled", "R2", "R3")


def check_router_replay(mode: str, model: DecoderConfig, engine: str, loop: str, processes: int) -> str:
    """``mode`` when it records and replays (``R2`` / ``R3``), ``""`` when disabled; a mode this policy, rollout
    engine (``rollout.name``), loop (``rollout.loop``) or process count cannot run raises `WorkerConfigError` naming
    ``actor.router_replay.mode``."""
    key = f"config key 'actor.router_replay.mode'={mode!r}"
    if mode not in MODES:
        raise WorkerConfigError(f"{key}: valid: {list(MODES)}")
    if mode == "disabled":
        return ""
    if not model.is_moe:
        raise WorkerConfigError(f"{key}: routing replay needs a mixture-of-experts policy; model_type "
                                f"{model.model_type!r} has no MoE layers (set it to 'disabled')")
    if mode == "R3":
        if engine != "jax":
            raise WorkerConfigError(f"{key} with rollout.name={engine!r}: vLLM returns its routing (routed_experts) "
                                    "only with its model runner V2, which needs Triton and a GPU, and that is not "
                                    "wired here; use rollout.name=jax (which records it) or mode 'R2'")
        if loop not in ("single_turn", "single_turn_agent"):
            raise WorkerConfigError(f"{key} with rollout.loop={loop!r}: the rollout's routing is kept for "
                                    "single-turn rollouts only (a tool's tokens are never routed by the engine); "
                                    "use mode 'R2'")
        if processes > 1:
            raise WorkerConfigError(f"{key}: the native engine keeps its routing in one JAX process only "
                                    f"(placement has {processes}); use mode 'R2'")
    return mode


__all__ = ["MODES", "ROUTED_EXPERTS", "check_router_replay"]
