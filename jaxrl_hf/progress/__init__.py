"""Progress of a long run on the console: what it is doing (`activity`), bars where the amount of work is known
and the console is a terminal (`bars`), a live status line or heartbeat lines for the rest (`heartbeat`).

A leaf package: the trainer, the model converters and the exporters all report here."""

from jaxrl_hf.progress.activity import current, doing
from jaxrl_hf.progress.bars import bars_on, configured, enabled, step_bar, stream, task, write
from jaxrl_hf.progress.heartbeat import Heartbeat

__all__ = ["Heartbeat", "bars_on", "configured", "current", "doing", "enabled", "step_bar", "stream", "task", "write"]
