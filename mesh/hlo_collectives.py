"""Collectives read from compiled HLO text, and the bytes each device receives through them.

Parses the ops of ``jitted.lower(...).compile().as_text()``: ``all-gather``, ``collective-permute``,
``all-reduce``, ``all-to-all``, ``reduce-scatter`` (and their async ``-start`` forms), their result
shapes and their replica groups (explicit ``{{0,1},{2,3}}`` lists, the iota form
``[4,2]<=[2,2,2]T(0,2,1)`` or the mesh-axes form ``mesh['axis_0'=4,'axis_1'=2] {'axis_0'}``). Group members are XLA partition ids; partition ``k`` runs on the
``k``-th device of the program's device assignment (the mesh's flat order), which callers pass as
``device_ids`` to get device ids back.

Bytes received per device and op (group size ``g``, ``S`` = bytes of the op's result per device):

* all-gather:            ``S·(g-1)/g``  (every other member's piece)
* reduce-scatter:        ``S·(g-1)``    (result is one piece; the input was ``g`` pieces)
* all-to-all:            ``S·(g-1)/g``
* all-reduce:            ``2·S·(g-1)/g`` (ring: reduce-scatter then all-gather)
* collective-permute:    ``S`` for each pair whose target is this device
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

COLLECTIVE_KINDS = ("all-gather", "collective-permute", "all-reduce", "all-to-all", "reduce-scatter")

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8, "u64": 8,
    "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "s4": 1, "u4": 1,
}
_OP_RE = re.compile(r"=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                    r"(?P<kind>all-gather|collective-permute|all-reduce|all-to-all|reduce-scatter)"
                    r"(?P<start>-start)?\(")
_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_IOTA_RE = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_LIST_RE = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_MESH_RE = re.compile(r"replica_groups=mesh\[([^\]]*)\](.*?)\s*\{('[^}]*)\}")
_PAIRS_RE = re.compile(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of a compiled program (groups/pairs in partition ids)."""

    kind: str
    result_bytes: int
    groups: tuple[tuple[int, ...], ...]
    pairs: tuple[tuple[int, int], ...]
    text: str

    def received_bytes(self, partition: int) -> float:
        """Bytes partition ``partition`` receives through this op (see module docstring)."""
        if self.kind == "collective-permute":
            return float(sum(self.result_bytes for _, dst in self.pairs if dst == partition))
        group = next((g for g in self.groups if partition in g), None)
        if group is None:
            return 0.0
        g = len(group)
        if self.kind == "reduce-scatter":
            return float(self.result_bytes * (g - 1))
        if self.kind == "all-reduce":
            return 2.0 * self.result_bytes * (g - 1) / g
        return self.result_bytes * (g - 1) / g


def _shape_bytes(shape_text: str, kind: str, is_start: bool) -> int:
    arrays = [(dt, [int(x) for x in dims.split(",") if x]) for dt, dims in _ARRAY_RE.findall(shape_text)]
    if not arrays:
        raise ValueError(f"cannot read a shape from {shape_text!r}")
    for dt, _ in arrays:
        if dt not in _DTYPE_BYTES:
            raise ValueError(f"unknown HLO element type {dt!r} in {shape_text!r}")
    sizes = [int(np.prod(dims)) * _DTYPE_BYTES[dt] for dt, dims in arrays]
    if is_start and kind in ("all-gather", "collective-permute") and len(sizes) >= 2:
        # async start ops return (operand(s), result(s)[, contexts]): count the result half.
        if kind == "collective-permute":
            return sizes[1]
        half = len(sizes) // 2
        return sum(sizes[half:2 * half])
    return sum(sizes)


def _iota_devices(size: int, suffix: str) -> np.ndarray:
    """Device assignment of a printed mesh: iota when absent, else ``, device_ids=([dims]T(perm))``
    (a transposed iota) or ``, device_ids=(3,1,...)`` (explicit) after the mesh brackets."""
    suffix = suffix.strip()
    if not suffix:
        return np.arange(size)
    m = re.fullmatch(r",\s*device_ids=\((.*)\)", suffix)
    inner = m.group(1).strip() if m else ""
    iota = re.fullmatch(r"\[([0-9,]+)\](?:T\(([0-9,]+)\))?", inner)
    if iota:
        ids = np.arange(size).reshape([int(x) for x in iota.group(1).split(",")])
        if iota.group(2):
            ids = ids.transpose([int(x) for x in iota.group(2).split(",")])
        return ids.reshape(-1)
    if re.fullmatch(r"[0-9]+(?:,[0-9]+)*", inner) and len(inner.split(",")) == size:
        return np.array([int(x) for x in inner.split(",")])
    raise ValueError(f"unrecognised device assignment {suffix!r} in a mesh replica group")


