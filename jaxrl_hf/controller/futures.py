"""Futures of worker-group calls, and how a consumer worker resolves them without the driver.

A non-blocking call returns a `GroupFuture`: one Ray ``ObjectRef`` per rank plus the protocol's
collect rule. Passing it to another group's method does not fetch anything on the driver: the
dispatch turns it into a *deferred argument* (`DeferredValue`, `DeferredChunk`) that names the
producer's ObjectRefs and the collect rule as a `Plan`; each consumer rank resolves its own part inside
its process (HybridFlow §2.4, "futures"). On one node the arrays arrive zero-copy from Ray's shared
object store and a consumer copies only the rows it needs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from jaxrl_hf.controller.batch import PAD_ROWS_KEY, Batch
from jaxrl_hf.controller.errors import ControllerError, WorkerDiedError, WorkerMethodError
from jaxrl_hf.controller.layout import GroupLayout

if TYPE_CHECKING:
    from jaxrl_hf.controller.protocols import Protocol


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


def _gather_rows(batches: Sequence[Batch], start: int, stop: int) -> Batch:
    """Rows ``[start, stop)`` of the virtual concat of ``batches`` padded cyclically with its first
    rows (`Batch.pad_to_divisor`); only these rows are copied (a single run is a view)."""
    lengths = np.array([len(b) for b in batches])
    total = int(lengths.sum())
    if total == 0:
        raise ValueError("cannot split an empty Batch produced by a future")
    rows = np.arange(start, stop)
    rows = np.where(rows < total, rows, (rows - total) % total)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    source = np.searchsorted(offsets, rows, side="right") - 1
    local = rows - offsets[source]
    breaks = np.flatnonzero((np.diff(source) != 0) | (np.diff(local) != 1)) + 1
    pieces = [
        batches[int(source[run[0]])][int(local[run[0]]) : int(local[run[-1]]) + 1]
        for run in np.split(np.arange(len(rows)), breaks)
        if run.size
    ]
    return pieces[0] if len(pieces) == 1 else Batch.concat(pieces, meta_conflict="first")


@dataclass(frozen=True)
class Plan:
    """How a future's per-rank outputs combine into its value; resolvable in any process."""

    refs: tuple[ray.ObjectRef, ...]

    def fetch(self) -> list[Any]:
        """The producer ranks' outputs (zero-copy for numpy arrays on the same node)."""
        return ray.get(list(self.refs))

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
        outputs = self.fetch()
        if not all(isinstance(o, Batch) for o in outputs):
            kinds = sorted({type(o).__name__ for o in outputs})
            raise TypeError(f"a DP protocol can only split Batch outputs, the future holds {kinds}")
        start, stop, pad = chunk_bounds(sum(len(o) for o in outputs), index, count)
        return _gather_rows(outputs, start, stop), pad


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


def _describe_failure(err: Exception, pool: str, role: str, rank: int, method: str) -> Exception:
    """Driver-side exception for a failed rank, naming pool, role, rank and method."""
    if isinstance(err, ray.exceptions.RayActorError):
        return WorkerDiedError(pool, role, rank, method, str(err).strip().splitlines()[0])
    if isinstance(err, ray.exceptions.RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, WorkerMethodError):  # rebuilt: Ray's wrapper mixes in its own text
            return WorkerMethodError(
                cause.role, cause.rank, cause.method, cause.remote_type, cause.remote_traceback
            )
        if isinstance(cause, ray.exceptions.RayActorError):
            return WorkerDiedError(pool, role, rank, method, str(cause).strip().splitlines()[0])
        return WorkerMethodError(role, rank, method, type(cause or err).__name__, str(err))
    return ControllerError(f"pool {pool!r} role {role!r} rank {rank} method {method!r}: {err!r}")


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
    still blocked (e.g. in a collective waiting for the dead one).
    """
    results: list[Any] = [None] * len(refs)
    pending = {ref: rank for rank, ref in enumerate(refs)}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while pending:
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=remaining)
        if not ready:
            raise TimeoutError(
                f"pool {pool!r} role {role!r} method {method!r}: ranks {sorted(pending.values())} "
                f"did not finish within {timeout_s} s"
            )
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
        refs: Sequence[ray.ObjectRef],
        protocol: Protocol,
        layout: GroupLayout,
        method: str,
        on_death: Callable[[WorkerDiedError], None] | None = None,
    ):
        self.refs = tuple(refs)
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
        return self.protocol.make_plan(self.layout, self.refs)

    def __repr__(self) -> str:
        return f"GroupFuture({self.source}, ranks={len(self.refs)}, done={self.done()})"
