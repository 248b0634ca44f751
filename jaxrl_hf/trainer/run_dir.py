"""One run per run directory, and nothing in it deleted silently.

* ``RunDirLock``: ``<run_dir>/run.lock`` holds an exclusive ``flock`` for the life of the run (the kernel releases
  it when the process dies, so a stale lock is simply taken over) and the owner's pid; a second run on the same
  directory refuses, naming that pid.
* ``check_fresh_start``: a run with no checkpoint to resume from in a directory that already holds metrics
  refuses unless ``trainer.overwrite=true`` (the old records would otherwise be replaced).
* ``check_resume_config``: a resume lists the keys changed since the saved ``config.yaml`` and refuses changes of
  the model or the data order unless ``trainer.allow_config_change=true``.
"""

from __future__ import annotations

import fcntl
import os
from typing import IO, Any

from jaxrl_hf.errors import ExitCode, RunError

LOCK_FILE = "run.lock"
RECORDS = ("metrics.jsonl", "validation.jsonl")


class RunDirError(RunError):
    """The run directory is in use by another run, or holds records this run would overwrite."""

    exit_code = ExitCode.CONFIG


class RunDirLock:
    """``with RunDirLock(run_dir):`` for the duration of a run."""

    def __init__(self, run_dir: str) -> None:
        self.path = os.path.join(run_dir, LOCK_FILE)
        self._fh: IO[str] | None = None

    def __enter__(self) -> "RunDirLock":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fh = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            owner = fh.read().strip() or "?"
            fh.close()
            raise RunDirError(f"trainer.run_dir={os.path.dirname(self.path)} is in use by another run (pid {owner}, "
                              f"{self.path}); wait for it, stop it, or choose another run_dir") from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        self._fh = fh
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fh is not None:
            self._fh.close()  # releases the lock; the file stays (a later run takes it over)
            self._fh = None


def check_fresh_start(run_dir: str, overwrite: bool) -> None:
    """Refuse to start a run from scratch over another run's records unless ``overwrite``."""
    found = [name for name in RECORDS if os.path.isfile(os.path.join(run_dir, name))
             and os.path.getsize(os.path.join(run_dir, name)) > 0]
    if found and not overwrite:
        raise RunDirError(f"trainer.run_dir={run_dir} already holds {', '.join(found)} of an earlier run but no "
                          f"checkpoint to resume from: set trainer.overwrite=true to replace them, or choose another "
                          f"run_dir")


RESUME_FIXED = ("algo", "model.path", "model.tiny", "model.lora_rank", "data.train_files", "data.train_size",
                "data.arithmetic", "data.seed", "data.shuffle", "data.sampler", "data.train_batch_size",
                "data.gen_batch_size", "data.max_prompt_length", "data.filter_overlong_prompts")
"""Keys whose change on resume would train another model or read the data in another order (prefixes)."""


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: tree}


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, current value)}`` for every leaf key that differs."""
    old, new = _flat(saved), _flat(current)
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}


def check_resume_config(saved_path: str, current: dict[str, Any], allow_change: bool) -> list[str]:
    """Lines naming each key changed since the run's saved ``config.yaml``; a ``RunDirError`` when one changes
    the model or the data order (``RESUME_FIXED``) unless ``allow_change``."""
    import yaml

    if not os.path.isfile(saved_path):
        return []
    with open(saved_path, encoding="utf-8") as fh:
        saved = yaml.safe_load(fh) or {}
    changes = {k: v for k, v in config_changes(saved, current).items() if k != "trainer.run_dir"}
    lines = [f"{k}: {old!r} -> {new!r}" for k, (old, new) in changes.items()]
    fixed = [k for k in changes if any(k == p or k.startswith(p + ".") for p in RESUME_FIXED)]
    if fixed and not allow_change:
        raise RunDirError(f"resuming {os.path.dirname(saved_path)} with a config that changes the model or the data "
                          f"order: {'; '.join(line for line in lines if line.split(':')[0] in fixed)}. Set "
                          f"trainer.allow_config_change=true to resume anyway, or start a new run_dir")
    return lines
