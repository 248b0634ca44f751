"""Transfer protocols and the `@register` decorator (HybridFlow §2.4, Table 2).

A protocol is a *dispatch* function — how the driver turns one call's arguments into one call per
rank — and a *collect* function — how the per-rank outputs become the caller's result:

``dispatch_fn(layout: GroupLayout, args: tuple, kwargs: dict) -> list[RankCall]`` (one per rank)
``collect_fn(layout: GroupLayout, outputs: list) -> Any`` (outputs in rank order)

Built in (`Dispatch`):

* ``ONE_TO_ALL``   every rank gets the same arguments; result = list of per-rank outputs.
* ``ALL_TO_ALL``   every argument is a list with one element per rank; result = list of outputs.
* ``DP_COMPUTE``   Batch arguments are padded to a multiple of the process count and split by rank,
  other arguments replicated; result = the outputs concatenated (padding rows removed).
* ``DP_COMPUTE_METRIC`` split like DP_COMPUTE; result = list of per-rank outputs (e.g. metric dicts).
* ``MESH_DP`` (alias ``MESH_3D``, the paper's 3D_PROTO) split by each process's dp rank on the
  role's mesh, replicated across tp/pp; result = outputs of tp rank 0 / last pp stage, in dp order.

Dispatched Batch chunks carry ``meta_info["pad_rows"]`` (`PAD_ROWS_KEY`): how many of their
trailing rows are padding. The worker process drops the matching rows from a Batch output (a
method may return ``k`` rows per input row, e.g. ``n`` samples per prompt, interleaved).
Users add protocols with ``@register(dispatch=(my_dispatch_fn, my_collect_fn))``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxrl_hf.controller.batch import PAD_ROWS_KEY, Batch
from jaxrl_hf.controller.futures import (
    CollectPlan,
    ConcatPlan,
    DeferredChunk,
    DeferredValue,
    GroupFuture,
    ListPlan,
    Plan,
    RankRef,
    chunk_bounds,
    concat_outputs,
)
from jaxrl_hf.controller.layout import GroupLayout

REGISTRATION_ATTR = "__jaxrl_hf_registration__"


@dataclass(frozen=True)
class RankCall:
    """The arguments one rank receives. ``pad_rows``: padding rows in its Batch arguments."""

    args: tuple
    kwargs: dict = field(default_factory=dict)
    pad_rows: int = 0


DispatchFn = Callable[[GroupLayout, tuple, dict], Sequence[RankCall]]
CollectFn = Callable[[GroupLayout, list], Any]


@dataclass(frozen=True)
class Protocol:
    """A named (dispatch, collect) pair.

    ``plan_fn(layout, refs)`` expresses the collect rule as a `Plan` a consumer worker can run, so a
    future of this protocol can be passed on without the driver fetching it. ``accepts_futures``:
    the dispatch handles `GroupFuture` arguments itself; otherwise the driver fetches them first.
    """

    name: str
    dispatch_fn: DispatchFn
    collect_fn: CollectFn
    plan_fn: Callable[[GroupLayout, Sequence[RankRef]], Plan] | None = None
    accepts_futures: bool = False

    def make_plan(self, layout: GroupLayout, refs: Sequence[RankRef]) -> Plan:
        """The collect rule as a `Plan` over the producer ranks' outputs."""
        if self.plan_fn is not None:
            return self.plan_fn(layout, refs)
        return CollectPlan(tuple(refs), self.collect_fn, layout)

    def dispatch(self, layout: GroupLayout, args: tuple, kwargs: dict) -> list[RankCall]:
        """Run the dispatch function and check it produced one `RankCall` per rank."""
        calls = list(self.dispatch_fn(layout, args, kwargs))
        if len(calls) != layout.world_size or not all(isinstance(c, RankCall) for c in calls):
            raise ValueError(
                f"protocol {self.name!r} dispatched {len(calls)} calls for role {layout.role!r} with "
                f"{layout.world_size} ranks; a dispatch_fn must return one RankCall per rank"
            )
        return calls


# ---------------------------------------------------------------------- ONE_TO_ALL / ALL_TO_ALL
def _defer_whole(value: Any) -> Any:
    return DeferredValue(value.plan(), value.source) if isinstance(value, GroupFuture) else value


def dispatch_one_to_all(layout: GroupLayout, args: tuple, kwargs: dict) -> list[RankCall]:
    """Every rank gets the same arguments (one shared RankCall, serialised once)."""
    call = RankCall(tuple(_defer_whole(a) for a in args), {k: _defer_whole(v) for k, v in kwargs.items()})
    return [call] * layout.world_size


