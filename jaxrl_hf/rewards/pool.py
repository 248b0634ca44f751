"""Scoring many responses: serially in this process, or batched over a pool of worker processes.

Both paths bound every score in time (``timeouts.time_limit``, armed in the worker's main thread) and
turn a timed-out score into 0 with a logged warning. The pool adds an outer deadline for hangs that a
signal cannot interrupt (one long C call that never checks for signals): when it passes, the pool is terminated and the unfinished
responses are rescored one per task in a fresh pool, so a single pathological response cannot take
its neighbours' scores with it; what still does not finish scores 0, with a warning.

Workers are started with ``spawn`` (forking a process that runs JAX threads is unsafe) and import only
``jaxrl_hf.rewards``, never JAX.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxrl_hf.errors import ScorerError
from jaxrl_hf.rewards.dispatch import ScoreFnSpec
from jaxrl_hf.rewards.timeouts import ScoreTimeout, can_arm_timer, time_limit

logger = logging.getLogger(__name__)

ScoreTask = tuple[str, str, Any, "Mapping | None"]
"""(data_source, solution_str, ground_truth, extra_info) of one response."""

_OUTER_GRACE_S = 2.0
_WORKER_START_TIMEOUT_S = 300.0


def timed_out_result(timeout_s: float, task: ScoreTask, where: str) -> dict:
    """The result recorded for a response whose score did not finish in time: score 0, with a warning."""
    logger.warning(
        "reward score of a %s response (%d chars) exceeded %.3g s (%s); scored 0",
        task[0], len(task[1]), timeout_s, where,
    )
    return {"score": 0.0, "acc": False, "pred": "", "timed_out": True}


def score_one(fn: Callable[..., dict], task: ScoreTask, timeout_s: float | None, row: int | None = None) -> dict:
    """Score one task with ``fn`` under ``time_limit(timeout_s)``; a timeout scores 0 (``timed_out``). A scorer
    that raises stops the run: ``ScorerError`` naming ``row`` (its index in the scored batch), the data source and
    the ground truth, with the scorer's own exception chained (its traceback goes to the run's error.log)."""
    try:
        with time_limit(timeout_s):
            result = fn(*task)
    except ScoreTimeout:
        return timed_out_result(timeout_s or 0.0, task, "time limit")
    except Exception as err:
        raise ScorerError(f"the reward scorer raised {type(err).__name__}: {err} on row {row} of the scored batch "
                          f"(data_source={task[0]!r}, ground_truth={task[2]!r}, response ending "
                          f"{task[1][-120:]!r})") from err
    result.setdefault("timed_out", False)
    return result


class SerialScorer:
    """Scores in the calling process; the time bound holds in the main thread only."""

    def __init__(self, spec: ScoreFnSpec, timeout_s: float | None = 10.0) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self._fn = spec.resolve()
        self._warned_unarmed = False

    def score(self, tasks: Sequence[ScoreTask]) -> list[dict]:
        """One result dict per task, in order."""
        if self.timeout_s and not can_arm_timer() and not self._warned_unarmed:
            self._warned_unarmed = True
            logger.warning(
                "serial reward scoring off the main thread (%s): per-score time limits cannot be armed;"
                " use num_workers > 0 for bounded scoring", threading.current_thread().name,
            )
        return [score_one(self._fn, task, self.timeout_s, row) for row, task in enumerate(tasks)]

    def close(self) -> None:
        """Nothing to release."""


# ---- worker side (module-level so spawned workers can import them) ----
_WORKER_FN: Callable[..., dict] | None = None


def _init_worker(spec: ScoreFnSpec) -> None:
    global _WORKER_FN
    _WORKER_FN = spec.resolve()


def _worker_ready() -> bool:
    return _WORKER_FN is not None


def _score_chunk(rows: list[int], tasks: list[ScoreTask], timeout_s: float | None) -> list[dict]:
    assert _WORKER_FN is not None, "worker not initialised"
    return [score_one(_WORKER_FN, task, timeout_s, row) for row, task in zip(rows, tasks)]


class PoolScorer:
    """Scores batches on ``num_workers`` spawned processes (chunks of ``chunk_size`` responses per message)."""

    def __init__(self, spec: ScoreFnSpec, num_workers: int, timeout_s: float = 10.0, chunk_size: int | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"reward num_workers must be >= 1 for the process pool, got {num_workers}")
        if timeout_s is None or timeout_s <= 0:
            raise ValueError(f"the reward process pool needs a positive timeout_s, got {timeout_s}")
        self.spec = spec
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.chunk_size = chunk_size
        self._pool: Any = None

    def _ensure_pool(self):
        """The pool, started if needed and waited for until a worker has run its initializer (imports, the
        scorer's warm-up), so that no score's deadline pays for a process start."""
        if self._pool is None:
            ctx = mp.get_context("spawn")
            self._pool = ctx.Pool(self.num_workers, initializer=_init_worker, initargs=(self.spec,))
            try:
                self._pool.apply_async(_worker_ready).get(timeout=_WORKER_START_TIMEOUT_S)
            except mp.TimeoutError:
                self._terminate()
                raise RuntimeError(f"reward pool: no scoring worker started within {_WORKER_START_TIMEOUT_S:g} s")
        return self._pool

    def _terminate(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def _run(self, chunks: list[list[int]], tasks: Sequence[ScoreTask], results: list[dict | None]) -> list[list[int]]:
        """Run ``chunks`` (lists of task indices); fill ``results``; return the chunks that missed the deadline."""
        pool = self._ensure_pool()
        pending = [(c, pool.apply_async(_score_chunk, (c, [tasks[i] for i in c], self.timeout_s))) for c in chunks]
        waves = math.ceil(sum(len(c) for c in chunks) / self.num_workers)
        deadline = time.monotonic() + self.timeout_s * max(waves, 1) + _OUTER_GRACE_S
        missed: list[list[int]] = []
        for chunk, handle in pending:
            try:
                out = handle.get(timeout=max(deadline - time.monotonic(), 0.01))
            except mp.TimeoutError:
                missed.append(chunk)
                continue
            for i, r in zip(chunk, out):
                results[i] = r
        return missed

    def score(self, tasks: Sequence[ScoreTask]) -> list[dict]:
        """One result dict per task, in order; exceptions raised by the scorer propagate."""
        if not tasks:
            return []
        size = self.chunk_size or max(1, math.ceil(len(tasks) / (4 * self.num_workers)))
        chunks = [list(range(s, min(s + size, len(tasks)))) for s in range(0, len(tasks), size)]
        results: list[dict | None] = [None] * len(tasks)
        missed = self._run(chunks, tasks, results)
        if missed:
            self._terminate()
            singles = [[i] for c in missed for i in c]
            logger.warning("reward pool: %d responses missed the deadline; rescoring them one per task", len(singles))
            still = self._run(singles, tasks, results)
            if still:
                self._terminate()
                for (i,) in still:
                    results[i] = timed_out_result(self.timeout_s, tasks[i], "worker did not return; terminated")
        lost = [i for i, r in enumerate(results) if r is None]
        if lost:  # pragma: no cover - every index is filled above
            raise RuntimeError(f"reward pool lost the results of responses {lost}")
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Stop the worker processes."""
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self._terminate()
        except Exception:
            pass


def make_scorer(spec: ScoreFnSpec, num_workers: int = 0, timeout_s: float = 10.0) -> SerialScorer | PoolScorer:
    """``SerialScorer`` for ``num_workers == 0``, else a ``PoolScorer`` with that many processes."""
    if num_workers < 0:
        raise ValueError(f"reward num_workers must be >= 0, got {num_workers}")
    return SerialScorer(spec, timeout_s) if num_workers == 0 else PoolScorer(spec, num_workers, timeout_s)
