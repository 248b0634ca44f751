"""Futures of worker-group calls, and how a consumer worker resolves them without the driver.

A non-blocking call returns a `GroupFuture`: one Ray ``ObjectRef`` per rank (and one for its row
count) plus the protocol's collect rule. Passing it to another group's method does not fetch anything on the driver: the
dispatch turns it into a *deferred argument* (`DeferredValue`, `DeferredChunk`) that names the
producer's ObjectRefs and the collect rule as a `Plan`; each consumer rank resolves its own part inside
its process (HybridFlow §2.4, "futures"). A consumer of a DP split first reads the producers' row
counts, then fetches only the outputs that hold its rows (on one node zero-copy from Ray's shared
object store) and copies only those rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol as StructuralType

import numpy as np

from jaxrl_hf.controller.batch import PAD_ROWS_KEY, Batch
from jaxrl_hf.controller.errors import ControllerError, WorkerDiedError, WorkerMethodError, WorkerTimeoutError
from jaxrl_hf.controller.layout import GroupLayout
from jaxrl_hf.controller.worker_logs import describe_death


class CollectRule(StructuralType):
    """What a `GroupFuture` needs of its transfer protocol (``protocols.Protocol`` is one): how to collect the
    ranks' outputs on the driver, and the same rule as a `Plan` a consumer worker can resolve."""

    def collect_fn(self, layout: GroupLayout, outputs: list) -> Any: ...

    def make_plan(self, layout: GroupLayout, refs: Sequence[RankRef]) -> Plan: ...


def concat_outputs(outputs: Sequence[Any]) -> Any:
    """DP collect rule: Batches are concatenated in order; any other outputs come back as a list."""
    outputs = list(outputs)
    if outputs and all(isinstance(o, Batch) for o in outputs):
        return Batch.concat(outputs)
    return outputs