def _per_rank(value: Any, name: str, layout: GroupLayout) -> list[Any]:
    if isinstance(value, GroupFuture):
        if len(value.refs) != layout.world_size:
            raise ValueError(
                f"ALL_TO_ALL argument {name} is a future of {len(value.refs)} ranks ({value.source}) "
                f"but role {layout.role!r} has {layout.world_size}"
            )
        return list(value.refs)  # rank i receives producer rank i's output (a top-level ObjectRef)
    if not isinstance(value, (list, tuple)) or len(value) != layout.world_size:
        raise ValueError(
            f"ALL_TO_ALL argument {name} must be a list with one element per rank "
            f"({layout.world_size} for role {layout.role!r}), got {type(value).__name__}"
            + (f" of length {len(value)}" if isinstance(value, (list, tuple)) else "")
        )
    return list(value)


def dispatch_all_to_all(layout: GroupLayout, args: tuple, kwargs: dict) -> list[RankCall]:
    """Rank ``i`` gets element ``i`` of every argument."""
    per_args = [_per_rank(a, f"#{i}", layout) for i, a in enumerate(args)]
    per_kwargs = {k: _per_rank(v, repr(k), layout) for k, v in kwargs.items()}
    return [
        RankCall(tuple(a[r] for a in per_args), {k: v[r] for k, v in per_kwargs.items()})
        for r in range(layout.world_size)
    ]


def collect_list(layout: GroupLayout, outputs: list) -> list:
    """Per-rank outputs as a list in rank order."""
    return list(outputs)


