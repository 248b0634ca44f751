"""The run's failure classes and their exit codes: one table, used by ``launch/*.py`` and the trainer.

Every error a user can cause or meet (a bad config, a data file, a damaged checkpoint, a dead or hung worker, a
run whose numbers went non-finite) leaves the process through one path with one clear message and the exit
status below; the full traceback goes to the run's log file. ``RunError`` subclasses carry their class's code;
errors raised by lower layers under their own names are mapped to a code where the run catches them.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit status per class of outcome (documented in docs/RELIABILITY.md and ``train.py --help``)."""

    OK = 0
    INTERNAL = 1  # an unexpected error: a bug (please report it with the log file)
    CONFIG = 2  # bad configuration, or a machine that cannot run it
    DYNAMIC_SAMPLING = 3  # dynamic sampling found too few informative prompts
    DATA = 4  # a missing, empty or malformed data file or row; a scorer that cannot score a row
    CHECKPOINT = 5  # no usable checkpoint to resume from, or a checkpoint that cannot be written
    WORKER = 6  # a worker process died, raised, or did not answer within trainer.worker_timeout_s
    NON_FINITE = 7  # trainer.max_nonfinite_steps consecutive updates skipped for non-finite numbers
    USER_CODE = 8  # an exception inside the user's own --import'ed code (an estimator, a loss, a loop, ...)
    PREEMPTED = 75  # stopped by SIGTERM / Ctrl-C after saving a checkpoint: run the same command to resume
    INTERRUPTED = 130  # a second Ctrl-C: stopped at once, without a checkpoint


class RunError(RuntimeError):
    """An error that ends a run with a documented exit status; the message is what the user sees."""

    exit_code: ExitCode = ExitCode.INTERNAL


class NonFiniteError(RunError):
    """A NaN or infinite number where training needs a finite one: a scorer's reward, or updates skipped for a
    non-finite loss or gradient norm ``trainer.max_nonfinite_steps`` steps in a row."""

    exit_code = ExitCode.NON_FINITE


class ScorerError(RunError):
    """A reward scorer (a user's ``custom_reward_function`` or a built-in) raised on a response; the message names
    the response's row in the batch, its data source and ground truth; the scorer's traceback is chained."""

    exit_code = ExitCode.DATA
