"""Progress bars (tqdm) where the console is a terminal, and the switch that governs all progress output.

``trainer.progress_bar`` (`configured`) turns everything here off: no bars, no status line, no heartbeat lines.
On, with a terminal on stderr, a `task` with a known amount of work (validation prompts, DAPO's informative
groups, tensors converted or exported) draws a bar; without a terminal (CI, ``nohup``, a Ray worker) nothing is
drawn and the heartbeat (`jaxrl_hf.progress.heartbeat`) names the task with its count instead, every
``trainer.progress_interval_s``, so logs are not flooded.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from jaxrl_hf.progress.activity import Activity, pushed

BAR_MIN_INTERVAL_S = 0.2
"""Shortest time between two redraws of a bar (tqdm's ``mininterval``)."""

_settings: dict[str, Any] = {"enabled": True, "stream": None}


def stream() -> TextIO:
    """Where progress goes: the configured stream, else the current ``sys.stderr``."""
    return _settings["stream"] or sys.stderr


def enabled() -> bool:
    """Whether any progress output is wanted (``trainer.progress_bar``)."""
    return bool(_settings["enabled"])


def is_terminal(out: TextIO) -> bool:
    """Whether ``out`` is a terminal (a file, a pipe or a Ray worker's log is not)."""
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty())


def bars_on() -> bool:
    """Whether bars are drawn: progress wanted and the stream is a terminal."""
    return enabled() and is_terminal(stream())


@contextlib.contextmanager
def configured(enabled: bool, out: TextIO | None = None) -> Iterator[None]:
    """Progress on or off (and its stream) inside this block; the previous settings afterwards."""
    before = dict(_settings)
    _settings.update(enabled=enabled, stream=out)
    try:
        yield
    finally:
        _settings.update(before)


def new_bar(out: TextIO | None = None, **kwargs: Any) -> Any:
    """A tqdm bar on ``out`` (default `stream`), redrawn at most every `BAR_MIN_INTERVAL_S`, fitted to the
    terminal's width."""
    from tqdm import tqdm

    return tqdm(file=out or stream(), mininterval=BAR_MIN_INTERVAL_S, dynamic_ncols=True, **kwargs)


class Task:
    """A running `task`: ``advance(n)`` after each piece of work."""

    def __init__(self, activity: Activity) -> None:
        self.activity = activity

    def advance(self, n: int = 1) -> None:
        """``n`` more units done (kept within the total)."""
        n = max(0, min(int(n), (self.activity.total or 0) - self.activity.done))
        self.activity.done += n
        if self.activity.bar is not None and n:
            self.activity.bar.update(n)


@contextlib.contextmanager
def task(label: str, total: int, unit: str = "") -> Iterator[Task]:
    """An activity with ``total`` units of work: a bar on a terminal (cleared when done), its count in the
    heartbeat otherwise."""
    activity = Activity(label, total=int(total), unit=unit)
    if bars_on():
        activity.bar = new_bar(total=int(total), desc=label, unit=unit or "it", leave=False)
    try:
        with pushed(activity):
            yield Task(activity)
    finally:
        if activity.bar is not None:
            activity.bar.close()


def step_bar(total: int, start: int) -> Any:
    """The run's bar over its training steps (kept on screen at the end), or None where bars are off."""
    if not bars_on():
        return None
    return new_bar(total=total, initial=start, desc="training", unit="step", leave=True)


def write(text: str) -> None:
    """A console line that leaves the bars intact (printed above them)."""
    if bars_on():
        from tqdm import tqdm

        tqdm.write(text, file=stream())
    else:
        print(text, file=stream(), flush=True)
