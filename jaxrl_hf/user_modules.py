"""Import the user's own code before anything looks a name up: ``launch/train.py --import FILE_OR_MODULE`` and the
run config's ``imports`` list. A module that registers a function at import time (``@register_adv_estimator``,
``@register_policy_loss`` ...) makes its name valid in the config like a built-in's, in the driver (before the
config is validated) and in every worker process (before any worker is constructed). Dependency-free.

A spec is a path to a ``.py`` file (made absolute, since worker processes may run elsewhere) or a dotted module
name importable from ``sys.path`` / ``PYTHONPATH``. Importing is idempotent: a file is always loaded under the
same module name (derived from its absolute path), so importing it again in the same process is a no-op and
the registrations it makes run once per process.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, TypeVar

T = TypeVar("T")


class UserModuleError(ImportError):
    """A user module named with ``--import`` / ``imports`` could not be imported; the message names it."""


class UserCodeError(RuntimeError):
    """An exception raised inside the user's own code (a function registered from an imported module): the message
    names the registry, the registered name, the module, the function and its file; the user's error is chained."""


def is_user_module(module: str | None) -> bool:
    """Whether a module (by name) is the user's: one `import_user_module` loaded in this process, or a submodule of
    one (a ``--import``'ed file loads as ``jaxrl_hf_user_*``, `file_module_name`)."""
    return bool(module) and any(module == m or module.startswith(m + ".") for m in _LOADED)


def describe_function(fn: Callable) -> str:
    """``module.qualname`` of ``fn`` and the file it is defined in."""
    module = getattr(fn, "__module__", None) or "?"
    path = getattr(sys.modules.get(module), "__file__", None)
    return f"{module}.{getattr(fn, '__qualname__', repr(fn))}" + (f" in {path}" if path else "")


def call_registered(kind: str, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` for the entry ``name`` of a registry of ``kind``; when ``fn`` is the user's
    (`is_user_module`) an exception it raises becomes a `UserCodeError` naming all of that."""
    if not is_user_module(getattr(fn, "__module__", None)):
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        raise UserCodeError(f"{kind} {name!r} ({describe_function(fn)}) raised {type(err).__name__}: {err}") from err


def user_frame(err: BaseException) -> str | None:
    """``file:line in function`` of the innermost frame of ``err``'s traceback that is the user's code (a module
    loaded by `import_user_module`), or None: how an error from the user's code is told from jaxrl_hf's."""
    found = None
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if is_user_module(frame.f_globals.get("__name__")):
            found = f"{frame.f_code.co_filename}:{tb.tb_lineno} in {frame.f_code.co_name}"
        tb = tb.tb_next
    return found


_LOADED: set[str] = set()
"""Names of the modules `import_user_module` loaded in this process (and their submodules, once imported)."""


def is_file_spec(spec: str) -> bool:
    """Whether ``spec`` names a file (ends in ``.py`` or contains a path separator) rather than a module."""
    return spec.endswith(".py") or "/" in spec or os.sep in spec


def canonical_spec(spec: str) -> str:
    """A file spec as an absolute path; a module name unchanged. Empty or non-string specs raise."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserModuleError(f"import {spec!r}: expected a .py file path or a dotted module name")
    spec = spec.strip()
    return os.path.abspath(os.path.expanduser(spec)) if is_file_spec(spec) else spec


def file_module_name(path: str) -> str:
    """The module name a file is loaded under: stable for one absolute path, distinct for two files."""
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    digest = hashlib.sha1(path.encode("utf-8")).hexdigest()[:10]
    return f"jaxrl_hf_user_{stem}_{digest}"


def _import_file(path: str) -> ModuleType:
    if not os.path.isfile(path):
        raise UserModuleError(f"import {path!r}: no such file")
    name = file_module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserModuleError(f"import {path!r}: not loadable as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before executing, as for a regular import (dataclasses, pickling by reference)
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[name]
        if not isinstance(err, Exception):
            raise
        raise UserModuleError(f"import {path!r} failed: {type(err).__name__}: {err}") from err
    return module


def _import_name(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            raise UserModuleError(
                f"import {name!r}: no module named {err.name!r} on sys.path (set PYTHONPATH, or pass the path of "
                "a .py file)") from err
        raise UserModuleError(f"import {name!r} failed: {type(err).__name__}: {err}") from err
    except Exception as err:
        raise UserModuleError(f"import {name!r} failed: {type(err).__name__}: {err}") from err


def import_user_module(spec: str) -> ModuleType:
    """Import one spec (module docstring); failures raise `UserModuleError` naming it."""
    spec = canonical_spec(spec)
    module = _import_file(spec) if is_file_spec(spec) else _import_name(spec)
    _LOADED.add(module.__name__)
    return module


def import_user_modules(specs: Iterable[str]) -> list[str]:
    """Import every spec in order; returns their canonical forms (what worker processes should import)."""
    canonical = []
    for spec in specs:
        import_user_module(spec)
        if canonical_spec(spec) not in canonical:
            canonical.append(canonical_spec(spec))
    return canonical
