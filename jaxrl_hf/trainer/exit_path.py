"""The one way a run ends on an error: one clear message on screen, the traceback in ``<run_dir>/error.log``, and
the exit status of the error's class (``jaxrl_hf.errors.ExitCode``; the table is in docs/RELIABILITY.md)."""

from __future__ import annotations

import datetime
import os
import sys
import traceback
from typing import TextIO

from jaxrl_hf.config import ConfigError
from jaxrl_hf.controller import ControllerError, WorkerMethodError
from jaxrl_hf.data.schema import DatasetRowError
from jaxrl_hf.errors import ExitCode, RunError
from jaxrl_hf.trainer.dynamic_sampling import DynamicSamplingError
from jaxrl_hf.trainer.preflight import PreflightError
from jaxrl_hf.user_modules import UserCodeError, UserModuleError, user_frame

ERROR_LOG = "error.log"
_REMOTE_CLASSES = {"WorkerConfigError": ExitCode.CONFIG, "ConfigError": ExitCode.CONFIG,
                   "DatasetRowError": ExitCode.DATA, "PreferencePairError": ExitCode.DATA,
                   "UserCodeError": ExitCode.USER_CODE}
"""A worker method's error, known by the remote exception's class name."""


def exit_code_of(err: BaseException) -> ExitCode:
    """The class of failure ``err`` belongs to."""
    if isinstance(err, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(err, RunError):
        return err.exit_code
    if isinstance(err, (ConfigError, PreflightError, UserModuleError)):
        return ExitCode.CONFIG
    if isinstance(err, DynamicSamplingError):
        return ExitCode.DYNAMIC_SAMPLING
    if isinstance(err, (DatasetRowError, FileNotFoundError)):
        return ExitCode.DATA
    if isinstance(err, WorkerMethodError):
        return _REMOTE_CLASSES.get(err.remote_type, ExitCode.WORKER)
    if isinstance(err, ControllerError):
        return ExitCode.WORKER
    if isinstance(err, UserCodeError) or user_frame(err) is not None:
        return ExitCode.USER_CODE
    return ExitCode.INTERNAL


def headline(err: BaseException) -> str:
    """What the user reads: the error's own message; for a worker's error its last traceback line (the rest is in
    the log), for an unexpected one its type too."""
    if isinstance(err, WorkerMethodError):
        last = [ln for ln in err.remote_traceback.strip().splitlines() if ln.strip()][-1:] or [err.remote_type]
        return f"role {err.role!r} rank {err.rank} method {err.method!r} failed: {last[0].strip()}"
    text = str(err).strip() or type(err).__name__
    if not isinstance(err, UserCodeError) and user_frame(err) is not None:  # raised in the user's code, unwrapped
        return f"your code raised {type(err).__name__} at {user_frame(err)}: {text}"
    return text if exit_code_of(err) != ExitCode.INTERNAL else f"{type(err).__name__}: {text}"


def write_error_log(err: BaseException, run_dir: str | None) -> str | None:
    """Append the full traceback to ``<run_dir>/error.log``; returns its path (None when it cannot be written)."""
    if not run_dir:
        return None
    path = os.path.join(run_dir, ERROR_LOG)
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"=== {datetime.datetime.now().isoformat(timespec='seconds')} pid {os.getpid()} "
                     f"exit {int(exit_code_of(err))} ({exit_code_of(err).name})\n")
            fh.write("".join(traceback.format_exception(type(err), err, err.__traceback__)))
            if isinstance(err, WorkerMethodError):
                fh.write(f"remote traceback ({err.role} rank {err.rank} {err.method}):\n{err.remote_traceback}\n")
    except OSError:
        return None
    return path


def report(err: BaseException, run_dir: str | None, stream: TextIO | None = None) -> int:
    """Print one message for ``err`` (where its traceback went) and return its exit status."""
    stream = stream or sys.stderr
    code = exit_code_of(err)
    log = write_error_log(err, run_dir)
    where = f" (traceback: {log})" if log else ""
    if log is None and code == ExitCode.INTERNAL:
        traceback.print_exception(type(err), err, err.__traceback__, file=stream)  # nowhere else to keep it
    stream.write(f"jaxrl_hf: {headline(err)}{where}\n")
    if code == ExitCode.INTERNAL:
        stream.write("jaxrl_hf: this is a bug, not a setting: please report it with that log\n")
    stream.flush()
    return int(code)
