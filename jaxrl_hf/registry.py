"""A tiny name -> object registry, the single source of names for every pluggable piece (advantage estimators,
policy losses, KL estimators, rollout loops, sharding rule sets). Dependency-free, so any layer can hold one."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable, Generic, TypeVar

F = TypeVar("F")  # a function, a class, or a declaration such as a sharding rule set


def _describe(entry: Any) -> str:
    """``module.qualname`` of a registered function or class; the type and ``name`` of a data entry."""
    qualname = getattr(entry, "__qualname__", None)
    if qualname is not None:
        return f"{getattr(entry, '__module__', '?')}.{qualname}"
    return f"{type(entry).__name__} {getattr(entry, 'name', '')!s}".strip()


class Registry(Generic[F]):
    """Maps a name (verl's config value, e.g. ``"grpo"``) to an entry (a pure function, a loop class, a rule set),
    plus per-entry metadata.

    ``register(name, **metadata)`` is a decorator; registering a second, different entry under a taken name
    is an error unless ``override=True`` (so a typo cannot silently replace a built-in).

    ``metadata`` (given to the constructor) declares the keys an entry may carry and their defaults, e.g.
    ``Registry("advantage estimator", metadata={"needs": ()})``; ``register`` rejects any other key (a typo
    such as ``need=`` fails at import time) and `info` returns an entry's full metadata.
    """

    def __init__(self, kind: str, metadata: Mapping[str, Any] | None = None) -> None:
        self.kind = kind
        self.metadata_defaults: Mapping[str, Any] = MappingProxyType(dict(metadata or {}))
        self._table: dict[str, F] = {}
        self._info: dict[str, Mapping[str, Any]] = {}

    def register(self, name: str, *, override: bool = False, **metadata: Any) -> Callable[[F], F]:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} name must be a non-empty string, got {name!r}")
        unknown = sorted(set(metadata) - set(self.metadata_defaults))
        if unknown:
            raise TypeError(
                f"{self.kind} {name!r}: unknown registration keyword(s) {unknown}; "
                f"valid: {sorted(self.metadata_defaults)}"
            )
        info = MappingProxyType({**self.metadata_defaults, **metadata})

        def decorator(fn: F) -> F:
            existing = self._table.get(name)
            if existing is not None and not override and (existing is not fn or self._info[name] != info):
                raise ValueError(f"{self.kind} {name!r} is already registered ({_describe(existing)}); "
                                 "pass override=True to replace it")
            self._table[name] = fn
            self._info[name] = info
            return fn

        return decorator

    def get(self, name: str) -> F:
        name = getattr(name, "value", name)  # accept str-valued enums
        try:
            return self._table[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {sorted(self._table)}") from None

    def info(self, name: str) -> Mapping[str, Any]:
        """The metadata ``name`` was registered with (defaults filled in); unknown names raise like `get`."""
        self.get(name)
        return self._info[getattr(name, "value", name)]

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table
