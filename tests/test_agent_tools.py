"""Agent tools: the safe calculator (values against Python's integer arithmetic, hostile inputs refused fast),
the Hermes tool-call parser, the tool registry and verl's tool config file."""

from __future__ import annotations

import json
import random
import time

import pytest

from jaxrl_hf.agent import (TOOLS, ToolCall, ToolCallError, ToolError, get_tool, load_tool_config, parse_tool_calls,
                            register_tool, run_tool, tools_from_config)
from jaxrl_hf.agent.calculator import MAX_DIGITS, evaluate


# ------------------------------------------------------------------------------------------ calculator
@pytest.mark.parametrize("expression, want", [
    ("48213 * 9271", str(48213 * 9271)), ("123456 + 654321", "777777"), ("(1 + 2) * -3", "-9"),
    ("2 ** 10", "1024"), ("7 // 2", "3"), ("-7 % 3", "2"), ("10 / 4", "2.5"), ("10 / 2", "5"), ("1.5 * 4", "6"),
    ("2 ^ 8", "256"), ("  - (3 - 5) ", "2"), ("2 ** -1", "0.5"), ("1/3", "0.333333333333"),
    ("999999 * 999999 * 999999", str(999999 ** 3)),
])
def test_calculator_values(expression, want):
    assert evaluate(expression) == want


def test_calculator_matches_python_integers_on_random_multi_digit_problems():
    rng = random.Random(0)
    for _ in range(200):
        a, b, c = (rng.randint(1000, 999999) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        text = f"{a} {op1} ({b} {op2} {c})"
        inner = {"+": b + c, "-": b - c, "*": b * c}[op2]
        assert evaluate(text) == str({"+": a + inner, "-": a - inner, "*": a * inner}[op1]), text


@pytest.mark.parametrize("expression, message", [
    ("9**9**9", "more than 100 digits"), ("10**10**10", "more than 100 digits"), ("(10**99)*(10**99)", "more than 100 digits"),
    ("2.0 ** 100000", "more than 100 digits"), ("0.5 ** 10**6", "exponent too large"), ("1/0", "division by zero"),
    ("5 % 0", "division by zero"), ("0 ** -1", "zero to a negative power"), ("(-8) ** 0.5", "fractional power"),
    ("__import__('os').system('id')", "unsupported syntax Call"), ("x + 1", "unsupported syntax Name"),
    ("(1).__class__", "unsupported syntax Attribute"), ("'a' * 3", "unsupported syntax Constant"),
    ("lambda: 1", "unsupported syntax Lambda"), ("[1, 2]", "unsupported syntax List"), ("1 < 2", "unsupported syntax Compare"),
    ("True + 1", "unsupported syntax Constant"), ("1 +", "cannot parse"), ("", "non-empty"),
    ("1+" * 300 + "1", "longer than 500"), ("-" * 250 + "1", "more than 200 syntax nodes"),
])
def test_calculator_refuses_hostile_or_invalid_input_quickly(expression, message):
    start = time.perf_counter()
    with pytest.raises(ToolError, match=message):
        evaluate(expression)
    assert time.perf_counter() - start < 0.1
    text, ok = run_tool(get_tool("calculator"), {"expression": expression})
    assert not ok and text.startswith("Error: ")


def test_calculator_result_bound_is_the_documented_one():
    assert evaluate(f"10 ** {MAX_DIGITS - 1}") == "1" + "0" * (MAX_DIGITS - 1)
    with pytest.raises(ToolError):
        evaluate(f"10 ** {MAX_DIGITS}")


# ------------------------------------------------------------------------------------------ parser
def test_parser_well_formed_and_several_calls():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>\n'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call> done')
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2*3"}),
                                      ToolCall("python", {"code": "print(1)"})]
    assert parse_tool_calls("no calls here") == []
    assert parse_tool_calls('<tool_call>{"name": "f"}</tool_call>') == [ToolCall("f", {})]


