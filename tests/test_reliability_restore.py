"""A checkpoint that passes its completion marker and checksums but fails to restore: it is named with its error
and the previous checkpoint is restored; when none restores the run stops naming each; a config that changed the
model is said to be that, not damage. Unit tests on fake restores, then a real smoke run's checkpoints."""

import logging
import os
import re
import shutil

import pytest

from jaxrl_hf.controller import WorkerDiedError, WorkerMethodError
from jaxrl_hf.errors import ExitCode
from jaxrl_hf.trainer.checkpoint_restore import model_changes, restore_error_text, restore_newest
from jaxrl_hf.trainer.checkpointing import CheckpointError, CheckpointManager, step_dir, write_marker

MISMATCH = ("Traceback (most recent call last):\n  File \"checkpoint.py\", line 96, in restore_state\n"
            "ValueError: checkpoint /x/actor does not match this worker's state structure: Requested shape: "
            "(2, 64, 96) is not compatible with the stored shape: (2, 64, 128).\n")
OCDBT = ("Traceback (most recent call last):\nValueError: OUT_OF_RANGE: Error reading \"train_state.params\" in OCDBT "
         "database: Requested byte range [12343851, 12359069) is not valid for value of size 1000000\n\nThe above "
         "exception was the direct cause of the following exception:\n\nException: Exception raised in "
         "async reading of <TensorStore spec({\n  'driver': 'zarr',\n})>.\n")


def _saved(tmp_path, steps=(1, 2, 3)) -> CheckpointManager:
    ckpt = CheckpointManager(str(tmp_path / "ckpt"))
    for step in steps:
        def part(path, step=step):
            os.makedirs(path)
            with open(os.path.join(path, "weights.bin"), "wb") as fh:
                fh.write(bytes([step]) * 512)
        ckpt.save(step, {"actor": part}, {"global_step": step})
    return ckpt


class FakeRestore:
    """``restore(path)`` raising ``errors[step]`` for the listed steps; records the paths it was given."""

    def __init__(self, errors):
        self.errors, self.calls = errors, []

    def __call__(self, path):
        self.calls.append(os.path.basename(path))
        step = int(path.rsplit("_", 1)[1])
        if step in self.errors:
            raise self.errors[step]


def test_a_restore_failure_names_the_checkpoint_and_restores_the_previous_one(tmp_path, caplog):
    ckpt = _saved(tmp_path)
    restore = FakeRestore({3: WorkerMethodError("actor", 0, "load_checkpoint", "Exception", OCDBT)})
    with caplog.at_level(logging.WARNING):
        path = restore_newest(ckpt, step_dir(ckpt.ckpt_dir, 3), restore)
    assert path == step_dir(ckpt.ckpt_dir, 2) and restore.calls == ["global_step_3", "global_step_2"]
    warned = [r.getMessage() for r in caplog.records if "global_step_3" in r.getMessage()]
    assert warned and "OUT_OF_RANGE" in warned[0] and "load_checkpoint" in warned[0], caplog.text
    assert "TensorStore spec" not in caplog.text  # the specific cause, not orbax's wrapper


def test_no_checkpoint_restores_names_each_one_tried_and_why(tmp_path):
    ckpt = _saved(tmp_path)
    os.truncate(os.path.join(step_dir(ckpt.ckpt_dir, 2), "actor", "weights.bin"), 7)  # fails its checksum
    restore = FakeRestore({3: CheckpointError("trainer_state.json is not valid JSON"), 1: KeyError("loader")})
    with pytest.raises(CheckpointError) as info:
        restore_newest(ckpt, step_dir(ckpt.ckpt_dir, 3), restore)
    text = str(info.value)
    assert restore.calls == ["global_step_3", "global_step_1"]  # the damaged one is not restored
    for expected in ("global_step_3: restore failed: CheckpointError: trainer_state.json is not valid JSON",
                     "global_step_2: actor/weights.bin has 7 bytes", "global_step_1: restore failed: KeyError"):
        assert expected in text, text
    assert "not damage" not in text and info.value.exit_code == ExitCode.CHECKPOINT


def test_every_checkpoint_failing_alike_with_a_state_mismatch_is_called_a_config_or_code_change(tmp_path):
    ckpt = _saved(tmp_path, (1, 2))
    err = WorkerMethodError("actor", 0, "load_checkpoint", "ValueError", MISMATCH)
    with pytest.raises(CheckpointError) as info:
        restore_newest(ckpt, step_dir(ckpt.ckpt_dir, 2), FakeRestore({1: err, 2: err}))
    text = str(info.value)
    assert "fails alike" in text and "not damage" in text and "global_step_1" in text and "global_step_2" in text
    assert "no model key of config.yaml changed" in text


def test_a_changed_model_stops_at_once_and_says_so(tmp_path):
    ckpt = _saved(tmp_path)
    err = WorkerMethodError("actor", 0, "load_checkpoint", "ValueError", MISMATCH)
    restore = FakeRestore({1: err, 2: err, 3: err})
    changed = model_changes(["trainer.total_steps: 2 -> 4", "model.tiny.intermediate_size: 128 -> 96",
                             "algorithm.adv_estimator: 'grpo' -> 'rloo'"])
    assert changed == ["model.tiny.intermediate_size: 128 -> 96"]
    with pytest.raises(CheckpointError) as info:
        restore_newest(ckpt, step_dir(ckpt.ckpt_dir, 3), restore, changed_model=changed)
    assert restore.calls == ["global_step_3"]
    text = str(info.value)
    assert "the config changed the model" in text and "model.tiny.intermediate_size: 128 -> 96" in text
    assert "not damage" in text and "global_step_3" in text and "(2, 64, 96)" in text


