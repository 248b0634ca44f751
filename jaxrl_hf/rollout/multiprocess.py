"""Row bookkeeping of the native engine when its mesh spans several JAX processes.

Contract (what `JaxGenerationEngine.generate` expects from its callers on several processes):

* every process calls ``generate`` at the same time with **its own** prompts and a row group
  ``(rank, size)``; the global batch is the concatenation of the ``size`` groups' rows in rank order
  (the controller's MESH_DP: rank = the process's dp rank). Processes of one group (replicas, e.g. tensor
  parallelism across processes) pass identical prompts.
* each process's devices hold some *batch shards* (slabs) of the engine mesh's ``batch`` axis. A group's
  rows live on the slabs its processes hold, so processes of one group must hold the same slabs and
  processes of different groups disjoint ones (`check_row_groups`). Then the inputs are built with
  ``jax.make_array_from_process_local_data`` from each process's rows and the outputs read back from its
  addressable shards: no row crosses a process boundary. A layout where a group's slabs are split between
  its processes (a micro-DP group of the generation layout spanning processes of one training replica) is
  refused with an error naming the processes; it would need a cross-process row exchange.
* static shapes must agree on every process: one small ``process_allgather`` of a per-process descriptor
  (rows, longest prompt, group, a digest of the prompts) gives every process the same length bucket (the
  longest prompt anywhere) and per-group batch bucket (the largest group), so all compile one program.
  Bad input on any process makes *every* process raise (nobody is left waiting in a collective).
* seeds: a row's PRNG key is ``fold_in(seed, global row index)`` with the index counted over the real rows
  of the concatenated batch, as `JaxGenerationEngine` does with one process; a row's sample therefore
  does not depend on the number of processes (given the same seed and weights).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Mapping, Sequence

import jax
import numpy as np

from jaxrl_hf.mesh.rules import logical_to_spec

Slabs = Mapping[int, tuple[int, ...]]  # process index -> sorted batch-slab indices its devices hold


def process_batch_slabs(mesh: jax.sharding.Mesh, rules: Any) -> dict[int, tuple[int, ...]]:
    """For every process of ``mesh``, the sorted indices of the batch shards (slabs) its devices hold, the
    ``batch`` logical axis placed by ``rules`` (every process holds slab 0 when the batch is replicated)."""
    spec = logical_to_spec(("batch",), rules)
    names = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0] or ())
    num_slabs = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    sharding = jax.sharding.NamedSharding(mesh, spec)
    held: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map((num_slabs,)).items():
        held.setdefault(device.process_index, set()).add(index[0].start or 0)
    return {p: tuple(sorted(s)) for p, s in held.items()}


def default_groups(slabs: Slabs) -> dict[int, int]:
    """Row-group rank of every process when the caller names none: processes holding the same slabs form a
    group; groups are ranked by their first slab."""
    order = sorted(set(slabs.values()))
    return {p: order.index(s) for p, s in slabs.items()}


def check_row_groups(slabs: Slabs, groups: Mapping[int, int], sizes: Mapping[int, int] | None = None) -> None:
    """Raise ``ValueError`` unless the row groups match the batch shards (module docstring): processes of a
    group hold the same slabs, different groups disjoint slabs of equal count, ranks ``0..size-1``."""
    procs = sorted(slabs)
    if set(groups) != set(procs):
        raise ValueError(f"row groups given for processes {sorted(groups)} but the mesh has processes {procs}")
    size = len(set(groups.values()))
    if sizes is not None and set(sizes.values()) != {size}:
        raise ValueError(f"processes disagree on the number of row groups: {dict(sizes)} (ranks used: {size})")
    if sorted(set(groups.values())) != list(range(size)):
        raise ValueError(f"row-group ranks {sorted(set(groups.values()))} are not 0..{size - 1}")
    by_group: dict[int, tuple[int, ...]] = {}
    for p in procs:
        first = by_group.setdefault(groups[p], slabs[p])
        if first != slabs[p]:
            other = next(q for q in procs if groups[q] == groups[p])
            raise ValueError(
                f"processes {other} and {p} share row group {groups[p]} (the same rows) but hold different batch "
                f"shards of the generation mesh ({list(first)} vs {list(slabs[p])}): this layout would need rows "
                "exchanged between processes, which the native engine does not do")
    seen: dict[int, int] = {}
    for g, held in by_group.items():
        for s in held:
            if s in seen:
                raise ValueError(f"row groups {seen[s]} and {g} both hold batch shard {s} of the generation mesh")
            seen[s] = g
    counts = {len(held) for held in by_group.values()}
    if len(counts) != 1:
        shards = {g: len(h) for g, h in by_group.items()}
        raise ValueError(f"row groups hold unequal numbers of batch shards: {shards}")


def prompts_digest(prompts: Sequence[Sequence[int]], n: int) -> int:
    """A 31-bit CRC of the prompts (and ``n``): replicas of a row group must pass identical rows."""
    crc = zlib.crc32(np.asarray([n, len(prompts)], np.int64).tobytes())
    for p in prompts:
        crc = zlib.crc32(np.asarray([len(p), *p], np.int64).tobytes(), crc)
    return crc & 0x7FFFFFFF


@dataclasses.dataclass(frozen=True)
class LocalRows:
    """One process's descriptor: ``ok`` (its input was valid), row group, rows (prompts × n), longest prompt."""

    ok: bool
    rank: int = 0
    size: int = 0
    rows: int = 0
    max_prompt_len: int = 0
    digest: int = 0

    @classmethod
    def of(cls, prompts: Sequence[Sequence[int]], n: int, row_group: tuple[int, int] | None, slabs: Slabs,
           me: int) -> "LocalRows":
        """This process's descriptor; ``row_group`` defaults to `default_groups`."""
        if row_group is None:
            groups = default_groups(slabs)
            rank, size = groups[me], len(set(groups.values()))
        else:
            rank, size = (int(v) for v in row_group)
            if not 0 <= rank < size:
                raise ValueError(f"generate: row_group={row_group!r} needs 0 <= rank < size")
        return cls(True, rank, size, len(prompts) * n, max(len(p) for p in prompts), prompts_digest(prompts, n))

    @classmethod
    def failed(cls) -> "LocalRows":
        return cls(False)

    def vector(self) -> np.ndarray:
        return np.asarray([int(self.ok), self.rank, self.size, self.rows, self.max_prompt_len, self.digest], np.int32)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every process agreed on: this process's first global row, the largest group's rows, the longest
    prompt anywhere and the number of row groups."""

    offset: int
    max_rows: int
    max_prompt_len: int
    num_groups: int


def agree(local: LocalRows, slabs: Slabs, me: int, error: Exception | None = None) -> Plan:
    """All-gather the descriptors (one small collective, on every process), check them, return the `Plan`.

    Raises on every process when any process's input was bad (``error``: this process's own, re-raised),
    when replicas of a group passed different rows, or when the groups do not match the batch shards."""
    from jax.experimental import multihost_utils

    table = np.asarray(multihost_utils.process_allgather(local.vector()))
    bad = [p for p in range(table.shape[0]) if not table[p, 0]]
    if bad:
        if error is not None:
            raise error
        raise ValueError(f"generate: process(es) {bad} rejected their prompts (their error names the problem)")
    groups = {p: int(table[p, 1]) for p in range(table.shape[0])}
    check_row_groups(slabs, groups, {p: int(table[p, 2]) for p in range(table.shape[0])})
    first: dict[int, int] = {}
    for p in range(table.shape[0]):
        q = first.setdefault(groups[p], p)
        if tuple(table[q, 3:]) != tuple(table[p, 3:]):
            raise ValueError(f"generate: processes {q} and {p} are replicas of row group {groups[p]} but passed "
                             f"different prompts (rows {table[q, 3]} vs {table[p, 3]})")
    rows = {g: int(table[p, 3]) for g, p in first.items()}
    return Plan(offset=sum(rows[g] for g in rows if g < groups[me]), max_rows=max(rows.values()),
                max_prompt_len=int(table[:, 4].max()), num_groups=len(rows))


def local_rows(array: jax.Array) -> np.ndarray:
    """This process's rows of a global array sharded on axis 0, in the order
    ``jax.make_array_from_process_local_data`` took them (its shards by row start; replicas once)."""
    pieces: dict[int, np.ndarray] = {}
    for shard in array.addressable_shards:
        pieces.setdefault(shard.index[0].start or 0, np.asarray(shard.data))
    return np.concatenate([pieces[k] for k in sorted(pieces)], axis=0)
