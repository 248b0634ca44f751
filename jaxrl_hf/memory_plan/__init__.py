"""Ahead-of-time memory plans of the actor's compiled programs (`plan_memory`; CLI: launch/plan_memory.py).

Modules, one concern each:
  verl_keys   verl's command-line keys sorted into applied / mapped / ignored / not modelled / typos
  programs    update_actor, log_prob and generate lowered and compiled on abstract, sharded arrays
  cost_model  the placement cost model's prediction for the same sizes
  report      XLA's memory analysis, collective counts, the readable table
  plan        plan_memory: config in, JSON-able report out
"""

from jaxrl_hf.memory_plan.plan import DEFAULT_DEVICE_MEMORY, load_plan_config, parse_bytes, plan_memory
from jaxrl_hf.memory_plan.report import format_table
from jaxrl_hf.memory_plan.verl_keys import PlanKeys, classify_keys

__all__ = ["DEFAULT_DEVICE_MEMORY", "PlanKeys", "classify_keys", "format_table", "load_plan_config", "parse_bytes",
           "plan_memory"]
