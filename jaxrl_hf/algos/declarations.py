"""What a registered estimator or loss declares: the batch inputs it ``needs`` and the keyword parameters its
signature names. Used by the ``register_*`` decorators (checked once, at import time) and by the code that
calls a registered function by name (it passes the declared inputs, and config values the signature names)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from jaxrl_hf.registry import Registry

F = TypeVar("F", bound=Callable)


def needed_inputs(owner: str, needs: object) -> tuple[str, ...]:
    """``needs`` as a tuple of input names; a bare string or a non-string entry is an error naming ``owner``."""
    if isinstance(needs, str) or not isinstance(needs, Sequence) or not all(isinstance(n, str) and n for n in needs):
        raise TypeError(f"{owner}: needs= must be a tuple of input names, e.g. needs=('index',); got {needs!r}")
    return tuple(needs)


def keyword_parameters(fn: Callable) -> tuple[str, ...]:
    """Names ``fn`` accepts as keyword arguments (its ``**kwargs`` catch-all excluded)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds)


def signature_inputs(fn: Callable, known: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The ``known`` input names ``fn``'s signature names: (those without a default, those with one). How a function
    written for verl (``def adv(token_level_rewards, response_mask, index, config=None)``) says what it takes
    without a ``needs=`` declaration."""
    params = inspect.signature(fn).parameters
    named = [n for n in known if n in params and params[n].kind is not inspect.Parameter.VAR_KEYWORD]
    required = tuple(n for n in named if params[n].default is inspect.Parameter.empty)
    return required, tuple(n for n in named if n not in required)


def required_keywords(fn: Callable, given: Sequence[str]) -> tuple[str, ...]:
    """Parameters of ``fn`` without a default that are not among ``given`` (what a caller passing ``given`` would
    leave missing)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(p.name for p in inspect.signature(fn).parameters.values()
                 if p.kind in kinds and p.default is inspect.Parameter.empty and p.name not in given)


def check_accepts(owner: str, fn: Callable, needs: Sequence[str]) -> None:
    """Every needed input must be a parameter of ``fn`` (or ``fn`` takes ``**kwargs``)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    missing = [n for n in needs if n not in keyword_parameters(fn)]
    if missing:
        raise TypeError(f"{owner}: declares needs={tuple(needs)} but {fn.__name__}() has no parameter(s) {missing}")


def register_declared(registry: Registry[F], name: str, override: bool,
                      metadata: Mapping[str, Any]) -> Callable[[F], F]:
    """``registry.register(name, **metadata)`` with ``needs`` normalised and checked against the function."""
    owner = f"{registry.kind} {name!r}"
    metadata = dict(metadata)
    if "needs" in metadata:
        metadata["needs"] = needed_inputs(owner, metadata["needs"])
    register = registry.register(name, override=override, **metadata)

    def decorator(fn: F) -> F:
        check_accepts(owner, fn, metadata.get("needs", ()))
        return register(fn)

    return decorator
