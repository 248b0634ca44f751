"""Transition reports read from the compiled programs themselves, plus measured wall time.

`analyze_transition` lowers and compiles each phase of a transition on abstract inputs (no memory
allocated, so it works for models that do not fit here), parses the collectives and their replica
groups out of the compiled HLO (`mesh.hlo_collectives`) and reads XLA's memory analysis:

* ``bytes_per_device``: bytes each device receives, summed over the phases; the reported scalar is
  the maximum over devices (for these layouts every device receives the same amount).
* ``peak_param_bytes_per_device``: the high-water mark of parameter buffers on one device during the
  transition: for each phase, arguments + outputs + XLA temporaries − aliased bytes, plus parameter
  arrays held across the phase without being its arguments (a baseline's kept training shard, the
  leaves a chunked reshard has not reached yet or has finished); maximum over phases.

A chunked reshard (`mesh.chunked_reshard`) is many small phases; phases running the same program (the
layer groups of one leaf) are compiled once. ``analyze_transition(engine, shapes,
engine.training_phases())`` reads the way back.

`time_transition` measures wall time (median of repeats, fresh training params each time, not
timed). `resident_bytes_per_device` counts the parameter bytes each device holds after a transition.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from typing import Any, Callable

import jax

from jaxrl_hf.mesh.device_mesh import flat_device_ids
from jaxrl_hf.mesh.hlo_collectives import CollectiveSummary, summarize
from jaxrl_hf.mesh.hybrid_engine import delete_tree


@dataclasses.dataclass(frozen=True)
class PhaseAnalysis:
    """One compiled program of a transition."""

    name: str
    collectives: CollectiveSummary
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    held_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes + self.held_bytes


@dataclasses.dataclass(frozen=True)
class TransitionAnalysis:
    """Compiled-program view of a whole transition."""

    phases: tuple[PhaseAnalysis, ...]

    @property
    def received_bytes(self) -> dict[int, float]:
        """Bytes received per device id, summed over phases."""
        out: dict[int, float] = {}
        for ph in self.phases:
            for dev, b in ph.collectives.received_bytes.items():
                out[dev] = out.get(dev, 0.0) + b
        return out

    @property
    def bytes_per_device(self) -> float:
        return max(self.received_bytes.values(), default=0.0)

    @property
    def peak_param_bytes_per_device(self) -> int:
        return max(ph.peak_bytes for ph in self.phases)

    @property
    def collective_kinds(self) -> set[str]:
        return set().union(*(ph.collectives.kinds for ph in self.phases))

    def device_groups(self, kind: str | None = None) -> set[tuple[int, ...]]:
        """Replica groups (device ids) of all phases' collectives of ``kind``."""
        return set().union(*(ph.collectives.device_groups(kind) for ph in self.phases))


def _abstract(shardings: Any, shapes: Any) -> Any:
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def compiled_hlo(phase: Any, shapes: Any) -> tuple[str, Any]:
    """(HLO text, memory analysis) of a phase compiled for inputs of ``shapes`` (or for its own abstract
    ``args``: the per-leaf programs of a chunked reshard)."""
    args = getattr(phase, "args", None)
    with warnings.catch_warnings():  # unusable donations: see hybrid_engine._call_quietly
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        lowered = phase.fn.lower(*args) if args is not None else phase.fn.lower(_abstract(phase.in_shardings, shapes))
        compiled = lowered.compile()
    return compiled.as_text(), compiled.memory_analysis()


def _compile_key(phase: Any) -> tuple | None:
    args = getattr(phase, "args", None)
    if args is None:
        return None
    return (id(phase.fn), tuple(flat_device_ids(phase.mesh)),
            tuple((tuple(a.shape), str(a.dtype), getattr(a, "sharding", None)) for a in args))


def analyze_transition(transition: Any, shapes: Any, phases: Any = None) -> TransitionAnalysis:
    """Compile every phase of ``transition`` (or the given ``phases``, e.g. ``transition.training_phases()``)
    for params of ``shapes`` and read traffic and memory; phases running the same program compile once."""
    out = []
    cache: dict[tuple, tuple[CollectiveSummary, Any]] = {}
    for phase in transition.phases() if phases is None else phases:
        key = _compile_key(phase)
        if key is None or key not in cache:
            text, mem = compiled_hlo(phase, shapes)
            read = (summarize(text, flat_device_ids(phase.mesh)), mem)
            if key is not None:
                cache[key] = read
        collectives, mem = read if key is None else cache[key]
        out.append(PhaseAnalysis(
            name=phase.name,
            collectives=collectives,
            argument_bytes=int(mem.argument_size_in_bytes),
            output_bytes=int(mem.output_size_in_bytes),
            temp_bytes=int(mem.temp_size_in_bytes),
            alias_bytes=int(mem.alias_size_in_bytes),
            held_bytes=int(phase.held_bytes_per_device),
        ))
    return TransitionAnalysis(tuple(out))


def tree_bytes_per_device(*trees: Any) -> dict[int, int]:
    """Bytes of the (not deleted) arrays of ``trees`` on each addressable device id."""
    out: dict[int, int] = {}
    for tree in trees:
        for leaf in jax.tree.leaves(tree):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                for device, nbytes in _shard_bytes(leaf):
                    out[device] = out.get(device, 0) + nbytes
    return out


def _shard_bytes(leaf: jax.Array) -> list[tuple[int, int]]:
    """(device id, bytes) of each addressable shard, from the sharding (``shard.data`` would create new
    single-device arrays, which `jax.live_arrays` then counts a second time)."""
    try:
        count = math.prod(leaf.sharding.shard_shape(leaf.shape))
    except ValueError:  # uneven sharding: read the shards themselves
        return [(s.device.id, int(s.data.nbytes)) for s in leaf.addressable_shards]
    return [(d.id, count * leaf.dtype.itemsize) for d in leaf.sharding.addressable_devices]


def live_bytes_per_device() -> dict[int, int]:
    """Bytes of every live JAX array in this process, per addressable device id."""
    return tree_bytes_per_device(jax.live_arrays())


def resident_bytes_per_device(gen_params: Any, kept: Any) -> int:
    """Largest per-device bytes of the parameters held after a transition (generation + kept)."""
    return max(tree_bytes_per_device(gen_params, kept).values(), default=0)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall times of repeated transitions (seconds)."""

    times_s: tuple[float, ...]
    resident_bytes_per_device: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


def time_transition(transition: Any, make_train_params: Callable[[], Any], repeats: int = 3,
                    warmup: int = 1) -> Timing:
    """Median-able wall times of ``transition.transition`` on fresh params (creation not timed)."""
    times = []
    resident = 0
    for i in range(warmup + repeats):
        params = make_train_params()
        jax.block_until_ready(params)
        start = time.perf_counter()
        gen_params, kept = transition.transition(params)
        jax.block_until_ready((gen_params, kept))
        elapsed = time.perf_counter() - start
        if i >= warmup:
            times.append(elapsed)
        resident = resident_bytes_per_device(gen_params, kept)
        delete_tree((gen_params, kept, params))
    return Timing(tuple(times), resident)
