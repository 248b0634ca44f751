"""Tools an agent rollout can call: the `Tool` protocol, the registry of tool classes by name, and loading
verl's tool config file (``rollout.multi_turn.tool_config_path``).

A tool has a ``name``, an OpenAI function ``schema`` (what the model is told) and ``execute(arguments) -> str``
(the text returned to the model as a tool message). ``execute`` must not raise for a bad call: it returns an
error text instead (`ToolError` raised inside ``execute`` is turned into one by `run_tool`).

verl's tool config (YAML or JSON)::

    tools:
      - class_name: calculator            # a registered name, or an importable "package.module.Class"
        config: {type: native}            # keyword arguments of the class (verl's ``type`` key is ignored)
        tool_schema:                      # optional: overrides the tool's own schema (and so its name)
          type: function
          function: {name: calc, description: ..., parameters: {...}}
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from jaxrl_hf.registry import Registry

TOOLS: Registry[Callable[..., "Tool"]] = Registry("tool")


@runtime_checkable
class Tool(Protocol):
    """What the multi-turn loop needs of a tool."""

    name: str
    schema: dict

    def execute(self, arguments: dict) -> str:
        """The tool's answer to one call, as text (an error text for a bad call; never raises for one)."""
        ...


class ToolError(Exception):
    """A bad call: its message goes back to the model as the tool's answer, prefixed with ``Error:``."""


def register_tool(name: str, *, override: bool = False) -> Callable[[type], type]:
    """Class decorator: make a tool class constructible as ``get_tool(name)`` / ``class_name: name``."""
    return TOOLS.register(name, override=override)


def get_tool(name: str, **config: Any) -> Tool:
    """A fresh instance of the tool registered as ``name`` (keyword ``config`` goes to its constructor)."""
    return TOOLS.get(name)(**config)


def function_schema(name: str, description: str, properties: Mapping[str, Any], required: list[str]) -> dict:
    """An OpenAI function-tool schema (what chat templates render with ``tools=``)."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": dict(properties), "required": list(required)}}}


def run_tool(tool: Tool, arguments: Any) -> tuple[str, bool]:
    """``(text, ok)`` of one call: arguments that are not an object, a `ToolError` or any other exception from
    the tool become an ``Error: ...`` text with ``ok=False`` (the rollout carries on)."""
    if not isinstance(arguments, dict):
        return f"Error: arguments of {tool.name!r} must be a JSON object, got {type(arguments).__name__}", False
    try:
        return str(tool.execute(arguments)), True
    except ToolError as err:
        return f"Error: {err}", False
    except Exception as err:  # a user tool's bug must not end the rollout
        return f"Error: tool {tool.name!r} failed: {type(err).__name__}: {err}", False


class _Renamed:
    """A tool served under the name and schema of its config entry's ``tool_schema``."""

    def __init__(self, tool: Tool, schema: dict) -> None:
        self.tool, self.schema, self.name = tool, schema, schema["function"]["name"]

    def execute(self, arguments: dict) -> str:
        return self.tool.execute(arguments)


def _tool_class(class_name: str, where: str) -> Callable[..., Tool]:
    if class_name in TOOLS:
        return TOOLS.get(class_name)
    module_name, _, attribute = class_name.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{where}: class_name {class_name!r} is neither a registered tool ({TOOLS.names()}) "
                         f"nor an importable 'package.module.Class' ({type(err).__name__}: {err})") from None


def tools_from_config(spec: Mapping[str, Any], source: str = "<tool config>") -> list[Tool]:
    """The tools of a parsed verl tool config (module docstring); errors name ``source`` and the entry."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("tools"), list):
        raise ValueError(f"{source}: expected a mapping with a 'tools' list (verl's tool config format)")
    tools: list[Tool] = []
    for i, entry in enumerate(spec["tools"]):
        where = f"{source}: tools[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("class_name"), str):
            raise ValueError(f"{where}: each entry needs a 'class_name' string, got {entry!r}")
        config = {k: v for k, v in dict(entry.get("config") or {}).items() if k != "type"}
        try:
            tool = _tool_class(entry["class_name"], where)(**config)
        except TypeError as err:
            raise ValueError(f"{where}: config {config} does not fit {entry['class_name']!r}: {err}") from None
        schema = entry.get("tool_schema")
        if schema is not None:
            if not isinstance(schema, Mapping) or not isinstance(schema.get("function", {}).get("name"), str):
                raise ValueError(f"{where}: tool_schema needs function.name (OpenAI function schema)")
            tool = _Renamed(tool, dict(schema))
        if not isinstance(tool, Tool):
            raise ValueError(f"{where}: {entry['class_name']!r} lacks name/schema/execute (jaxrl_hf.agent.Tool)")
        tools.append(tool)
    names = [t.name for t in tools]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"{source}: tool names {duplicated} appear more than once")
    return tools


def load_tool_config(path: str) -> list[Tool]:
    """The tools of the verl tool config file at ``path`` (YAML or JSON)."""
    if not os.path.isfile(path):
        raise ValueError(f"rollout.multi_turn.tool_config_path={path!r}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        spec = json.loads(text)
    else:
        import yaml

        try:
            spec = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML: {err}") from None
    return tools_from_config(spec, source=path)


def default_tools() -> list[Tool]:
    """The tools of a run without a tool config: the built-in ``calculator``."""
    return [get_tool("calculator")]
