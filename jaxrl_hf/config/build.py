"""Nested dicts -> typed config dataclasses, with type coercion and errors naming the bad key.

Every value is checked against its field's type hint (``int``, ``float``, ``bool``, ``str``, ``Optional``,
``Literal`` choices, ``list[...]``, ``dict``, nested dataclasses). Strings from the command line are
coerced (``"1e-6"`` -> 1e-6 for a float field, ``"true"`` -> True, ``"[a,b]"`` -> a list); anything that
does not fit raises ``ConfigError`` with the dotted key, the value, and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union

import yaml

from jaxrl_hf.config.verl_key_tables import VALUE_ALTERNATIVES


class ConfigError(ValueError):
    """A configuration problem; the message names the dotted key and what is valid."""


@functools.lru_cache(maxsize=None)
def field_types(cls: type) -> dict[str, Any]:
    """``{field name: resolved type hint}`` of a config dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def valid_keys(cls: type) -> list[str]:
    """Field names of a config dataclass, in declaration order."""
    return list(field_types(cls))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return f"one of {list(typing.get_args(tp))}"
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _parse_text(value: str) -> Any:
    """YAML-parse a command-line string (``"[1, 2]"``, ``"null"``, ``"true"``); fall back to the raw string."""
    try:
        return yaml.safe_load(value)
    except yaml.YAMLError:
        return value


def coerce(value: Any, tp: Any, path: str) -> Any:
    """``value`` converted to type ``tp`` or a ``ConfigError`` naming ``path``."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, str):
            value = _parse_text(value)
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{path}' is a section; expected a mapping, got {value!r}")
        return build_dataclass(tp, value, path)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.strip().lower() in ("null", "none", "~")):
            if type(None) in args:
                return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"config key '{path}': {value!r} is not {_describe(tp)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return value
        if isinstance(value, str):
            parsed = _parse_text(value)
            if parsed in choices:
                return parsed
        hint = VALUE_ALTERNATIVES.get(path, {}).get(value)
        raise ConfigError(f"config key '{path}': {value!r} is not one of {list(choices)}" + (f"; {hint}" if hint else ""))
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            parsed = _parse_text(value)
            value = parsed if isinstance(parsed, list) else [value]
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise ConfigError(f"config key '{path}': expected {_describe(tp)}, got {value!r}")
        return [coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if isinstance(value, str):
            value = _parse_text(value)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{path}': expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false", "yes", "no", "on", "off", "1", "0"):
            return value.strip().lower() in ("true", "yes", "on", "1")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"config key '{path}': expected a bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{path}': expected an int, got the bool {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value.replace("_", ""))
            except ValueError:
                number = None
            if number is not None and number.is_integer():
                return int(number)
        raise ConfigError(f"config key '{path}': expected an int, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{path}': expected a number, got the bool {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{path}': expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{path}': expected a string, got {value!r}")
    raise ConfigError(f"config key '{path}': unsupported field type {tp!r}")  # a schema bug


def build_dataclass(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Instantiate config dataclass ``cls`` from ``data``; unknown keys raise listing the valid ones."""
    types_ = field_types(cls)
    unknown = [k for k in data if k not in types_]
    if unknown:
        bad = ", ".join(repr(_join(path, str(k))) for k in unknown)
        raise ConfigError(f"unknown config key {bad} — {path or 'top level'}: unknown key(s) {unknown}; "
                          f"valid: {list(types_)}")
    kwargs = {key: coerce(value, types_[key], _join(path, key)) for key, value in data.items()}
    return cls(**kwargs)
