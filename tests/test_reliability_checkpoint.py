"""Checkpoints that cannot be half-written: a completion marker with the size and CRC-32 of every file, resume
from the newest checkpoint that still matches it, and a failed save that keeps the previous ones."""

import logging
import os

import pytest

from jaxrl_hf.errors import ExitCode
from jaxrl_hf.trainer.checkpointing import (MARKER_FILE, CheckpointError, CheckpointManager, load_trainer_state,
                                            step_dir, verify)


def _writer(text: str, size: int = 4096):
    def save(path):
        os.makedirs(os.path.join(path, "shard"))
        with open(os.path.join(path, "shard", "weights.bin"), "wb") as fh:
            fh.write((text * size).encode()[:size])
    return save


def _saved(tmp_path, steps=(1, 2, 3)) -> CheckpointManager:
    ckpt = CheckpointManager(str(tmp_path / "ckpt"))
    for step in steps:
        ckpt.save(step, {"actor": _writer(f"w{step}")}, {"global_step": step})
    return ckpt


def test_every_file_is_in_the_marker_and_an_intact_checkpoint_verifies(tmp_path):
    ckpt = _saved(tmp_path, (1,))
    path = step_dir(ckpt.ckpt_dir, 1)
    marker = open(os.path.join(path, MARKER_FILE)).read()
    assert "actor/shard/weights.bin" in marker and "trainer_state.json" in marker
    assert verify(path) is None and ckpt.resume_path("auto") == path


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "no_marker"])
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, caplog, damage):
    ckpt = _saved(tmp_path)
    newest = step_dir(ckpt.ckpt_dir, 3)
    weights = os.path.join(newest, "actor", "shard", "weights.bin")
    if damage == "truncate":  # a copy or a disk that lost the file's tail
        os.truncate(weights, 1000)
    elif damage == "flip":  # same size, other bytes
        with open(weights, "r+b") as fh:
            fh.seek(10)
            fh.write(b"X")
    elif damage == "delete":
        os.remove(weights)
    else:
        os.remove(os.path.join(newest, MARKER_FILE))
    with caplog.at_level(logging.WARNING):
        resumed = ckpt.resume_path("auto")
    assert resumed == step_dir(ckpt.ckpt_dir, 2) and load_trainer_state(resumed)["global_step"] == 2
    assert "global_step_3" in caplog.text and "not usable" in caplog.text
    with pytest.raises(CheckpointError, match="damaged"):
        ckpt.resume_path("resume_path", newest)


def test_no_usable_checkpoint_stops_naming_each_one(tmp_path):
    ckpt = _saved(tmp_path, (1, 2))
    for step in (1, 2):
        os.truncate(os.path.join(step_dir(ckpt.ckpt_dir, step), "actor", "shard", "weights.bin"), 7)
    with pytest.raises(CheckpointError) as info:
        ckpt.resume_path("auto")
    assert "global_step_1" in str(info.value) and "global_step_2" in str(info.value) and "7 bytes" in str(info.value)
    assert info.value.exit_code == ExitCode.CHECKPOINT


def test_a_failed_save_stops_with_a_message_and_keeps_the_previous_checkpoints(tmp_path):
    ckpt = CheckpointManager(str(tmp_path / "ckpt"), max_to_keep=2)
    for step in (1, 2):
        ckpt.save(step, {"actor": _writer(f"w{step}")}, {"global_step": step})

    def disk_full(path):
        os.makedirs(path)
        raise OSError(28, "No space left on device")

    with pytest.raises(CheckpointError, match="No space left on device") as info:
        ckpt.save(3, {"actor": disk_full}, {"global_step": 3})
    assert "global_step_1" in str(info.value) and "global_step_2" in str(info.value)
    assert sorted(os.listdir(ckpt.ckpt_dir)) == ["global_step_1", "global_step_2", "latest_checkpointed_iteration.txt"]
    assert ckpt.resume_path("auto") == step_dir(ckpt.ckpt_dir, 2)  # nothing pruned, nothing half-written
