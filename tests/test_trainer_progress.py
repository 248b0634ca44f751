"""The heartbeat: while a named stage runs longer than the interval, its name is printed (nested names joined)."""

import io
import threading

from jaxrl_hf.trainer import progress
from jaxrl_hf.trainer.metrics import StageTimer


class SignallingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.wrote = threading.Event()

    def write(self, text: str) -> int:
        out = super().write(text)
        self.wrote.set()
        return out


def test_a_long_stage_is_named_while_it_runs_and_nothing_after():
    stream, timer = SignallingStream(), StageTimer()
    with progress.Heartbeat(0.02, stream=stream):
        with progress.doing("step 1/30 (its first calls compile XLA programs)"), timer("update_actor"):
            assert stream.wrote.wait(10), "no heartbeat line while the stage ran"
        stream.wrote.clear()
        assert progress.current() is None
        assert not stream.wrote.wait(0.1)  # nothing runs: nothing is printed
    line = stream.getvalue().splitlines()[0]
    assert line.startswith("  ... ") and line.endswith(" s in step 1/30 (its first calls compile XLA programs): update_actor")
    assert timer.timings["update_actor"] > 0


def test_interval_zero_prints_nothing():
    stream = SignallingStream()
    with progress.Heartbeat(0, stream=stream), progress.doing("validation"):
        assert progress.current()[0] == "validation"
    assert stream.getvalue() == ""