def test_a_worker_dying_while_restoring_is_a_worker_failure_not_a_fallback(tmp_path):
    ckpt = _saved(tmp_path, (1, 2))
    died = WorkerDiedError("train", "actor", 0, "load_checkpoint", "killed")
    restore = FakeRestore({2: died})
    with pytest.raises(WorkerDiedError):
        restore_newest(ckpt, step_dir(ckpt.ckpt_dir, 2), restore)
    assert restore.calls == ["global_step_2"]


def test_a_named_checkpoint_is_not_replaced_by_an_older_one(tmp_path):
    ckpt = _saved(tmp_path, (1, 2))
    restore = FakeRestore({2: ValueError("bad")})
    with pytest.raises(CheckpointError, match="global_step_2: restore failed: ValueError: bad"):
        restore_newest(ckpt, step_dir(ckpt.ckpt_dir, 2), restore, fallback=False)
    assert restore.calls == ["global_step_2"]


def test_the_error_line_of_a_remote_traceback():
    err = WorkerMethodError("critic", 1, "load_checkpoint", "Exception", OCDBT)
    text = restore_error_text(err)
    assert text.startswith("role 'critic' rank 1 load_checkpoint: ValueError: OUT_OF_RANGE") and "\n" not in text


# ---------------------------------------------------------------- a real smoke run's checkpoints
ARGS = ("trainer.total_steps=2", "trainer.save_freq=1", "trainer.val_before_train=false", "data.val_files=[]",
        "trainer.progress_bar=false")


def _train(run_dir, *overrides) -> int:
    from jaxrl_hf.trainer import run

    return run("grpo", preset="smoke", overrides=[f"trainer.run_dir={run_dir}", *ARGS, *overrides])


def _records(run_dir) -> list[dict]:
    import json

    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, trainer_session):
    """A 2-step smoke run with a checkpoint after each step."""
    run_dir = tmp_path_factory.mktemp("restore") / "full"
    assert _train(run_dir) == 0
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("marker", ["kept", "rewritten"])
def test_a_truncated_file_of_the_newest_checkpoint_resumes_from_the_previous_one(saved_run, tmp_path, capfd, caplog,
                                                                                marker):
    """A data file of the real step-2 checkpoint is truncated. ``kept``: its marker's size and CRC-32 catch it.
    ``rewritten``: the marker is written again over the damaged file, so only the restore can tell."""
    from jaxrl_hf.trainer.metrics import is_wall_clock_metric

    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    newest = run_dir / "checkpoints" / "global_step_2"
    data = newest / "actor" / "state" / "ocdbt.process_0" / "d"
    biggest = max(data.iterdir(), key=lambda f: f.stat().st_size)
    os.truncate(biggest, biggest.stat().st_size // 4)
    damage = f"{biggest.name} has {biggest.stat().st_size} bytes"  # the step-2 checkpoint is saved again below
    if marker == "rewritten":
        write_marker(str(newest))
    with caplog.at_level(logging.WARNING):
        assert _train(run_dir) == 0  # the same command
    err = capfd.readouterr().err
    warned = [r.getMessage() for r in caplog.records if "global_step_2 is not usable" in r.getMessage()]
    assert warned, caplog.text
    if marker == "rewritten":
        assert "restore failed" in warned[0] and "load_checkpoint" in warned[0], warned[0]
    else:
        assert damage in warned[0], warned[0]
    assert f"resumed from {run_dir / 'checkpoints' / 'global_step_1'} (step 1)" in err, err[-3000:]
    full, resumed = _records(saved_run), _records(run_dir)
    assert [r["step"] for r in resumed] == [1, 2]
    comparable = [{k: v for k, v in r.items() if not is_wall_clock_metric(k)} for r in (full[1], resumed[1])]
    assert comparable[0] == comparable[1]  # step 2 again, from the step-1 state: the same numbers


@pytest.mark.slow
def test_a_config_that_changed_the_model_is_named_not_called_damage(saved_run, tmp_path, capfd):
    run_dir = tmp_path / "run"
    shutil.copytree(saved_run, run_dir)
    saved_config = (run_dir / "config.yaml").read_text()
    code = _train(run_dir, "model.tiny.intermediate_size=96", "trainer.allow_config_change=true")
    err = capfd.readouterr().err
    assert code == ExitCode.CHECKPOINT, err[-3000:]
    line = [ln for ln in err.splitlines() if ln.startswith("jaxrl_hf: ")][-1]
    assert "the config changed the model" in line and "model.tiny.intermediate_size: 128 -> 96" in line, line
    # the driver prints no traceback; lines Ray forwards from a worker process ("(ProcessHost pid=N) ...", e.g.
    # its event loop closing under the shutdown) are the worker's, not the driver's
    driver = [ln for ln in err.splitlines() if not re.search(r"\(\w+ pid=\d+", ln)]
    assert "global_step_2" in line and "not damage" in line and not any("Traceback" in ln for ln in driver), line
    assert (run_dir / "config.yaml").read_text() == saved_config  # kept: the same command with the old model resumes
    assert sorted(os.listdir(run_dir / "checkpoints")) == sorted(os.listdir(saved_run / "checkpoints"))
