"""What the run is doing: a stack of named activities (``with doing("validation"):``), some with a known amount
of work (``with task("validation", total=16, unit="prompts") as t: ... t.advance(4)``).

The heartbeat and the live status line (`jaxrl_hf.progress.heartbeat`) read it from their own thread; a
`task` also draws a bar (`jaxrl_hf.progress.bars`) where the console is a terminal. Pushing, advancing and
popping are a lock and a few attribute writes: cheap enough for every stage of a step.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_lock = threading.Lock()
_stack: list["Activity"] = []
"""What the run is doing, outermost first."""


@dataclass
class Activity:
    """One named activity; ``total`` (with ``done`` and ``unit``) when the amount of its work is known."""

    label: str
    start: float = field(default_factory=time.perf_counter)
    total: int | None = None
    done: int = 0
    unit: str = ""
    bar: Any = None
    """The terminal bar drawn for it (`jaxrl_hf.progress.bars`), else None."""

    def text(self) -> str:
        """``label``, with ``done/total unit`` when the total is known."""
        if self.total is None:
            return self.label
        return f"{self.label} {self.done}/{self.total}{' ' + self.unit if self.unit else ''}"


@contextlib.contextmanager
def pushed(activity: Activity) -> Iterator[Activity]:
    """``activity`` on the stack inside this block."""
    with _lock:
        _stack.append(activity)
    try:
        yield activity
    finally:
        with _lock:
            _stack.remove(activity)


@contextlib.contextmanager
def doing(label: str) -> Iterator[None]:
    """Name what the run does inside this block (nested blocks read ``outer: inner``)."""
    with pushed(Activity(label)):
        yield


def current() -> tuple[str, float] | None:
    """``(label, seconds the innermost activity has run)``, or None when nothing is named."""
    with _lock:
        if not _stack:
            return None
        return ": ".join(a.text() for a in _stack), time.perf_counter() - _stack[-1].start


def refresh_bars() -> None:
    """Redraw the bars of the activities on the stack, so their elapsed time moves while no unit completes
    (a validation's first batch, which compiles, can take a minute at ``0/48``)."""
    with _lock:
        drawn = [a.bar for a in _stack if a.bar is not None]
    for bar in drawn:
        bar.refresh()


def bar_drawn() -> bool:
    """Whether an activity on the stack draws a bar (which shows its elapsed time: the status line stays away)."""
    with _lock:
        return any(a.bar is not None for a in _stack)
