"""Routing replay of a mixture-of-experts policy (``actor.router_replay.mode``, verl's names).

The update's forward passes route each token to recorded experts instead of the router's current top-k; the
router's probabilities at those experts still weight them, so the router keeps its gradient
(`jaxrl_hf.models.moe.route`). ``R2`` records the old-policy forward (``actor.compute_log_prob``): the column
`ROUTED_EXPERTS` ``[rows, P+R, layers, k]`` int32, the experts of every token of every layer (``-1`` in a dense
layer of a mixed model), which the update's micro-batches carry (packed: ``pack_routed_experts``). Across the
mini-batches and epochs of a step the routing then stays π_old's, so the importance ratio compares the same
experts. ``R3`` (the rollout engine's routing) is refused until an engine returns it.
"""

from __future__ import annotations

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.workers.common import WorkerConfigError

ROUTED_EXPERTS = "routed_experts"
"""The batch column of the recorded experts (the name verl and vLLM give them)."""
MODES = ("disabled", "R2", "R3")


def check_router_replay(mode: str, model: DecoderConfig) -> bool:
    """Whether ``mode`` records and replays (R2); a mode this policy or these engines cannot run raises
    `WorkerConfigError` naming ``actor.router_replay.mode``."""
    key = f"config key 'actor.router_replay.mode'={mode!r}"
    if mode not in MODES:
        raise WorkerConfigError(f"{key}: valid: {list(MODES)}")
    if mode == "disabled":
        return False
    if not model.is_moe:
        raise WorkerConfigError(f"{key}: routing replay needs a mixture-of-experts policy; model_type "
                                f"{model.model_type!r} has no MoE layers (set it to 'disabled')")
    if mode == "R3":
        raise WorkerConfigError(f"{key}: R3 replays the rollout engine's routing, which no engine returns here yet "
                                "(the native JAX engine does not record it; vLLM returns routed_experts only with "
                                "its model runner V2, which needs Triton and a GPU); use 'R2' (the old-policy "
                                "forward's routing)")
    return True


__all__ = ["MODES", "ROUTED_EXPERTS", "check_router_replay"]
