"""Progress while a long stage runs: a heartbeat line every ``interval`` seconds naming what the run is doing.

The step progress bar moves once per step; starting the workers, a validation, a step's generation or its first
update (which compiles its XLA programs) can each take minutes on a CPU with nothing on the screen. The trainer
names what it is doing (``doing("validation ...")``; the step's ``StageTimer`` names its stages), and a daemon
thread prints ``  ... 45 s in step 1/30: gen`` while any of them lasts longer than ``interval``.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

_lock = threading.Lock()
_stack: list[tuple[str, float]] = []
"""What the run is doing, outermost first: (label, start time)."""


@contextlib.contextmanager
def doing(label: str) -> Iterator[None]:
    """Name what the run does inside this block (nested blocks read ``outer: inner``)."""
    with _lock:
        _stack.append((label, time.perf_counter()))
    try:
        yield
    finally:
        with _lock:
            _stack.pop()


def current() -> tuple[str, float] | None:
    """``(label, seconds the innermost activity has run)``, or None when nothing is named."""
    with _lock:
        if not _stack:
            return None
        return ": ".join(label for label, _ in _stack), time.perf_counter() - _stack[-1][1]


class Heartbeat:
    """``with Heartbeat(30):`` prints the current activity every ``interval`` seconds while one lasts longer."""

    def __init__(self, interval: float = 30.0, stream: TextIO | None = None) -> None:
        self.interval, self.stream = interval, stream or sys.stderr
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="jaxrl_hf-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            now = current()
            if now is not None and now[1] >= self.interval:
                self.stream.write(f"  ... {now[1]:.0f} s in {now[0]}\n")
                self.stream.flush()

    def __enter__(self) -> "Heartbeat":
        if self.interval > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
