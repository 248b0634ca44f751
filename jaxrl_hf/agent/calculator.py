"""The built-in ``calculator`` tool: exact arithmetic over Python's ``ast``, never ``eval``.

Accepted: integer and decimal literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses. Anything else
(names, calls, attributes, strings, comparisons...) is refused. Every intermediate value is bounded
(|x| < 10**`MAX_DIGITS`), and a power is refused *before* it is computed when its result would exceed that
bound, so ``9**9**9`` costs microseconds; the expression text and its node count are bounded too.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from jaxrl_hf.agent.tools import ToolError, function_schema, register_tool

MAX_DIGITS = 100
MAX_CHARS = 500
MAX_NODES = 200
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_LIMIT = 10 ** MAX_DIGITS


def _bounded(value: int | float) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not a finite number")
    if abs(value) >= _LIMIT:
        raise ToolError(f"result has more than {MAX_DIGITS} digits")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    """``base ** exponent``, refused when the result would leave the bound (checked on logarithms first)."""
    if base == 0 and exponent < 0:
        raise ToolError("zero to a negative power")
    if isinstance(exponent, float) and not exponent.is_integer() and base < 0:
        raise ToolError("negative base to a fractional power")
    if abs(base) not in (0, 1) and abs(exponent) * math.log10(abs(base)) >= MAX_DIGITS:
        raise ToolError(f"power result has more than {MAX_DIGITS} digits")
    if abs(exponent) >= 10 * MAX_DIGITS and abs(base) not in (0, 1):  # tiny results: |base| < 1 or exponent < 0
        raise ToolError("exponent too large")
    return base ** exponent


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _bounded(_power(left, right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ToolError(f"unsupported syntax {type(node).__name__!s}: only numbers, + - * / // % ** and parentheses")


def format_number(value: int | float) -> str:
    """Integers exactly; floats integral -> an integer, else up to 12 significant digits."""
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.12g}"
    return str(value)


def evaluate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text; `ToolError` for anything invalid or too large."""
    if not isinstance(expression, str) or not expression.strip():
        raise ToolError("'expression' must be a non-empty string")
    if len(expression) > MAX_CHARS:
        raise ToolError(f"expression longer than {MAX_CHARS} characters")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise ToolError(f"cannot parse {expression!r}: {err.msg}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ToolError(f"expression has more than {MAX_NODES} syntax nodes")
    return format_number(_eval(tree))


@register_tool("calculator")
class Calculator:
    """Evaluates one arithmetic expression (argument ``expression``)."""

    name = "calculator"
    schema = function_schema(
        "calculator", "Evaluate an arithmetic expression exactly. Supports + - * / // % ** and parentheses.",
        {"expression": {"type": "string", "description": "The expression, e.g. '(1234 + 56) * 789'."}},
        ["expression"])

    def execute(self, arguments: dict) -> str:
        if "expression" not in arguments:
            raise ToolError(f"calculator needs an 'expression' argument, got keys {sorted(arguments)}")
        return evaluate(arguments["expression"])
