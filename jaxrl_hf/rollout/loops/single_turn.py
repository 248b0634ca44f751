"""``single_turn`` (alias ``single_turn_agent``, verl's name): one ``generate`` call, ``n`` samples per prompt;
the response is exactly what the model sampled."""

from __future__ import annotations

from jaxrl_hf.rollout.base import RolloutEngine
from jaxrl_hf.rollout.loops.base import (RolloutLoop, RolloutRequest, RolloutResult, engine_routing_columns,
                                         register_rollout_loop, sequence_columns)


@register_rollout_loop("single_turn_agent")
@register_rollout_loop("single_turn")
class SingleTurnLoop(RolloutLoop):
    """Prompt -> response in one engine call (the default ``rollout.loop``)."""

    def run(self, engine: RolloutEngine, request: RolloutRequest) -> RolloutResult:
        out = engine.generate(request.prompt_token_lists(), request.sampling)
        routed = None if out.routed_experts is None else engine_routing_columns(request, out)
        return sequence_columns(request, out.response_ids, out.response_mask, out.log_probs, routed_experts=routed)
