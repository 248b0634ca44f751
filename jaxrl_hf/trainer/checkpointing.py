"""Checkpoint directory layout, atomic commits, retention and resume (the trainer owns the layout).

    CKPT_DIR/
      global_step_N/
        actor/               ActorRolloutRefWorker.save_checkpoint (orbax: params, optimizer, RNG, step)
        critic/              CriticWorker.save_checkpoint (PPO / Safe-RLHF)
        trainer_state.json   step, loader position, KL controller, Lagrange multiplier, seed
        checkpoint_complete.json   written last: size and CRC-32 of every file above
      latest_checkpointed_iteration.txt   (verl's name) N of the newest complete checkpoint

A checkpoint is written into ``.tmp_global_step_N``; only after every part and ``trainer_state.json`` are on disk
is the completion marker written (the size and CRC-32 of each file) and the directory renamed into place, so a
run killed mid-save leaves the previous checkpoint as the latest (``.tmp_*`` leftovers are removed on the next
save). On resume the newest checkpoint whose files still match its marker is used: a truncated or altered file
or a missing marker is reported by name and the previous checkpoint is tried (and one that passes these checks
but fails to restore, ``trainer/checkpoint_restore.py``). A save that fails (disk full, no
permission) stops the run and leaves the previous checkpoints in place; ``max_ckpt_to_keep`` prunes only after
a save is complete.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import zlib
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_hf.controller import ControllerError
from jaxrl_hf.errors import ExitCode, RunError

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
MARKER_FILE = "checkpoint_complete.json"
LATEST_FILE = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RunError):
    """A checkpoint is missing, incomplete, damaged or does not match the run, or cannot be written."""

    exit_code = ExitCode.CHECKPOINT


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(root: str) -> list[str]:
    """Every file under ``root`` (relative paths, sorted), the marker excluded."""
    out = []
    for base, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(base, n), root) for n in names]
    return sorted(f for f in out if f != MARKER_FILE)


def write_marker(path: str) -> None:
    """Write ``checkpoint_complete.json``: the size and CRC-32 of every file of the checkpoint in ``path``."""
    files = {f: {"size": os.path.getsize(os.path.join(path, f)), "crc32": _crc32(os.path.join(path, f))}
             for f in _files(path)}
    _write_atomic(os.path.join(path, MARKER_FILE), json.dumps({"files": files}, indent=1, sort_keys=True))


def verify(path: str) -> str | None:
    """Why the checkpoint in ``path`` is unusable (no marker; a file missing, resized or altered), or None."""
    marker = os.path.join(path, MARKER_FILE)
    if not os.path.isfile(marker):
        return f"no {MARKER_FILE} (a save that did not finish, or a checkpoint from an older version)"
    try:
        with open(marker, encoding="utf-8") as fh:
            files = json.load(fh)["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"unreadable {MARKER_FILE} ({err})"
    for name, want in sorted(files.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != want["size"]:
            return f"{name} has {os.path.getsize(file)} bytes, {want['size']} were written"
        if _crc32(file) != want["crc32"]:
            return f"{name} does not match its CRC-32 (altered after the save)"
    return None


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
    """A committed checkpoint: the directory holds ``trainer_state.json`` and the completion marker (its files are
    checked against the marker by ``verify``)."""
    return os.path.isfile(os.path.join(path, STATE_FILE)) and os.path.isfile(os.path.join(path, MARKER_FILE))


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
        try:
            os.makedirs(tmp)
            for name, save_fn in parts.items():
                save_fn(os.path.abspath(os.path.join(tmp, name)))
            _write_atomic(os.path.join(tmp, STATE_FILE), json.dumps(dict(trainer_state), indent=1, sort_keys=True))
            write_marker(tmp)
        except Exception as err:  # disk full, permissions, a worker that failed to write its part
            shutil.rmtree(tmp, ignore_errors=True)
            kept = list_checkpoints(self.ckpt_dir)
            failure = CheckpointError(f"saving the step-{step} checkpoint into {self.ckpt_dir} failed: "
                                      f"{type(err).__name__}: {err}; the previous checkpoints are kept: "
                                      f"{['global_step_%d' % s for s in kept] or 'none'}")
            if isinstance(err, ControllerError):  # a worker died or hung while writing: a worker failure
                failure.exit_code = ExitCode.WORKER
            raise failure from err
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

    def _steps_newest_first(self) -> list[int]:
        """Steps of every ``global_step_N`` directory (complete or not), newest first."""
        names = os.listdir(self.ckpt_dir) if os.path.isdir(self.ckpt_dir) else []
        return sorted((int(m.group(1)) for n in names if (m := _STEP_DIR.match(n))), reverse=True)

    def older_than(self, path: str) -> list[str]:
        """The ``global_step_N`` directories older than the checkpoint ``path`` (complete or not), newest first:
        the candidates when ``path`` passes its checks but cannot be restored."""
        match = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
        newest = int(match.group(1)) if match else -1
        return [step_dir(self.ckpt_dir, s) for s in self._steps_newest_first() if s < newest]

    def newest_usable(self) -> str | None:
        """The newest checkpoint whose files match its marker; each newer one that does not is named in a warning.
        None when there is no checkpoint; a ``CheckpointError`` naming them when none is usable."""
        damaged = []
        for step in self._steps_newest_first():
            path = step_dir(self.ckpt_dir, step)
            problem = verify(path)
            if problem is None:
                return path
            damaged.append(f"{path}: {problem}")
            logger.warning("checkpoint %s is not usable (%s); trying the previous one", path, problem)
        if damaged:
            raise CheckpointError("no usable checkpoint to resume from:\n  " + "\n  ".join(damaged) +
                                  "\nmove the run directory aside for a fresh start, or trainer.resume_mode=disable")
        return None

    def resume_path(self, mode: str, path: str | None = None) -> str | None:
        """Which checkpoint to resume from: ``auto`` (latest here, or None), ``resume_path`` (``path``), ``disable``."""
        if mode == "disable":
            return None
        if mode == "auto":
            return self.newest_usable()
        if mode == "resume_path":
            if not path or not is_complete(path):
                raise CheckpointError(
                    f"trainer.resume_from_path={path!r} is not a complete checkpoint (a global_step_N directory "
                    f"with {STATE_FILE} and {MARKER_FILE}); complete checkpoints in {self.ckpt_dir}: "
                    f"{list_checkpoints(self.ckpt_dir)}"
                )
            problem = verify(path)
            if problem is not None:
                raise CheckpointError(f"trainer.resume_from_path={path!r} is damaged: {problem}")
            return path
        raise CheckpointError(f"trainer.resume_mode={mode!r}; valid: ['auto', 'resume_path', 'disable']")


def load_trainer_state(path: str) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint directory."""
    file = os.path.join(path, STATE_FILE)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path} has no {STATE_FILE}: not a complete checkpoint")
    try:
        with open(file, encoding="utf-8") as fh:
            return json.load(fh)
    except ValueError as err:
        raise CheckpointError(f"{file} is not valid JSON ({err}): a damaged checkpoint") from err
