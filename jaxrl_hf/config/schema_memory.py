"""The ``placement.memory`` section: how each GPU is shared between JAX and a colocated vLLM, and what a worker
process's C allocator does with the host memory XLA frees.

Kept apart from ``schema.py`` (one concern per module); `jaxrl_hf.config.memory_budget` turns the GPU shares into
numbers, checks them when the config loads and into the environment of every worker process;
`jaxrl_hf.config.host_malloc` turns ``host_malloc`` into glibc's tunables."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class GpuMemoryConfig:
    """Each GPU's memory between JAX (training, reference, the native rollout engine) and vLLM
    (``rollout.gpu_memory_utilization``), set in every worker process's environment before JAX starts."""

    jax_fraction: Optional[float] = None
    """JAX's share of each GPU (``XLA_PYTHON_CLIENT_MEM_FRACTION``). Null: 1 − vLLM's share − ``margin`` when
    vLLM shares the process (``rollout.name=vllm``), else 1 − ``margin``. An explicit
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` in the driver's environment wins over both."""
    margin: float = 0.05
    """Share of each GPU left to neither: the CUDA contexts of JAX and torch, NCCL buffers, fragmentation.
    vLLM's and JAX's shares must add up to at most 1 − margin (checked when the config loads)."""
    preallocate: bool = False
    """``XLA_PYTHON_CLIENT_PREALLOCATE``. False: JAX's pool grows on demand up to ``jax_fraction``, so a vLLM
    engine started after JAX still finds its share free and a run shows the memory it really uses. True: JAX
    reserves its whole share at first use (less fragmentation, nothing left for anyone else)."""
    allocator: Literal["bfc", "platform"] = "bfc"
    """``bfc``: XLA's pooling allocator, capped at ``jax_fraction`` (memory freed by JAX stays in its pool).
    ``platform`` (``XLA_PYTHON_CLIENT_ALLOCATOR=platform``): a cudaMalloc/cudaFree per buffer, so freed memory goes
    back to the GPU at once and JAX can use what a sleeping vLLM released; slower, and uncapped (``jax_fraction``
    is then neither applied nor checked)."""
    host_malloc: Literal["auto", "reuse", "system"] = "auto"
    """What the C allocator of a worker process does with the buffers XLA frees (`jaxrl_hf.config.host_malloc`):
    ``reuse`` keeps them for the next call (no page faults and zeroing of every XLA:CPU call's temporaries again;
    the process holds its high-water mark of host memory), ``system`` returns them (glibc's defaults), ``auto``
    reuses in pools whose JAX runs on CPUs. A ``GLIBC_TUNABLES`` in the driver's environment wins."""
