"""Tool calls in generated text, in the Qwen/Hermes format the chat templates of tool-calling models use::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 34"}}
    </tool_call>

`parse_tool_calls` returns every call of a turn in order, each either a `ToolCall` or, for a malformed one
(bad JSON, no ``name``, arguments that are not an object, an unclosed tag), a `ToolCallError` whose message is
sent back to the model as the tool's answer (and counted in ``agent/tool_errors``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """A well-formed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A malformed call: ``message`` explains what is wrong (returned to the model)."""

    message: str
    text: str


def _parse_one(body: str) -> ToolCall | ToolCallError:
    text = body.strip()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return ToolCallError(f"tool call is not valid JSON ({err.msg} at character {err.pos})", text)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return ToolCallError('tool call must be a JSON object {"name": ..., "arguments": {...}}', text)
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCallError(f"arguments of {value['name']!r} are a string that is not a JSON object", text)
    if not isinstance(arguments, dict):
        kind = type(arguments).__name__
        return ToolCallError(f"arguments of {value['name']!r} must be a JSON object, got {kind}", text)
    return ToolCall(value["name"], arguments)


def parse_tool_calls(text: str) -> list[ToolCall | ToolCallError]:
    """Every ``<tool_call>...</tool_call>`` block of ``text`` in order (an unclosed last block is an error)."""
    calls: list[ToolCall | ToolCallError] = []
    for match in _BLOCK.finditer(text):
        body, closing = match.group(1), match.group(2)
        if not closing:
            calls.append(ToolCallError(f"unclosed {OPEN} (no {CLOSE})", body.strip()))
        else:
            calls.append(_parse_one(body))
    return calls
