"""Agent tools for multi-turn rollouts (`jaxrl_hf.rollout.loops.multi_turn`): the `Tool` protocol and registry
(`tools`), the built-in ``calculator`` (`calculator`) and ``python`` sandbox (`python_sandbox`), and the
Qwen/Hermes tool-call parser (`parser`). Layer: beside ``rollout``; imports only ``jaxrl_hf.registry``."""

from jaxrl_hf.agent import calculator, python_sandbox  # noqa: F401  (the built-in tools register themselves)
from jaxrl_hf.agent.parser import ToolCall, ToolCallError, parse_tool_calls
from jaxrl_hf.agent.tools import (TOOLS, Tool, ToolError, default_tools, function_schema, get_tool, load_tool_config,
                                  register_tool, run_tool, tools_from_config)

__all__ = ["TOOLS", "Tool", "ToolCall", "ToolCallError", "ToolError", "default_tools", "function_schema", "get_tool",
           "load_tool_config", "parse_tool_calls", "register_tool", "run_tool", "tools_from_config"]
