"""While a long activity runs: a live status line on a terminal, a heartbeat line every ``interval`` elsewhere.

The step bar moves once per step; starting the workers, a step's generation or its first update (which compiles
its XLA programs) can each take minutes with nothing else on the screen, and their amount of work is unknown.
On a terminal a daemon thread keeps one line showing the innermost activity and how long it has run
(``step 1/30 (its first calls compile XLA programs): update_actor  [0:42]``), hidden while a task draws a bar
(which shows its own elapsed time, redrawn by the same thread so that it moves between units); elsewhere it
prints ``  ... 45 s in step 1/30: gen`` while an activity lasts longer than ``interval`` (tasks with their counts:
``validation 8/16 prompts``). Nothing with progress output off.
"""

from __future__ import annotations

import threading
from typing import Any, TextIO

from jaxrl_hf.progress.activity import bar_drawn, current, refresh_bars
from jaxrl_hf.progress import bars

STATUS_REFRESH_S = 0.5
"""How often the terminal status line is redrawn."""
STATUS_AFTER_S = 1.0
"""An activity shorter than this never shows on the status line (no flicker from fast stages)."""


def clock(seconds: float) -> str:
    """``h:mm:ss`` / ``m:ss`` of a duration."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Heartbeat:
    """``with Heartbeat(30):`` shows the current activity while the block runs (see the module docstring)."""

    def __init__(self, interval: float = 30.0, stream: TextIO | None = None) -> None:
        self.interval, self.stream = interval, stream or bars.stream()
        self.terminal = bars.is_terminal(self.stream)
        self._stop = threading.Event()
        self._line: Any = None
        self._thread = threading.Thread(target=self._beat, name="jaxrl_hf-heartbeat", daemon=True)

    def _beat(self) -> None:
        if self.terminal:
            while not self._stop.wait(STATUS_REFRESH_S):
                self._status()
            if self._line is not None:
                self._line.close()
            return
        while not self._stop.wait(self.interval):
            now = current()
            if now is not None and now[1] >= self.interval:
                self.stream.write(f"  ... {now[1]:.0f} s in {now[0]}\n")
                self.stream.flush()

    def _status(self) -> None:
        now, drawn = current(), bar_drawn()
        if drawn:
            refresh_bars()  # tqdm redraws only on an update: keep the bar's clock moving
        if now is not None and now[1] >= STATUS_AFTER_S and not drawn:
            if self._line is None:
                self._line = bars.new_bar(self.stream, total=None, bar_format="{desc}", leave=False)
            self._line.set_description_str(f"{now[0]}  [{clock(now[1])}]")
        elif self._line is not None:
            self._line.close()
            self._line = None

    def __enter__(self) -> "Heartbeat":
        if bars.enabled() and (self.terminal or self.interval > 0):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
