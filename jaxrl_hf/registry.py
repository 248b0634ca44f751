"""A tiny name -> object registry, the single source of names for every pluggable piece (advantage estimators,
policy losses, rollout loops, sharding rule sets). Dependency-free, so any layer can hold one."""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Maps a name (verl's config value, e.g. ``"grpo"``) to a pure function.

    ``register(name)`` is a decorator; registering a second, different function under a taken name is
    an error unless ``override=True`` (so a typo cannot silently replace a built-in).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._table: dict[str, F] = {}

    def register(self, name: str, *, override: bool = False) -> Callable[[F], F]:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            existing = self._table.get(name)
            if existing is not None and existing is not fn and not override:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({existing.__module__}.{existing.__qualname__});"
                    " pass override=True to replace it"
                )
            self._table[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        name = getattr(name, "value", name)  # accept str-valued enums
        try:
            return self._table[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {sorted(self._table)}") from None

    def names(self) -> list[str]:
        return sorted(self._table)

    def __contains__(self, name: object) -> bool:
        return name in self._table
