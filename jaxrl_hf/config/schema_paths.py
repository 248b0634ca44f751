"""Dotted config keys against the schema: does ``a.b.c`` name a field, and which are all the keys.

No verl knowledge here (`jaxrl_hf.config.verl_keys` maps verl's spellings onto these keys first).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Sequence
from typing import Any, Union

from jaxrl_hf.config.build import ConfigError, field_types
from jaxrl_hf.config.schema import RunConfig


def section_type(tp: Any) -> Any:
    """The dataclass inside ``Optional[...]`` (or ``tp`` itself)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return tp


def check_path(parts: Sequence[str], source: str) -> bool:
    """Check a dotted key against the schema; returns True when it ends inside a free-form dict field. An unknown
    key raises ``ConfigError`` naming it and listing the valid keys at the level where it left the schema."""
    cls: Any = RunConfig
    source = f"{source}: " if source else ""
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            if typing.get_origin(cls) is dict or cls is dict:
                return True
            parent = ".".join(parts[:depth])
            raise ConfigError(f"{source}config key '{parent}' is a value, not a section; cannot set '{'.'.join(parts)}'")
        types_ = field_types(cls)
        if part not in types_:
            parent = ".".join(parts[:depth])
            where = f"under '{parent}'" if parent else "at the top level"
            raise ConfigError(
                f"{source}unknown config key '{'.'.join(parts)}'; valid keys {where}: {list(types_)}"
            )
        cls = section_type(types_[part])
    return False


def is_schema_key(key: str) -> bool:
    """Whether the dotted ``key`` names a field of the schema (or a key inside a free-form mapping field)."""
    try:
        check_path(tuple(key.split(".")), "key")
    except ConfigError:
        return False
    return True


def is_schema_section(key: str) -> bool:
    """Whether the dotted ``key`` names a section (a nested dataclass) of the schema."""
    cls: Any = RunConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls) or part not in field_types(cls):
            return False
        cls = section_type(field_types(cls)[part])
    return dataclasses.is_dataclass(cls)


def schema_keys(cls: Any = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema (sections expanded, free-form mappings as their own key)."""
    out: list[str] = []
    for name, tp in field_types(cls).items():
        section = section_type(tp)
        if dataclasses.is_dataclass(section):
            out += schema_keys(section, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out
