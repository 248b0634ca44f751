"""Rollout loops: what the actor runs on its engine for one ``generate_sequences`` (``rollout.loop``).

`base` holds the seam (`RolloutLoop`, `RolloutRequest`, `RolloutResult`, `sequence_columns`, the registry and
`register_rollout_loop`); each built-in loop is one module that registers itself on import:

* ``single_turn`` / ``single_turn_agent`` (`single_turn`): one ``generate`` call per rollout;
* ``multi_turn`` (`multi_turn`): a tool-calling agent (``rollout.multi_turn``, docs/AGENT.md).

A new loop (e.g. a multi-turn tool-calling agent) subclasses `RolloutLoop`, decorates itself with
``@register_rollout_loop("name")`` and is selected with ``rollout.loop: name`` once its module is imported.
"""

from jaxrl_hf.rollout.loops.base import (ROLLOUT_LOOPS, RolloutLoop, RolloutRequest, RolloutResult,
                                         follow_up_sampling, make_rollout_loop, register_rollout_loop,
                                         sequence_columns)
from jaxrl_hf.rollout.loops.multi_turn import MultiTurnLoop
from jaxrl_hf.rollout.loops.single_turn import SingleTurnLoop  # importing a loop's module registers it

__all__ = ["ROLLOUT_LOOPS", "MultiTurnLoop", "RolloutLoop", "RolloutRequest", "RolloutResult", "SingleTurnLoop", "follow_up_sampling",
           "make_rollout_loop", "register_rollout_loop", "sequence_columns"]
