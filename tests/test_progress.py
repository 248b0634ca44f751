"""Progress on the console: bars where the work is known and stderr is a terminal, a live status line with the
elapsed time for the rest (compilation), heartbeat lines instead where stderr is no terminal, and nothing at all
with ``trainer.progress_bar=false``."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest

from _models_helpers import random_params, tiny_config
from jaxrl_hf import progress
from jaxrl_hf.controller import Batch
from jaxrl_hf.models.hf_export import write_hf_model_dir
from jaxrl_hf.models.weights_hf import load_hf_dir
from jaxrl_hf.progress import bars, heartbeat
from jaxrl_hf.trainer.dynamic_sampling import collect_informative_groups
from jaxrl_hf.trainer.logging import ProgressBar
from jaxrl_hf.trainer.metrics import StageTimer


class SignallingStream(io.StringIO):
    """A captured stream that says when something was written (and can pose as a terminal)."""

    def __init__(self, tty: bool = False) -> None:
        super().__init__()
        self.tty = tty
        self.wrote = threading.Event()

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        out = super().write(text)
        self.wrote.set()
        return out


@pytest.fixture
def redraw_always(monkeypatch):
    """Bars redraw on every update (tqdm's rate limit off), so what they showed can be read back."""
    monkeypatch.setattr(bars, "BAR_MIN_INTERVAL_S", 0.0)


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


def test_a_task_draws_a_bar_on_a_terminal(redraw_always):
    tty = SignallingStream(tty=True)
    with progress.configured(True, tty), progress.task("validation (2 samples each)", 4, "prompts") as done:
        done.advance(2)
        assert progress.current()[0] == "validation (2 samples each) 2/4 prompts"
        done.advance(5)  # kept within the total
    shown = tty.getvalue()
    assert "validation (2 samples each)" in shown and "2/4" in shown and "4/4" in shown and "\r" in shown
    assert progress.current() is None


def test_without_a_terminal_the_heartbeat_names_the_task_and_its_count():
    log = SignallingStream(tty=False)
    with progress.configured(True, log), progress.Heartbeat(0.02):
        with progress.task("validation (2 samples each)", 16, "prompts") as done:
            done.advance(8)
            with progress.doing("arithmetic, prompts 9-16 of 16"):
                assert log.wrote.wait(10)
    line = log.getvalue().splitlines()[0]
    assert line.endswith(" s in validation (2 samples each) 8/16 prompts: arithmetic, prompts 9-16 of 16"), line
    assert "\r" not in log.getvalue()  # no bar drawn into a log


def test_progress_off_prints_nothing(redraw_always):
    tty = SignallingStream(tty=True)
    with progress.configured(False, tty):
        beat = progress.Heartbeat(0.02)
        with beat, progress.task("validation", 4, "prompts") as done, progress.doing("compiling"):
            done.advance(4)
            assert not beat._thread.is_alive()
        bar = ProgressBar(3)
        assert bar._bar is None
    assert tty.getvalue() == ""


def test_the_status_line_shows_how_long_an_unknown_stage_runs(monkeypatch):
    monkeypatch.setattr(heartbeat, "STATUS_AFTER_S", 0.0)
    monkeypatch.setattr(heartbeat, "STATUS_REFRESH_S", 0.01)
    tty = SignallingStream(tty=True)
    label = "step 1/2 (its first calls compile XLA programs): gen"
    with progress.configured(True, tty), progress.Heartbeat(30.0):
        with progress.doing("step 1/2 (its first calls compile XLA programs)"), progress.doing("gen"):
            assert tty.wrote.wait(10)
    assert f"{label}  [0:00]" in tty.getvalue()
    assert heartbeat.clock(3725) == "1:02:05" and heartbeat.clock(42) == "0:42"


def test_a_bar_without_progress_still_shows_its_clock_moving():
    """A validation's first batch compiles for a minute at 0/48: the heartbeat redraws the bar meanwhile."""
    tty = SignallingStream(tty=True)
    with progress.configured(True, tty), progress.task("validation", total=48, unit="prompts") as task:
        task.activity.bar.start_t -= 75.0  # as if the first batch had run for 75 s
        beat = progress.Heartbeat(30.0)
        assert "01:15" not in tty.getvalue()
        beat._status()
        assert "0/48 [01:15" in tty.getvalue()


def test_the_step_bar_is_a_terminal_bar_or_a_line_per_step(redraw_always):
    tty = SignallingStream(tty=True)
    with progress.configured(True, tty):
        bar = ProgressBar(3, start=1)
        bar.update(2, "score=0.25")
        bar.close()
    assert "training" in tty.getvalue() and "2/3" in tty.getvalue() and "score=0.25" in tty.getvalue()
    log = SignallingStream(tty=False)
    with progress.configured(True, log):
        bar = ProgressBar(3, start=1)
        assert bar._bar is None
        bar.update(2, "score=0.25")
    assert "2/3 steps" in log.getvalue() and "\r" not in log.getvalue()


def test_model_conversion_shows_the_tensors_converted(tmp_path, redraw_always):
    config = tiny_config()
    tty = SignallingStream(tty=True)
    with progress.configured(True, tty):
        write_hf_model_dir(tmp_path / "hf", random_params(config), config, dtype="float32")
        load_hf_dir(tmp_path / "hf")
    tensors = 3 + 9 * config.num_hidden_layers  # embedding, norm, lm_head + 9 per llama layer
    shown = tty.getvalue()
    assert "exporting float32 to hf" in shown and f"{tensors}/{tensors}" in shown
    assert "reading hf" in shown


def test_dynamic_sampling_counts_the_informative_groups(redraw_always):
    rounds = [[0, 1, 0, 0], [1, 0, 0, 1]]  # 1 informative group, then 2

    def generate_round(r):
        accs = np.asarray(rounds[r], np.float32)
        return Batch.from_dict({"acc": accs, "uid": np.repeat(np.arange(2) + 10 * r, 2),
                                "response_mask": np.ones((4, 2), np.int32)})

    tty = SignallingStream(tty=True)
    with progress.configured(True, tty):
        collect_informative_groups(generate_round, 3, 2, "acc", max_num_gen_batches=4)
    assert "dynamic sampling" in tty.getvalue() and "1/3" in tty.getvalue() and "3/3" in tty.getvalue()
