"""Where a pool's processes land on a Ray cluster, and what they take along to another node.

* `bundle_plan` — the pool's placement group. Unpinned (``nnodes=None``): one bundle per process, placed
  with the pool's strategy (``PACK``: on as few nodes as have room, which may be several). Pinned to
  ``nnodes`` nodes: one bundle per node holding the resources of ``num_processes / nnodes`` processes,
  placed ``STRICT_SPREAD`` (every bundle on a different node); the processes start inside their node's
  bundle, node after node (ranks ``0..k-1`` on the first node, ``k..2k-1`` on the second, ...), so rank 0,
  which serves JAX's coordination service, is on the first node and a node's processes are neighbours
  in rank order (a ``tp`` group of consecutive ranks stays inside a node).
* `forwarded_env` — the driver's environment variables that configure JAX, XLA, NCCL, Hugging Face and
  this package, plus ``PYTHONPATH``; they reach every process through Ray's ``runtime_env``, because a
  process on a node started with ``ray start`` inherits that node's environment, not the driver's.
* `describe_nodes` — the cluster's alive nodes and their resources, for the error of a pool that does
  not fit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import ray

FORWARDED_ENV_PREFIXES = ("JAX_", "XLA_", "TF_CPP_", "NCCL_", "JAXRL_HF_", "HF_", "TRANSFORMERS_", "TOKENIZERS_",
                          "VLLM_")
"""Prefixes of the driver's environment variables passed to every process of a pool."""
FORWARDED_ENV_NAMES = ("PYTHONPATH",)
"""Single variables passed too: where the driver finds the code (valid on nodes that share its paths)."""
NOT_FORWARDED_ENV = ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES")
"""Set per process instead: the platform by `configure_host_devices`, the visible GPUs by Ray."""

MIN_BUNDLE_CPUS = 0.001  # a placement group bundle cannot be empty


@dataclass(frozen=True)
class BundlePlan:
    """A pool's placement group: its bundles and strategy, which bundle each rank starts in, and the
    resources each process's actor asks for inside its bundle."""

    bundles: tuple[dict[str, float], ...]
    strategy: str
    bundle_of_rank: tuple[int, ...]
    process_resources: dict[str, float]
    nnodes: int | None = None

    @property
    def processes_per_bundle(self) -> int:
        """Processes started in one bundle (1 unless pinned to nodes)."""
        return len(self.bundle_of_rank) // len(self.bundles)

    def describe(self) -> str:
        """The request in words, for errors: ``2 x {'CPU': 0.25}`` or ``2 nodes x {...} (...)``."""
        if self.nnodes is None:
            return f"{len(self.bundles)} x {self.bundles[0]}"
        k = self.processes_per_bundle
        return (f"{self.nnodes} nodes x {self.bundles[0]} ({self.strategy}: each bundle on a different Ray node, "
                f"holding {k} process{'es' if k > 1 else ''} of {self.process_resources})")


def bundle_plan(num_processes: int, cpus_per_process: float, gpus_per_process: int, *, nnodes: int | None,
                strategy: str) -> BundlePlan:
    """The placement group of a pool of ``num_processes`` processes (see the module docstring).

    ``nnodes`` pins the pool to that many distinct Ray nodes with ``num_processes / nnodes`` processes each
    (``strategy`` must then be ``STRICT_SPREAD``); ``None`` leaves the node choice to ``strategy``."""
    process = {"CPU": float(cpus_per_process)} if cpus_per_process else {}
    if gpus_per_process:
        process["GPU"] = float(gpus_per_process)
    if not process:
        process = {"CPU": MIN_BUNDLE_CPUS}
    if nnodes is None:
        return BundlePlan(tuple(dict(process) for _ in range(num_processes)), strategy, tuple(range(num_processes)),
                          process)
    if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1:
        raise ValueError(f"nnodes must be a positive int or None, got {nnodes!r}")
    if num_processes % nnodes:
        raise ValueError(f"{num_processes} processes cannot be spread evenly over nnodes={nnodes} nodes "
                         f"(num_processes must be a multiple of nnodes)")
    if strategy != "STRICT_SPREAD":
        raise ValueError(f"a pool pinned to nnodes={nnodes} nodes is placed STRICT_SPREAD (one bundle per node); "
                         f"got strategy={strategy!r}")
    per_node = num_processes // nnodes
    node_bundle = {key: value * per_node for key, value in process.items()}
    return BundlePlan(tuple(dict(node_bundle) for _ in range(nnodes)), strategy,
                      tuple(rank // per_node for rank in range(num_processes)), process, nnodes)


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) that every process of a pool receives."""
    environ = os.environ if environ is None else environ
    return {
        key: value for key, value in environ.items()
        if key not in NOT_FORWARDED_ENV and (key in FORWARDED_ENV_NAMES or key.startswith(FORWARDED_ENV_PREFIXES))
    }


def describe_nodes(nodes: list[dict]) -> list[str]:
    """``ray.nodes()`` as ``"<ip> <node id prefix> {total CPU, GPU and custom resources}"``, alive nodes only."""
    def schedulable(resources: dict) -> dict:
        return {k: v for k, v in resources.items()
                if not k.startswith("node:") and k not in ("memory", "object_store_memory")}

    return [f"{n.get('NodeManagerAddress')} {str(n.get('NodeID'))[:8]} {schedulable(n.get('Resources', {}))}"
            for n in nodes if n.get("Alive")]


__all__ = ["BundlePlan", "FORWARDED_ENV_NAMES", "FORWARDED_ENV_PREFIXES", "NOT_FORWARDED_ENV", "bundle_plan",
           "describe_nodes", "forwarded_env"]


NOSET_VISIBLE_DEVICES = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
"""A GPU pool's processes keep every GPU of their node visible (Ray does not narrow ``CUDA_VISIBLE_DEVICES`` per
process, which is reported to make NCCL between a node's GPUs hang or crawl on NVSwitch machines); each process
selects its own GPU explicitly (`local_gpu`)."""


def local_gpu(gpu_ids: list | None = None) -> int:
    """The GPU Ray assigned to this process (one per process), as an index into the node's GPUs: every process sees
    them all (`NOSET_VISIBLE_DEVICES`). JAX takes it as ``local_device_ids``, vLLM as ``LOCAL_RANK`` and torch as
    ``cuda:<it>``, so the three agree."""
    if gpu_ids is None:
        gpu_ids = ray.get_gpu_ids()
    if len(gpu_ids) != 1:
        raise RuntimeError(f"a GPU pool process holds {len(gpu_ids)} GPUs ({gpu_ids}); each must hold exactly one")
    return int(gpu_ids[0])

