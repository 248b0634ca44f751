"""Bounded parsing of decimal numbers written by a model.

Model text can hold a million-digit "number"; converting that with ``int``/``Decimal`` costs time
and memory, so every conversion here first bounds the digit count and refuses longer strings.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

MAX_NUMBER_CHARS = 64
"""Longest numeric string (digits, sign, separators) that is converted; longer ones do not parse."""

_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)")


def parse_decimal(text: str, *, max_chars: int = MAX_NUMBER_CHARS) -> Decimal | None:
    """Parse ``text`` as a decimal number, or return None.

    Accepts an optional sign, thousands separators (``1,234``), a leading ``$`` and one trailing
    period (``72.``). Strings longer than ``max_chars`` are refused before any conversion, so the
    cost is bounded whatever the model wrote.
    """
    s = text.strip()
    if len(s) > max_chars:
        return None
    s = s.replace(",", "")
    sign = ""
    if s and s[0] in "+-":
        sign, s = s[0], s[1:]
    if s.startswith("$"):
        s = s[1:]
    if s.endswith(".") and not s.endswith(".."):  # sentence-final period: "7.5." -> "7.5"
        s = s[:-1]
    s = sign + s
    if not _PLAIN_NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:  # pragma: no cover - the regex admits only valid literals
        return None


def numbers_equal(a: str, b: str) -> bool:
    """True when both strings parse (``parse_decimal``) to the same value: ``72.00`` == ``72``."""
    x, y = parse_decimal(a), parse_decimal(b)
    return x is not None and y is not None and x == y


def canonical_number(text: str) -> str | None:
    """The canonical spelling of a parsed number (``1,234.50`` -> ``1234.5``), or None."""
    value = parse_decimal(text)
    if value is None:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")