def chunk_bounds(total: int, index: int, count: int) -> tuple[int, int, int]:
    """Rows ``[start, stop)`` of chunk ``index`` of ``count`` after padding ``total`` rows to a
    multiple of ``count``, and how many of those rows are padding (they sit at the chunk's end)."""
    padded = -(-total // count) * count
    size = padded // count
    start, stop = index * size, (index + 1) * size
    return start, stop, max(0, stop - max(total, start))


def row_runs(lengths: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """Rows ``[start, stop)`` of the concat of sources with ``lengths`` rows, padded cyclically with
    its first rows (`Batch.pad_to_divisor`), as contiguous runs ``(source, first, last + 1)``."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        raise ValueError("cannot split an empty Batch produced by a future")
    rows = np.arange(start, stop)
    rows = np.where(rows < total, rows, (rows - total) % total)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    source = np.searchsorted(offsets, rows, side="right") - 1
    local = rows - offsets[source]
    breaks = np.flatnonzero((np.diff(source) != 0) | (np.diff(local) != 1)) + 1
    return [
        (int(source[run[0]]), int(local[run[0]]), int(local[run[-1]]) + 1)
        for run in np.split(np.arange(len(rows)), breaks)
        if run.size
    ]


def _gather_rows(batches: Sequence[Batch], start: int, stop: int) -> Batch:
    """Rows ``[start, stop)`` (see `row_runs`) of ``batches``; a single run is a view, not a copy."""
    pieces = [batches[s][lo:hi] for s, lo, hi in row_runs([len(b) for b in batches], start, stop)]
    return pieces[0] if len(pieces) == 1 else Batch.concat(pieces, meta_conflict="first")


@dataclass(frozen=True)
class RankRef:
    """One producer rank's output: the data, and its row count (None unless a Batch) as a tiny
    separate object so a consumer can plan which outputs it needs before fetching any."""

    data: ray.ObjectRef
    rows: ray.ObjectRef


@dataclass(frozen=True)
class Plan:
    """How a future's per-rank outputs combine into its value; resolvable in any process."""

    refs: tuple[RankRef, ...]

    def fetch(self) -> list[Any]:
        """The producer ranks' outputs (zero-copy for numpy arrays on the same node)."""
        import ray

        return ray.get([r.data for r in self.refs])

    def resolve(self) -> Any:
        """The future's whole value."""
        raise NotImplementedError

    def resolve_chunk(self, index: int, count: int) -> tuple[Batch, int]:
        """Chunk ``index`` of ``count`` of the (Batch) value after padding, and its padding rows."""
        value = self.resolve()
        if not isinstance(value, Batch):
            raise TypeError(f"a DP protocol can only split a Batch, the future holds {type(value).__name__}")
        start, stop, pad = chunk_bounds(len(value), index, count)
        return _gather_rows([value], start, stop), pad


@dataclass(frozen=True)
class ConcatPlan(Plan):
    """Value = the outputs concatenated (Batches) or listed (anything else): the DP collect rule."""

    def resolve(self) -> Any:
        return concat_outputs(self.fetch())

    def resolve_chunk(self, index: int, count: int) -> tuple[Batch, int]:
        """Fetches the row counts first, then only the outputs holding this chunk's rows."""
        import ray

        lengths = ray.get([r.rows for r in self.refs])
        if any(n is None for n in lengths):
            raise TypeError("a DP protocol can only split Batch outputs; the future holds other values")
        start, stop, pad = chunk_bounds(sum(lengths), index, count)
        runs = row_runs(lengths, start, stop)
        needed = sorted({source for source, _, _ in runs})
        fetched = dict(zip(needed, ray.get([self.refs[s].data for s in needed])))
        pieces = [fetched[source][lo:hi] for source, lo, hi in runs]
        chunk = pieces[0] if len(pieces) == 1 else Batch.concat(pieces, meta_conflict="first")
        return chunk, pad


@dataclass(frozen=True)
class ListPlan(Plan):
    """Value = the list of per-rank outputs (the ONE_TO_ALL / ALL_TO_ALL collect rule)."""

    def resolve(self) -> list[Any]:
        return self.fetch()


@dataclass(frozen=True)
class CollectPlan(Plan):
    """Value = a user collect function applied to the outputs, run in the consumer's process."""

    collect_fn: Callable[[GroupLayout, list[Any]], Any] = None  # type: ignore[assignment]
    layout: GroupLayout | None = None

    def resolve(self) -> Any:
        return self.collect_fn(self.layout, self.fetch())


@dataclass(frozen=True)
class DeferredValue:
    """Argument placeholder: the future's whole value, resolved on the consumer rank."""

    plan: Plan
    source: str


@dataclass(frozen=True)
class DeferredChunk:
    """Argument placeholder: one DP chunk of the future's Batch, resolved on the consumer rank."""

    plan: Plan
    index: int
    count: int
    source: str


def resolve_deferred(value: Any) -> tuple[Any, int]:
    """Replace a deferred argument by its value; returns (value, padding rows it carries)."""
    if isinstance(value, DeferredValue):
        return value.plan.resolve(), 0
    if isinstance(value, DeferredChunk):
        chunk, pad = value.plan.resolve_chunk(value.index, value.count)
        return Batch(chunk.arrays, chunk.objects, {**chunk.meta_info, PAD_ROWS_KEY: pad}), pad
    return value, 0


def _actor_id(err: BaseException) -> str | None:
    """The id of the actor a ``RayActorError`` is about (hex), when Ray says."""
    actor_id = getattr(err, "actor_id", None)
    return actor_id if isinstance(actor_id, str) and actor_id else None


def _describe_failure(err: Exception, pool: str, role: str, rank: int, method: str) -> Exception:
    """Driver-side exception for a failed rank, naming pool, role, rank and method."""
    import ray

    if isinstance(err, ray.exceptions.RayActorError):
        return WorkerDiedError(pool, role, rank, method, describe_death(str(err), actor_id=_actor_id(err)))
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, WorkerMethodError):  # rebuilt: Ray's wrapper mixes in its own text
            return WorkerMethodError(
                cause.role, cause.rank, cause.method, cause.remote_type, cause.remote_traceback
            )
        if isinstance(cause, ray.exceptions.RayActorError):
            return WorkerDiedError(pool, role, rank, method, describe_death(str(cause), actor_id=_actor_id(cause)))
        return WorkerMethodError(role, rank, method, type(cause or err).__name__, str(err))
    return ControllerError(f"pool {pool!r} role {role!r} rank {rank} method {method!r}: {err!r}")


_CALL_TIMEOUT_S: float | None = None
"""Default timeout of every blocking wait on worker results (``set_call_timeout``; None: wait forever)."""


def set_call_timeout(seconds: float | None) -> None:
    """Every later ``gather_results`` without its own timeout waits at most ``seconds`` (the trainer sets
    ``trainer.worker_timeout_s``); ``None`` or 0: no limit."""
    global _CALL_TIMEOUT_S
    _CALL_TIMEOUT_S = float(seconds) if seconds else None


def gather_results(
    refs: Sequence[ray.ObjectRef],
    pool: str,
    role: str,
    method: str,
    timeout_s: float | None = None,
    on_death: Callable[[WorkerDiedError], None] | None = None,
) -> list[Any]:
    """Fetch every rank's output, raising the first failure as soon as it is known.

    A rank that raised, or whose process died, is reported immediately even while other ranks are
    still blocked (e.g. in a collective waiting for the dead one). Ranks that have not answered after
    ``timeout_s`` (default: ``set_call_timeout``'s) are named in a ``WorkerTimeoutError``.
    """
    import ray

    timeout_s = _CALL_TIMEOUT_S if timeout_s is None else timeout_s
    results: list[Any] = [None] * len(refs)
    pending = {ref: rank for rank, ref in enumerate(refs)}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
        if not ready:
            raise WorkerTimeoutError(pool, role, method, sorted(pending.values()), float(timeout_s or 0))
        for ref in ready:
            rank = pending.pop(ref)
            try:
                results[rank] = ray.get(ref)
            except ray.exceptions.RayError as err:
                failure = _describe_failure(err, pool, role, rank, method)
                if isinstance(failure, WorkerDiedError) and on_death is not None:
                    on_death(failure)
                raise failure from None
    return results


class GroupFuture:
    """The pending result of one worker-group call (one ObjectRef per rank).

    `get` fetches and collects on the driver. Passing the future itself as an argument to another
    group's method moves the data worker-to-worker instead.
    """

    def __init__(
        self,
        rank_refs: Sequence[RankRef],
        protocol: CollectRule,
        layout: GroupLayout,
        method: str,
        on_death: Callable[[WorkerDiedError], None] | None = None,
    ):
        self.rank_refs = tuple(rank_refs)
        self.refs = tuple(r.data for r in self.rank_refs)  # per-rank outputs, rank order
        self.protocol = protocol
        self.layout = layout
        self.method = method
        self._on_death = on_death
        self._value: Any = None
        self._has_value = False

    @property
    def source(self) -> str:
        """``role.method`` that produces this future."""
        return f"{self.layout.role}.{self.method}"

    def done(self) -> bool:
        """True once every rank has finished (successfully or not)."""
        import ray

        ready, _ = ray.wait(list(self.refs), num_returns=len(self.refs), timeout=0)
        return len(ready) == len(self.refs)

    def get(self, timeout_s: float | None = None) -> Any:
        """Wait for all ranks and return the collected result (cached after the first call)."""
        if not self._has_value:
            outputs = gather_results(
                self.refs, self.layout.pool, self.layout.role, self.method, timeout_s, self._on_death
            )
            self._value = self.protocol.collect_fn(self.layout, outputs)
            self._has_value = True
        return self._value

    def plan(self) -> Plan:
        """The collect rule as a `Plan` a consumer process can resolve."""
        return self.protocol.make_plan(self.layout, self.rank_refs)

    def __repr__(self) -> str:
        return f"GroupFuture({self.source}, ranks={len(self.refs)}, done={self.done()})"
