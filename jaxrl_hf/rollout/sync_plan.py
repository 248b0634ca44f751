"""How one JAX param leaf reaches vLLM's device: the decision, shared by the CPU and the GPU weight sync.

`plan_transfer(leaf, target)` picks a path from where the leaf's buffers are (`LeafPlacement`: host or device
memory, one buffer / replicas / shards, one process or several) and where vLLM computes (`SyncTarget`: the host
or one CUDA device), and lists the copies that path makes before vLLM's own loader copies the tensor into its
parameters (which it always does: it fuses q/k/v and gate/up). A copy happens only where the layouts differ:
shards to be joined into one tensor, or a buffer in another memory or on another device than vLLM's.

===============  =======================================================  ==========================
path             when                                                     copies before vLLM's load
===============  =======================================================  ==========================
host_view        host leaf (numpy, JAX CPU buffer / replica), vLLM on CPU  none (DLPack / from_numpy)
host_gather      host leaf in shards (or over processes), vLLM on CPU     one: shards -> host buffer
device_view      GPU leaf (buffer / a replica) on vLLM's GPU              none (DLPack, same device)
device_gather    GPU leaf in shards (or over processes), vLLM on GPU      one: all-gather on the GPUs
peer_copy        GPU leaf on another GPU than vLLM's                      one: GPU -> GPU
host_to_device   host leaf, vLLM on GPU (JAX left on the CPU)             one: host -> GPU
device_to_host   GPU leaf, vLLM on CPU                                    one: GPU -> host
tp_shard         vLLM TP > 1: this rank's TP shard (``rollout.vllm_tp``)  one: reshard into the TP layout
===============  =======================================================  ==========================

The CPU rows are what ran before (and run in the tests); the device rows are executed by
`jaxrl_hf.rollout.weight_sync` with the same mechanics (DLPack, ``jax.device_put`` onto one device) and have
**not run on a GPU** here: no accelerator was available to this project. The metrics name the path taken
(`sync_metrics`: ``perf/weight_sync_path`` is the index in `SYNC_PATHS` of the path that moved most bytes).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

SYNC_PATHS = ("host_view", "host_gather", "device_view", "device_gather", "peer_copy", "host_to_device",
              "device_to_host", "tp_shard")
"""Every path; a path's index is the value of the metric ``perf/weight_sync_path``."""
ZERO_COPY_PATHS = ("host_view", "device_view")


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
    """Where a param leaf's data is.

    memory: ``host`` (numpy, or JAX CPU devices) or ``device`` (accelerator memory).
    devices: hardware ids (CUDA ordinals) of this process's devices holding a piece; () for numpy.
    pieces: ``one`` buffer, full ``replicas`` on several devices, or ``shards`` to be joined.
    multi_process: pieces live in other processes too (not fully addressable here).
    """

    memory: Literal["host", "device"]
    devices: tuple[int, ...] = ()
    pieces: Literal["one", "replicas", "shards"] = "one"
    multi_process: bool = False


@dataclasses.dataclass(frozen=True)
class SyncTarget:
    """Where vLLM computes: the host, or CUDA device ``device``."""

    memory: Literal["host", "device"]
    device: int | None = None

    def __post_init__(self) -> None:
        if (self.memory == "device") != (self.device is not None):
            raise ValueError(f"SyncTarget: a device target needs its device id, a host target none; got {self}")

    @property
    def torch_device(self) -> str:
        """torch's name of the target (``cpu`` / ``cuda:N``)."""
        return "cpu" if self.memory == "host" else f"cuda:{self.device}"


HOST = SyncTarget("host")


@dataclasses.dataclass(frozen=True)
class TransferPlan:
    """The path for one leaf, the device whose buffer is wrapped (device paths) and each copy made."""

    path: str
    copies: tuple[str, ...] = ()
    source_device: int | None = None
    gather_onto: int | None = None
    """device_gather: the device the pieces are joined on."""

    @property
    def copied(self) -> bool:
        return bool(self.copies)