def _mesh_groups(axes_text: str, suffix: str, refs_text: str) -> tuple[tuple[int, ...], ...]:
    """Groups of ``mesh['a'=4,'b'=2] {'a'}`` (XLA's MeshAxesReplicaGroupList): members vary along the
    listed axes (``'a':(pre)size`` is the sub-axis of size ``size`` after ``pre``), rest fixed."""
    names, sizes = [], []
    for item in filter(None, (x.strip() for x in axes_text.split(","))):
        m = re.fullmatch(r"'([^']+)'=([0-9]+)", item)
        if not m:
            raise ValueError(f"unrecognised mesh axis {item!r} in replica groups")
        names.append(m.group(1))
        sizes.append(int(m.group(2)))
    refs: dict[int, list[tuple[int, int]]] = {}
    for item in filter(None, (x.strip() for x in refs_text.split(","))):
        m = re.fullmatch(r"'([^']+)'(?::\(([0-9]+)\)([0-9]+))?", item)
        if not m or m.group(1) not in names:
            raise ValueError(f"unrecognised replica-group axis {item!r} (mesh axes {names})")
        dim = names.index(m.group(1))
        pre, size = (int(m.group(2)), int(m.group(3))) if m.group(2) else (1, sizes[dim])
        refs.setdefault(dim, []).append((pre, size))
    shape: list[int] = []
    grouped: list[int] = []
    for dim, full in enumerate(sizes):
        prefix = 1
        for pre, size in sorted(refs.get(dim, [])):
            if pre != prefix:
                shape.append(pre // prefix)
                prefix = pre
            grouped.append(len(shape))
            shape.append(size)
            prefix *= size
        if prefix != full:
            shape.append(full // prefix)
    devices = _iota_devices(int(np.prod(sizes)), suffix).reshape(shape)
    order = [i for i in range(len(shape)) if i not in grouped] + grouped
    group_size = int(np.prod([shape[i] for i in grouped])) if grouped else 1
    rows = devices.transpose(order).reshape(-1, group_size)
    return tuple(tuple(int(v) for v in row) for row in rows)


def _parse_groups(line: str, num_partitions: int) -> tuple[tuple[int, ...], ...]:
    m = _MESH_RE.search(line)
    if m:
        return _mesh_groups(m.group(1), m.group(2), m.group(3))
    m = _IOTA_RE.search(line)
    if m:
        out_shape = [int(x) for x in m.group(1).split(",")]
        reshape = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(reshape))).reshape(reshape)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return tuple(tuple(int(v) for v in row) for row in ids.reshape(out_shape))
    m = _LIST_RE.search(line)
    if m:
        groups = tuple(tuple(int(v) for v in g.split(",") if v) for g in re.findall(r"\{([0-9,]*)\}", m.group(1)))
        groups = tuple(g for g in groups if g)
        if groups:
            return groups
    # replica_groups={} (or absent): one group of every partition.
    return (tuple(range(num_partitions)),)


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Every collective op in an HLO module's text (``-done`` halves of async pairs skipped)."""
    num_partitions = 1
    m = re.search(r"num_partitions=([0-9]+)", hlo_text)
    if m:
        num_partitions = int(m.group(1))
    out = []
    for line in hlo_text.splitlines():
        op = _OP_RE.search(line)
        if not op:
            continue
        kind, is_start = op.group("kind"), bool(op.group("start"))
        size = _shape_bytes(op.group("shape"), kind, is_start)
        pairs: tuple[tuple[int, int], ...] = ()
        groups: tuple[tuple[int, ...], ...] = ()
        if kind == "collective-permute":
            pm = _PAIRS_RE.search(line)
            if pm:
                pairs = tuple((int(a), int(b)) for a, b in re.findall(r"\{([0-9]+),([0-9]+)\}", pm.group(1)))
        else:
            groups = _parse_groups(line, num_partitions)
        out.append(Collective(kind, size, groups, pairs, line.strip()))
    return out


@dataclasses.dataclass(frozen=True)
class CollectiveSummary:
    """Per-device traffic of a compiled program, keyed by device id."""

    ops: tuple[Collective, ...]
    device_ids: tuple[int, ...]
    received_bytes: dict[int, float]

    @property
    def kinds(self) -> set[str]:
        return {op.kind for op in self.ops}

    @property
    def max_received_bytes(self) -> float:
        return max(self.received_bytes.values(), default=0.0)

    def device_groups(self, kind: str | None = None) -> set[tuple[int, ...]]:
        """Replica groups of the ops (of ``kind``) as sorted tuples of device ids."""
        return {tuple(sorted(self.device_ids[p] for p in g))
                for op in self.ops if kind is None or op.kind == kind for g in op.groups}


def summarize(hlo_text: str, device_ids: Sequence[int]) -> CollectiveSummary:
    """Collectives of ``hlo_text`` and bytes received per device; ``device_ids[k]`` runs partition k."""
    ops = tuple(parse_collectives(hlo_text))
    ids = tuple(int(d) for d in device_ids)
    received = {ids[p]: float(sum(op.received_bytes(p) for op in ops)) for p in range(len(ids))}
    return CollectiveSummary(ops, ids, received)
