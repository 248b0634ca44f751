"""Checkpoint directory layout, atomic commits, retention and resume (the trainer owns the layout).

    CKPT_DIR/
      global_step_N/
        actor/               ActorRolloutRefWorker.save_checkpoint (orbax: params, optimizer, RNG, step)
        critic/              CriticWorker.save_checkpoint (PPO / Safe-RLHF)
        trainer_state.json   step, loader position, KL controller, Lagrange multiplier, seed
      latest_checkpointed_iteration.txt   (verl's name) N of the newest complete checkpoint

A checkpoint is written into ``.tmp_global_step_N`` and renamed into place only after every part and
``trainer_state.json`` are on disk, so a run killed mid-save leaves the previous checkpoint as the latest
(``.tmp_*`` leftovers are removed on the next save). ``max_ckpt_to_keep`` old checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Any

STATE_FILE = "trainer_state.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the run."""


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def step_dir(ckpt_dir: str, step: int) -> str:
    """``CKPT_DIR/global_step_<step>``."""
    return os.path.join(ckpt_dir, f"global_step_{step}")


def is_complete(path: str) -> bool:
    """A committed checkpoint: the directory holds ``trainer_state.json``."""
    return os.path.isfile(os.path.join(path, STATE_FILE))


def list_checkpoints(ckpt_dir: str) -> list[int]:
    """Steps of the complete checkpoints in ``ckpt_dir``, ascending."""
    if not os.path.isdir(ckpt_dir):
        return []
    steps = []
    for name in os.listdir(ckpt_dir):
        match = _STEP_DIR.match(name)
        if match and is_complete(os.path.join(ckpt_dir, name)):
            steps.append(int(match.group(1)))
    return sorted(steps)


class CheckpointManager:
    """Saves, prunes and finds checkpoints under ``ckpt_dir``."""

    def __init__(self, ckpt_dir: str, max_to_keep: int | None = None) -> None:
        self.ckpt_dir = ckpt_dir
        self.max_to_keep = max_to_keep

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (the tracker file if it points at one, else a scan)."""
        tracker = os.path.join(self.ckpt_dir, LATEST_FILE)
        if os.path.isfile(tracker):
            with open(tracker, encoding="utf-8") as fh:
                text = fh.read().strip()
            if text.isdigit() and is_complete(step_dir(self.ckpt_dir, int(text))):
                return int(text)
        steps = list_checkpoints(self.ckpt_dir)
        return steps[-1] if steps else None

    def save(self, step: int, parts: Mapping[str, Callable[[str], Any]], trainer_state: Mapping[str, Any]) -> str:
        """Write ``parts`` (``name -> fn(path)`` writing into ``path``) and the trainer state; commit atomically."""
        os.makedirs(self.ckpt_dir, exist_ok=True)
        for name in os.listdir(self.ckpt_dir):
            if name.startswith(".tmp_"):
                shutil.rmtree(os.path.join(self.ckpt_dir, name), ignore_errors=True)
        tmp = os.path.join(self.ckpt_dir, f".tmp_global_step_{step}")
        os.makedirs(tmp)
        for name, save_fn in parts.items():
            save_fn(os.path.abspath(os.path.join(tmp, name)))
        _write_atomic(os.path.join(tmp, STATE_FILE), json.dumps(dict(trainer_state), indent=1, sort_keys=True))
        final = step_dir(self.ckpt_dir, step)
        if os.path.exists(final):  # re-saving a step (e.g. a resumed run ending where it started)
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_atomic(os.path.join(self.ckpt_dir, LATEST_FILE), str(step))
        self.prune()
        return final

    def prune(self) -> list[int]:
        """Delete all but the newest ``max_to_keep`` checkpoints; returns the deleted steps."""
        if not self.max_to_keep:
            return []
        steps = list_checkpoints(self.ckpt_dir)
        doomed = steps[: max(len(steps) - self.max_to_keep, 0)]
        for step in doomed:
            shutil.rmtree(step_dir(self.ckpt_dir, step), ignore_errors=True)
        return doomed

    def resume_path(self, mode: str, path: str | None = None) -> str | None:
        """Which checkpoint to resume from: ``auto`` (latest here, or None), ``resume_path`` (``path``), ``disable``."""
        if mode == "disable":
            return None
        if mode == "auto":
            step = self.latest_step()
            return None if step is None else step_dir(self.ckpt_dir, step)
        if mode == "resume_path":
            if not path or not is_complete(path):
                raise CheckpointError(
                    f"trainer.resume_from_path={path!r} is not a complete checkpoint (a global_step_N directory "
                    f"with {STATE_FILE}); complete checkpoints in {self.ckpt_dir}: {list_checkpoints(self.ckpt_dir)}"
                )
            return path
        raise CheckpointError(f"trainer.resume_mode={mode!r}; valid: ['auto', 'resume_path', 'disable']")


def load_trainer_state(path: str) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint directory."""
    file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} has no {STATE_FILE}: not a complete checkpoint")
    with open(file, encoding="utf-8") as fh:
        return json.load(fh)
