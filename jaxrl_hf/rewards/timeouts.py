"""Wall-clock bounds for one score.

``time_limit`` arms a POSIX interval timer (SIGALRM) around a call. Python signal handlers run only in
the main thread, so the bound applies there (the serial path and every process-pool worker, whose
scoring runs in the worker's main thread); elsewhere the call runs unbounded and ``time_limit`` says so
through ``armed=False``. A handler also cannot interrupt a single long C call that never checks for signals
(a C extension, a key-derivation loop); the process pool therefore adds an outer deadline that terminates stuck workers
(``jaxrl_hf.rewards.pool``). The built-in scorers are linear-time and read bounded windows, so they never
get near either bound; the bounds exist for user scorers and for defence in depth.

Python ignores an exception raised where nothing can catch it: a garbage-collection callback (JAX registers
one), a ``__del__``. A one-shot timer whose only raise lands there never stops the call (measured: a 1.5 s limit
let a Math-Verify comparison run 26 s). So after the limit the timer keeps firing every ``RETRY_S`` until the
raise lands in the call itself.

A raise that lands where Python ignores it goes to ``sys.unraisablehook`` (which prints "Exception ignored in"
and, under pytest, fails the test). While the limit is armed, ``time_limit`` installs a hook that drops those
expected ``ScoreTimeout`` reports and hands every other report to the previous hook with the retries held off,
so a retry cannot interrupt the report of another error (it once did, in CI, inside pytest's hook).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator

RETRY_S = 0.05
"""Seconds between raises once the limit is past (a raise can land where Python ignores it, see above)."""


class ScoreTimeout(BaseException):
    """Raised inside a scorer that ran past its time limit. A ``BaseException`` (like ``KeyboardInterrupt``), so a
    scorer's own ``except Exception`` (Math-Verify wraps every comparison in one) cannot swallow it and go on."""


def can_arm_timer() -> bool:
    """True where ``time_limit`` can interrupt a call: the main thread of a POSIX process."""
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


class _Armed:
    def __init__(self, armed: bool) -> None:
        self.armed = armed


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[_Armed]:
    """Raise ``ScoreTimeout`` in the body if it runs longer than ``seconds`` (None or <= 0: no limit).

    Restores the previous SIGALRM handler and timer on exit. Yields an object whose ``armed`` tells
    whether the limit is in force (False off the main thread).
    """
    if seconds is None or seconds <= 0 or not can_arm_timer():
        yield _Armed(False)
        return

    active, reporting = [True], [False]

    def _raise(signum, frame):  # noqa: ARG001 - signal handler signature
        # a signal still pending when the body has ended, or one arriving while a report is written, raises nothing
        if active[0] and not reporting[0]:
            raise ScoreTimeout(f"score took longer than {seconds:g} s")

    previous_hook = sys.unraisablehook

    def _report(unraisable) -> None:
        reporting[0] = True
        try:
            if not isinstance(unraisable.exc_value, ScoreTimeout):
                previous_hook(unraisable)
        finally:
            reporting[0] = False

    sys.unraisablehook = _report
    previous_handler = signal.signal(signal.SIGALRM, _raise)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, seconds, RETRY_S)
    try:
        yield _Armed(True)
    finally:
        active[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        sys.unraisablehook = previous_hook
        if previous_delay > 0:
            signal.setitimer(signal.ITIMER_REAL, previous_delay, previous_interval)
