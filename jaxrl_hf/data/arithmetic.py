"""Seeded synthetic arithmetic prompts with known integer answers (data source ``arithmetic``).

An unlimited, verifiable RL task for small models: ``Compute 23 + 19 * 4.`` with ground truth ``99``.
Expressions are built left to right; operands have ``min_digits..max_digits`` digits; division is
always exact (the divisor is drawn from the divisors of the running value); parentheses are written
where the left-to-right order differs from the usual precedence. The same seed gives the same rows.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

from jaxrl_hf.data.schema import make_row

DATA_SOURCE = "arithmetic"
OPERATORS = ("+", "-", "*", "/")
DEFAULT_TEMPLATE = "Compute {expression}. End your reply with the final answer as 'Answer: <number>'."


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    """What to generate. ``operators`` is a subset of ``+ - * /``; ``num_operands`` >= 2."""

    min_digits: int = 1
    max_digits: int = 2
    operators: tuple[str, ...] = ("+", "-", "*")
    num_operands: int = 2
    template: str = DEFAULT_TEMPLATE

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits <= 18:
            raise ValueError(f"arithmetic: need 1 <= min_digits <= max_digits <= 18, got {self.min_digits}, {self.max_digits}")
        bad = [op for op in self.operators if op not in OPERATORS]
        if bad or not self.operators:
            raise ValueError(f"arithmetic: operators {list(self.operators)} invalid; choose from {list(OPERATORS)}")
        if self.num_operands < 2:
            raise ValueError(f"arithmetic: num_operands must be >= 2, got {self.num_operands}")
        if "{expression}" not in self.template:
            raise ValueError("arithmetic: template must contain '{expression}'")


def _operand(rng: random.Random, cfg: ArithmeticConfig) -> int:
    digits = rng.randint(cfg.min_digits, cfg.max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _exact_divisor(rng: random.Random, value: int, cfg: ArithmeticConfig) -> int | None:
    """A divisor of ``value`` with an allowed digit count (not 0; 1 only if nothing else fits)."""
    low = max(2, 10 ** (cfg.min_digits - 1))
    high = 10**cfg.max_digits - 1
    if value == 0:
        return rng.randint(low, high) if low <= high else None
    limit = min(high, abs(value))
    candidates = [d for d in range(low, limit + 1) if value % d == 0] if limit <= 10**6 else []
    return rng.choice(candidates) if candidates else None


def make_expression(rng: random.Random, cfg: ArithmeticConfig) -> tuple[str, int]:
    """(expression text, its integer value) for one problem."""
    value = _operand(rng, cfg)
    text = str(value)
    last_op = None
    for _ in range(cfg.num_operands - 1):
        op = rng.choice(cfg.operators)
        operand = _operand(rng, cfg)
        if op == "/":
            divisor = _exact_divisor(rng, value, cfg)
            if divisor is None:
                op = rng.choice([o for o in cfg.operators if o != "/"] or ["+"])
            else:
                operand = divisor
        if op in "*/" and last_op in ("+", "-"):
            text = f"({text})"
        text = f"{text} {op} {operand}"
        if op == "+":
            value += operand
        elif op == "-":
            value -= operand
        elif op == "*":
            value *= operand
        else:
            value //= operand  # exact: operand divides value
        last_op = op
    return text, value


def generate_arithmetic(n: int, seed: int, config: ArithmeticConfig | None = None, *, split: str = "train",
                        data_source: str = DATA_SOURCE, system_prompt: str | None = None) -> list[dict]:
    """``n`` schema-valid rows, reproducible from ``seed`` (``extra_info`` holds the expression); ``data_source``
    and ``system_prompt`` serve datasets built on this one (``calculator``)."""
    cfg = config or ArithmeticConfig()
    if n < 0:
        raise ValueError(f"arithmetic: n must be >= 0, got {n}")
    rng = random.Random(f"jaxrl_hf.arithmetic:{seed}:{split}")
    rows = []
    for index in range(n):
        expression, value = make_expression(rng, cfg)
        rows.append(
            make_row(
                data_source,
                cfg.template.format(expression=expression),
                str(value),
                extra_info={"split": split, "index": index, "expression": expression},
                system_prompt=system_prompt,
            )
        )
    return rows


def parse_operators(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"+-*"`` or ``["+", "*"]`` -> ``("+", "-", "*")`` (order kept, duplicates dropped)."""
    ops = list(text)
    return tuple(dict.fromkeys(o for o in ops if o.strip() and o != ","))
