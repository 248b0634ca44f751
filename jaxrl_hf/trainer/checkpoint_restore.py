"""Restore the newest checkpoint that restores, not only the newest that passes its checksums.

A checkpoint can pass its completion marker and checksums and still fail to restore: a file damaged before the
marker was (re)written, a trainer state that does not parse, or orbax refusing a state whose structure or shapes
differ from the one this run builds. ``restore_newest`` then warns naming the checkpoint and the error and tries
the previous one (checked against its marker first); when none restores it stops (``CheckpointError``, exit 5)
naming every checkpoint tried and why.

A restore that fails because the *config* changed the model fails for every checkpoint alike, so it is not
reported as damage: when a model key changed since the run's ``config.yaml`` and the worker says the state does
not match, the run stops at once saying so; when every checkpoint fails with a state mismatch, the message says
that this is what a changed model or optimizer does. A worker that dies or hangs while restoring is a worker
failure (exit 6), not a checkpoint's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence

from jaxrl_hf.controller import ControllerError, WorkerMethodError
from jaxrl_hf.trainer.checkpointing import CheckpointError, CheckpointManager, verify

logger = logging.getLogger(__name__)

MISMATCH_MARKS = ("does not match this worker's state structure", "was written by role", "is from --algo")
"""Phrases of a restore error that says the saved state is of another model, role or algorithm (not damage)."""
MODEL_KEY_PREFIXES = ("algo", "model")
"""Config keys whose change builds another state than the checkpoints hold (with ``trainer.allow_config_change``)."""
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception): ")
_RESTORE_ERRORS = (CheckpointError, WorkerMethodError, ValueError, KeyError, TypeError, OSError)
"""What a restore of a bad checkpoint raises (a remote worker's error arrives as ``WorkerMethodError``)."""


def model_changes(changed_lines: Sequence[str]) -> list[str]:
    """The lines of ``run_dir.check_resume_config`` (``key: old -> new``) whose key changes the saved state."""
    keys = [(line, line.split(":", 1)[0]) for line in changed_lines]
    return [line for line, key in keys if any(key == p or key.startswith(p + ".") for p in MODEL_KEY_PREFIXES)]


def restore_error_text(err: BaseException) -> str:
    """One line saying why a restore failed: for a worker's error the deepest specific exception line of its
    remote traceback (orbax wraps the cause in a bare ``Exception`` with a page of tensorstore spec)."""
    if isinstance(err, WorkerMethodError):
        lines = [ln.strip() for ln in err.remote_traceback.splitlines() if _ERROR_LINE.match(ln.strip())]
        specific = [ln for ln in lines if not ln.startswith("Exception: ")]
        text = (specific or lines or [err.remote_type])[-1]
        text = f"role {err.role!r} rank {err.rank} {err.method}: {text}"
    else:
        text = f"{type(err).__name__}: {err}"
    text = " ".join(text.split())
    return text if len(text) <= 400 else text[:397] + "..."


def is_state_mismatch(reason: str) -> bool:
    """Whether a restore error says the saved state belongs to another model, role or algorithm."""
    return any(mark in reason for mark in MISMATCH_MARKS)


def restore_newest(ckpt: CheckpointManager, first: str, restore: Callable[[str], None], *, fallback: bool = True,
                   changed_model: Sequence[str] = ()) -> str:
    """Restore ``first`` (a checkpoint that passed ``verify``) with ``restore(path)``; when that fails and
    ``fallback``, each older checkpoint of ``ckpt`` in turn. Returns the path restored.

    ``changed_model``: the config changes since the checkpoints were written that change the saved state
    (``model_changes``). Raises ``CheckpointError`` naming every checkpoint tried and why when none restores.
    """
    tried: list[tuple[str, str]] = []
    candidates = [first, *ckpt.older_than(first)] if fallback else [first]
    for path in candidates:
        problem = None if path == first else verify(path)
        if problem is None:
            try:
                restore(path)
            except ControllerError as err:
                if not isinstance(err, WorkerMethodError):
                    raise  # a worker died or hung while restoring: a worker failure, not this checkpoint's
                problem = restore_error_text(err)
            except _RESTORE_ERRORS as err:
                problem = restore_error_text(err)
            else:
                if tried:
                    logger.warning("resumed from %s, the newest checkpoint that restores (%d newer not usable)",
                                   path, len(tried))
                return path
            if changed_model and is_state_mismatch(problem):
                raise CheckpointError(_config_changed_message(path, problem, changed_model))
            problem = f"restore failed: {problem}"
        tried.append((path, problem))
        if path != candidates[-1]:
            logger.warning("checkpoint %s is not usable (%s); trying the previous one", path, problem)
    raise CheckpointError(_none_restored_message(tried, changed_model))


def _config_changed_message(path: str, problem: str, changed_model: Sequence[str]) -> str:
    return (f"cannot resume: the config changed the model since the checkpoints were written "
            f"({'; '.join(changed_model)}), and {path} holds the old model's state ({problem}). This is not "
            f"damage: every checkpoint of this run holds that state, so the older ones were not tried. Resume with "
            f"the settings of the run's config.yaml, or start a new trainer.run_dir")


def _none_restored_message(tried: Sequence[tuple[str, str]], changed_model: Sequence[str]) -> str:
    listing = "\n  ".join(f"{path}: {why}" for path, why in tried)
    restored = [why for _, why in tried if why.startswith("restore failed")]
    if restored and all(is_state_mismatch(why) for why in restored):
        cause = (f"the config changed the model ({'; '.join(changed_model)})" if changed_model else
                 "no model key of config.yaml changed, so a changed default or code version")
        return (f"no checkpoint restores, and every one that passed its checksums fails alike: its saved state does "
                f"not match the state this run builds. That is what a change of the model, its shapes or the "
                f"optimizer does, not damage ({cause}):\n  {listing}\nresume with the settings and version that "
                f"wrote these checkpoints, or start a new trainer.run_dir")
    return (f"no checkpoint to resume from restores:\n  {listing}\nmove the run directory aside for a fresh start, "
            f"or trainer.resume_mode=disable")
