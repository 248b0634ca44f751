"""SIGTERM (a scheduler's preemption) and the first Ctrl-C ask the run to stop at the next step boundary, after a
checkpoint (exit code 75; the same command resumes); a second Ctrl-C stops at once (KeyboardInterrupt, 130)."""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any


class StopRequest:
    """``with StopRequest() as stop:`` installs the handlers (main thread only) and restores them on exit;
    ``stop.signal`` names the first signal received, None until one is."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: at once, no checkpoint
        if self.signal is None:
            self.signal = name
            print(f"\njaxrl_hf: {name}: stopping after this step with a checkpoint"
                  f"{' (Ctrl-C again to stop at once, without one)' if signum == signal.SIGINT else ''}",
                  file=sys.stderr, flush=True)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
