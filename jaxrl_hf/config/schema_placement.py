"""The ``placement`` section: devices, parallel sizes and where each role runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional
from jaxrl_hf.config.schema_memory import GpuMemoryConfig


@dataclass
class ParallelSizes:
    pp: int = 1
    tp: int = 1
    dp: Optional[int] = None
    """Null: the actor pool's devices / (pp·tp), so ``trainer.nnodes``/``n_gpus_per_node`` alone size it."""


@dataclass
class GenerateParallelSizes:
    """Generation layout ``p_g``/``t_g`` of the actor (3D-HybridEngine, HybridFlow §2.5): each must divide the
    training ``pp``/``tp``; ``d_g = pp·tp/(p_g·t_g)`` becomes micro data parallelism during rollouts.
    Null (default) or equal to ``placement.train``'s: generate on the training mesh, no reshard."""

    pp: Optional[int] = None
    tp: Optional[int] = None


@dataclass
class PoolConfig:
    """Where a secondary role runs: ``colocate=True`` shares the actor's pool (time-shared processes)."""

    colocate: bool = True
    num_processes: int = 1
    devices_per_process: int = 1


@dataclass
class PlacementConfig:
    """Devices and parallel sizes. CPU: ``num_processes`` Ray processes × ``devices_per_process`` host devices;
    GPU: one process per GPU (``devices_per_process`` 1)."""

    num_processes: Optional[int] = None
    """Processes of the actor pool. Null: ``trainer.nnodes × trainer.n_gpus_per_node / devices_per_process``
    when ``n_gpus_per_node`` is set, one per node when only ``trainer.nnodes`` is, else 1."""
    devices_per_process: int = 1
    cpus_per_process: float = 0.25
    train: ParallelSizes = field(default_factory=ParallelSizes)
    generate: GenerateParallelSizes = field(default_factory=GenerateParallelSizes)
    critic: PoolConfig = field(default_factory=PoolConfig)
    reward: PoolConfig = field(default_factory=PoolConfig)
    rollout: PoolConfig = field(default_factory=PoolConfig)
    """Where generation runs: ``colocate=True`` in the actor's processes (the hybrid engine); ``False``: a rollout
    group of its own (split placement) with ``num_processes`` × ``devices_per_process`` devices, which gets the
    actor's weights through the object store after every update (``trainer.max_staleness``). Validation still
    generates on the actor."""
    memory: GpuMemoryConfig = field(default_factory=GpuMemoryConfig)
    """Each GPU's memory between JAX and a colocated vLLM (`jaxrl_hf.config.memory_budget`)."""