# ---------------------------------------------------------------------- data-parallel splitting
def split_batches(
    args: tuple, kwargs: dict, num_chunks: int, chunk_of_rank: Sequence[int]
) -> list[RankCall]:
    """Pad every Batch argument to a multiple of ``num_chunks``, split it, and give rank ``r`` chunk
    ``chunk_of_rank[r]``; futures become `DeferredChunk`s; other arguments are replicated."""
    lengths = {}
    for name, value in [*((f"#{i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if isinstance(value, Batch):
            lengths[name] = len(value)
    if len(set(lengths.values())) > 1:
        raise ValueError(f"DP dispatch: Batch arguments have different lengths {lengths}")
    total = next(iter(lengths.values()), None)
    if total == 0:
        raise ValueError("DP dispatch: cannot split an empty Batch")

    def chunks_of(value: Any) -> list[Any] | None:
        if isinstance(value, GroupFuture):
            plan = value.plan()
            return [DeferredChunk(plan, i, num_chunks, value.source) for i in range(num_chunks)]
        if not isinstance(value, Batch):
            return None
        padded, _ = value.pad_to_divisor(num_chunks)
        pieces = padded.chunk(num_chunks)
        return [
            Batch(p.arrays, p.objects, {**p.meta_info, PAD_ROWS_KEY: chunk_bounds(total, i, num_chunks)[2]})
            for i, p in enumerate(pieces)
        ]

    split_args = [chunks_of(a) for a in args]
    split_kwargs = {k: chunks_of(v) for k, v in kwargs.items()}
    per_chunk = []
    for i in range(num_chunks):
        per_chunk.append(
            RankCall(
                tuple(a if s is None else s[i] for a, s in zip(args, split_args)),
                {k: kwargs[k] if s is None else s[i] for k, s in split_kwargs.items()},
                0 if total is None else chunk_bounds(total, i, num_chunks)[2],
            )
        )
    return [per_chunk[c] for c in chunk_of_rank]


def dispatch_dp_compute(layout: GroupLayout, args: tuple, kwargs: dict) -> list[RankCall]:
    """Split Batch arguments into one chunk per process, by process rank."""
    return split_batches(args, kwargs, layout.world_size, range(layout.world_size))


def collect_dp_compute(layout: GroupLayout, outputs: list) -> Any:
    """Concatenate Batch outputs in rank order (a list for non-Batch outputs)."""
    return concat_outputs(outputs)


def dispatch_mesh_dp(layout: GroupLayout, args: tuple, kwargs: dict) -> list[RankCall]:
    """Split Batch arguments by each process's dp rank; replicate across tp and pp."""
    return split_batches(args, kwargs, layout.dp_size, [c.dp_rank for c in layout.coords])


def collect_mesh_dp(layout: GroupLayout, outputs: list) -> Any:
    """Concatenate the outputs of tp rank 0 / last pp stage, in dp order."""
    return concat_outputs([outputs[r] for r in layout.collect_ranks()])


def _all_refs_concat(layout: GroupLayout, refs: Sequence[RankRef]) -> Plan:
    return ConcatPlan(tuple(refs))


def _all_refs_list(layout: GroupLayout, refs: Sequence[RankRef]) -> Plan:
    return ListPlan(tuple(refs))


def _mesh_refs_concat(layout: GroupLayout, refs: Sequence[RankRef]) -> Plan:
    return ConcatPlan(tuple(refs[r] for r in layout.collect_ranks()))


class Dispatch(enum.Enum):
    """Built-in transfer protocols (see the module docstring)."""

    ONE_TO_ALL = "ONE_TO_ALL"
    ALL_TO_ALL = "ALL_TO_ALL"
    DP_COMPUTE = "DP_COMPUTE"
    DP_COMPUTE_METRIC = "DP_COMPUTE_METRIC"
    MESH_DP = "MESH_DP"
    MESH_3D = "MESH_DP"  # alias: the paper's 3D_PROTO

    @property
    def protocol(self) -> Protocol:
        """The `Protocol` behind this name."""
        return BUILTIN_PROTOCOLS[self.value]


BUILTIN_PROTOCOLS: dict[str, Protocol] = {
    "ONE_TO_ALL": Protocol("ONE_TO_ALL", dispatch_one_to_all, collect_list, _all_refs_list, True),
    "ALL_TO_ALL": Protocol("ALL_TO_ALL", dispatch_all_to_all, collect_list, _all_refs_list, True),
    "DP_COMPUTE": Protocol("DP_COMPUTE", dispatch_dp_compute, collect_dp_compute, _all_refs_concat, True),
    "DP_COMPUTE_METRIC": Protocol(
        "DP_COMPUTE_METRIC", dispatch_dp_compute, collect_list, _all_refs_list, True
    ),
    "MESH_DP": Protocol("MESH_DP", dispatch_mesh_dp, collect_mesh_dp, _mesh_refs_concat, True),
}


def as_protocol(dispatch: Dispatch | Protocol | tuple | str) -> Protocol:
    """Normalise what `register` accepts into a `Protocol`."""
    if isinstance(dispatch, Protocol):
        return dispatch
    if isinstance(dispatch, Dispatch):
        return dispatch.protocol
    if isinstance(dispatch, str) and dispatch in BUILTIN_PROTOCOLS:
        return BUILTIN_PROTOCOLS[dispatch]
    if isinstance(dispatch, tuple) and len(dispatch) == 2 and all(callable(f) for f in dispatch):
        dispatch_fn, collect_fn = dispatch
        name = f"custom({getattr(dispatch_fn, '__name__', '?')}, {getattr(collect_fn, '__name__', '?')})"
        return Protocol(name, dispatch_fn, collect_fn)
    raise ValueError(
        f"unknown dispatch {dispatch!r}; valid: {sorted(BUILTIN_PROTOCOLS)} (or Dispatch.<name>), a "
        "Protocol, or a (dispatch_fn, collect_fn) pair"
    )


@dataclass(frozen=True)
class Registration:
    """What `register` attaches to a worker method."""

    protocol: Protocol
    blocking: bool


def register(
    fn: Callable | None = None, *, dispatch: Dispatch | Protocol | tuple | str = Dispatch.ONE_TO_ALL,
    blocking: bool = True,
) -> Callable:
    """Mark a `Worker` method as callable from a `WorkerGroup` with a transfer protocol.

    ``blocking=False`` makes the group call return a `GroupFuture` at once. Usable bare
    (``@register``, ONE_TO_ALL, blocking) or with arguments.
    """
    if not isinstance(blocking, bool):
        raise TypeError(f"register(blocking=...) must be a bool, got {blocking!r}")
    if fn is not None and not callable(fn) or isinstance(fn, (Dispatch, Protocol)):
        dispatch, fn = fn, None  # register(Dispatch.X) written positionally
    protocol = as_protocol(dispatch)

    def mark(method: Callable) -> Callable:
        if not callable(method):
            raise TypeError(f"@register decorates methods, got {method!r}")
        setattr(method, REGISTRATION_ATTR, Registration(protocol, blocking))
        return method

    return mark(fn) if fn is not None else mark


def registered_methods(worker_cls: type) -> dict[str, Registration]:
    """``{method name: Registration}`` for every registered method of ``worker_cls`` (incl. bases)."""
    found = {}
    for name in dir(worker_cls):
        registration = getattr(getattr(worker_cls, name, None), REGISTRATION_ATTR, None)
        if isinstance(registration, Registration):
            found[name] = registration
    return found