def plan_transfer(leaf: LeafPlacement, target: SyncTarget) -> TransferPlan:
    """The path (module table) for ``leaf`` to reach ``target``."""
    joined = leaf.pieces == "shards" or leaf.multi_process
    where = "across processes" if leaf.multi_process else "across devices"
    if target.memory == "host":
        if leaf.memory == "device":
            return TransferPlan("device_to_host", (f"{'gather ' + where + ' and ' if joined else ''}copy GPU -> host",))
        if joined:
            return TransferPlan("host_gather", (f"gather shards {where} into one host buffer",))
        return TransferPlan("host_view")
    d = target.device
    if leaf.memory == "host":
        first = (f"gather shards {where} into one host buffer",) if joined else ()
        return TransferPlan("host_to_device", first + (f"copy host -> cuda:{d}",))
    if joined:
        onto = d if (d in leaf.devices or not leaf.devices) else leaf.devices[0]
        copies = (f"all-gather {where} onto cuda:{onto}",)
        if onto != d:
            copies += (f"copy cuda:{onto} -> cuda:{d}",)
        return TransferPlan("device_gather", copies, source_device=onto, gather_onto=onto)
    if d in leaf.devices:
        return TransferPlan("device_view", source_device=d)
    source = leaf.devices[0]
    return TransferPlan("peer_copy", (f"copy cuda:{source} -> cuda:{d}",), source_device=source)


@dataclasses.dataclass
class SyncStats:
    """What one sync moved: bytes by path, bytes aliased (zero-copy) vs copied before vLLM's load."""

    leaves: int = 0
    bytes_total: int = 0
    bytes_zero_copy: int = 0
    bytes_gathered: int = 0
    """Bytes copied before vLLM's load (gathered, or moved between memories / devices)."""
    gathered_leaves: int = 0
    bytes_by_path: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, nbytes: int, plan: TransferPlan | bool) -> None:
        """Count one leaf (``plan`` may be a bool ``gathered`` for a path-less caller)."""
        if isinstance(plan, bool):
            plan = TransferPlan("host_gather", ("gather",)) if plan else TransferPlan("host_view")
        self.leaves += 1
        self.bytes_total += nbytes
        self.bytes_by_path[plan.path] = self.bytes_by_path.get(plan.path, 0) + nbytes
        if plan.copied:
            self.bytes_gathered += nbytes
            self.gathered_leaves += 1
        else:
            self.bytes_zero_copy += nbytes

    def mark_all_copied(self, path: str | None = None) -> None:
        """Every byte was copied after all (arguments pickled for another process, or gathered up front)."""
        self.bytes_gathered, self.bytes_zero_copy, self.gathered_leaves = self.bytes_total, 0, self.leaves
        if path is not None:
            self.bytes_by_path = {path: self.bytes_total}

    @property
    def main_path(self) -> str | None:
        """The path that moved the most bytes."""
        return max(self.bytes_by_path, key=self.bytes_by_path.get) if self.bytes_by_path else None

    def describe(self) -> str:
        paths = ", ".join(f"{p} {b / 1e6:.1f} MB" for p, b in sorted(self.bytes_by_path.items()))
        return (f"{self.leaves} leaves, {self.bytes_total / 1e6:.1f} MB ({paths}); zero-copy "
                f"{self.bytes_zero_copy / 1e6:.1f} MB, copied {self.bytes_gathered / 1e6:.1f} MB")


def sync_metrics(stats: SyncStats, seconds: float) -> dict[str, float]:
    """``perf/weight_sync_*`` metrics of one sync: path (index in `SYNC_PATHS`), bytes, copied bytes, time."""
    out = {"perf/weight_sync_s": float(seconds), "perf/weight_sync_bytes": float(stats.bytes_total),
           "perf/weight_sync_copied_bytes": float(stats.bytes_gathered),
           "perf/weight_sync_zero_copy_bytes": float(stats.bytes_zero_copy)}
    if stats.main_path is not None:
        out["perf/weight_sync_path"] = float(SYNC_PATHS.index(stats.main_path))
    for path, nbytes in stats.bytes_by_path.items():
        out[f"perf/weight_sync_bytes/{path}"] = float(nbytes)
    return out


__all__ = ["HOST", "LeafPlacement", "SYNC_PATHS", "SyncStats", "SyncTarget", "TransferPlan", "ZERO_COPY_PATHS",
           "plan_transfer", "sync_metrics"]