@pytest.mark.parametrize("body, message", [
    ('{"name": "calculator", "arguments": {"expression": }', "not valid JSON"),
    ("[1, 2]", "must be a JSON object"), ('{"arguments": {}}', "must be a JSON object"),
    ('{"name": "f", "arguments": [1]}', "must be a JSON object, got list"),
    ('{"name": "f", "arguments": "not json"}', "string that is not a JSON object"),
])
def test_parser_malformed_calls_become_errors(body, message):
    calls = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert len(calls) == 1 and isinstance(calls[0], ToolCallError) and message in calls[0].message


def test_parser_unclosed_tag_and_mixed_calls():
    calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"')
    assert calls[0] == ToolCall("a", {}) and isinstance(calls[1], ToolCallError) and "unclosed" in calls[1].message


# ------------------------------------------------------------------------------------------ registry and config
def test_registry_and_user_tools():
    assert {"calculator", "python"} <= set(TOOLS.names())
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        get_tool("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_tool("calculator")(type("Other", (), {}))

    @register_tool("test_echo_tool")
    class Echo:
        name = "echo"
        schema = {"type": "function", "function": {"name": "echo"}}

        def __init__(self, prefix: str = ""):
            self.prefix = prefix

        def execute(self, arguments):
            if "boom" in arguments:
                raise RuntimeError("exploded")
            return self.prefix + json.dumps(arguments)

    echo = get_tool("test_echo_tool", prefix=">")
    assert run_tool(echo, {"a": 1}) == ('>{"a": 1}', True)
    assert run_tool(echo, {"boom": 1}) == ("Error: tool 'echo' failed: RuntimeError: exploded", False)
    assert run_tool(echo, [1]) == ("Error: arguments of 'echo' must be a JSON object, got list", False)


def test_verl_tool_config_file(tmp_path):
    path = tmp_path / "tool_config.yaml"
    path.write_text("""tools:
  - class_name: calculator
    config: {type: native}
    tool_schema:
      type: function
      function:
        name: calc
        description: exact arithmetic
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
  - class_name: jaxrl_hf.agent.python_sandbox.PythonSandbox
    config: {type: native, cpu_time_s: 1, max_output_chars: 100}
""")
    calc, python = load_tool_config(str(path))
    assert calc.name == "calc" and calc.schema["function"]["description"] == "exact arithmetic"
    assert calc.execute({"expression": "6*7"}) == "42"
    assert python.name == "python" and python.cpu_time_s == 1 and python.max_output_chars == 100
    json_path = tmp_path / "tools.json"
    json_path.write_text(json.dumps({"tools": [{"class_name": "calculator"}]}))
    assert [t.name for t in load_tool_config(str(json_path))] == ["calculator"]


@pytest.mark.parametrize("spec, message", [
    ({"tool": []}, "a mapping with a 'tools' list"),
    ({"tools": [{"config": {}}]}, r"tools\[0\]: each entry needs a 'class_name'"),
    ({"tools": [{"class_name": "no.such.Tool"}]}, r"tools\[0\]: class_name 'no.such.Tool' is neither"),
    ({"tools": [{"class_name": "calculator", "config": {"bogus": 1}}]}, r"tools\[0\]: config \{'bogus': 1\} does not fit"),
    ({"tools": [{"class_name": "calculator", "tool_schema": {"type": "function"}}]}, "tool_schema needs function.name"),
    ({"tools": [{"class_name": "calculator"}, {"class_name": "calculator"}]}, r"tool names \['calculator'\] appear more"),
    ({"tools": [{"class_name": "json.JSONDecoder"}]}, "lacks name/schema/execute"),
])
def test_tool_config_errors_name_the_entry(spec, message):
    with pytest.raises(ValueError, match=message):
        tools_from_config(spec, source="cfg.yaml")


def test_tool_config_file_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_tool_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_tool_config(str(bad))
