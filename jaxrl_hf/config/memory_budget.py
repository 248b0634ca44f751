"""Each GPU's memory budget: vLLM's share, JAX's share, and the environment that enforces JAX's.

A worker process of the actor pool holds JAX (training, reference, the native engine) and, with
``rollout.name=vllm``, a vLLM engine on the same GPU. By default JAX reserves 75% of a GPU at first use and vLLM
asks for ``gpu_memory_utilization`` of it, so one of them fails to start or runs out of memory. The budget:

* vLLM: ``rollout.gpu_memory_utilization`` (verl's ``actor_rollout_ref.rollout.gpu_memory_utilization``;
  default `DEFAULT_VLLM_GPU_SHARE`, the vLLM engine's own default);
* JAX: ``placement.memory.jax_fraction``, by default the rest minus ``placement.memory.margin``; an explicit
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` in the environment wins;
* the two add up to at most ``1 − margin`` — checked when the config loads (`check_memory_budget`, a
  ``ConfigError`` naming the keys);
* `MemoryBudget.env` is what every worker process gets in its environment before JAX starts (Ray
  ``runtime_env``, `jaxrl_hf.trainer.roles.make_pool`): ``XLA_PYTHON_CLIENT_MEM_FRACTION``,
  ``XLA_PYTHON_CLIENT_PREALLOCATE`` and, for ``placement.memory.allocator=platform``,
  ``XLA_PYTHON_CLIENT_ALLOCATOR``. A pool of its own (a critic or reward model with ``colocate=false``) holds
  no vLLM, so JAX gets ``1 − margin`` there (``vllm_colocated=False``).

On CPU these variables change nothing (XLA reads them for GPUs only); they are set all the same, so the worker
environment is the same everywhere and testable here. Pure: no JAX, no vLLM.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from jaxrl_hf.config.build import ConfigError
from jaxrl_hf.config.schema import RunConfig

ENV_MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION"
ENV_PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"
ENV_ALLOCATOR = "XLA_PYTHON_CLIENT_ALLOCATOR"
DEFAULT_VLLM_GPU_SHARE = 0.5
"""vLLM's share when ``rollout.gpu_memory_utilization`` is null (= ``VllmOptions.gpu_memory_utilization``)."""
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """The shares of one GPU (fractions of its memory) and where each number came from."""

    vllm_share: float | None
    """vLLM's ``gpu_memory_utilization``; None: no vLLM in these processes."""
    jax_fraction: float | None
    """``XLA_PYTHON_CLIENT_MEM_FRACTION``; None with the platform allocator (uncapped)."""
    margin: float
    preallocate: bool
    allocator: str
    vllm_source: str = ""
    jax_source: str = ""

    @property
    def total(self) -> float:
        """vLLM's share + JAX's share (JAX's counted as 0 when uncapped)."""
        return (self.vllm_share or 0.0) + (self.jax_fraction or 0.0)

    def env(self) -> dict[str, str]:
        """The variables every worker process of the pool gets before JAX starts."""
        env = {ENV_PREALLOCATE: "true" if self.preallocate else "false"}
        if self.allocator == "platform":
            env[ENV_ALLOCATOR] = "platform"
        elif self.jax_fraction is not None:
            env[ENV_MEM_FRACTION] = f"{self.jax_fraction:.4g}"
        return env

    def describe(self) -> str:
        """One line for the start of a run and the doctor's report."""
        parts = []
        if self.vllm_share is not None:
            parts.append(f"vLLM {self.vllm_share:.2f} ({self.vllm_source})")
        if self.jax_fraction is None:
            parts.append("JAX uncapped (placement.memory.allocator=platform: memory returns to the GPU when freed)")
        else:
            parts.append(f"JAX up to {self.jax_fraction:.2f} ({self.jax_source})")
        parts.append(f"margin {self.margin:.2f}")
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env().items()))
        return f"GPU memory budget per device: {' + '.join(parts)}; worker env: {env}"


def _env_float(environ: Mapping[str, str], name: str) -> float | None:
    if name not in environ:
        return None
    try:
        return float(environ[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={environ[name]!r}: must be a number in (0, 1]") from None


def _env_bool(environ: Mapping[str, str], name: str) -> bool | None:
    value = environ.get(name)
    if value is None:
        return None
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ConfigError(f"environment variable {name}={value!r}: must be true or false")


def memory_budget(config: RunConfig, environ: Mapping[str, str] | None = None, *,
                  vllm_colocated: bool = True) -> MemoryBudget:
    """The budget of the actor pool's GPUs (``vllm_colocated=False``: a pool without vLLM), unchecked.
    ``environ`` (default ``os.environ``): explicit ``XLA_PYTHON_CLIENT_*`` variables win over the config."""
    environ = os.environ if environ is None else environ
    mem, rollout = config.placement.memory, config.rollout
    vllm_share = vllm_source = None
    if vllm_colocated and rollout.name == "vllm":
        if rollout.gpu_memory_utilization is None:
            vllm_share, vllm_source = DEFAULT_VLLM_GPU_SHARE, "rollout.gpu_memory_utilization default"
        else:
            vllm_share, vllm_source = float(rollout.gpu_memory_utilization), "rollout.gpu_memory_utilization"
    allocator = environ.get(ENV_ALLOCATOR, mem.allocator)
    preallocate = _env_bool(environ, ENV_PREALLOCATE)
    preallocate = mem.preallocate if preallocate is None else preallocate
    from_env = _env_float(environ, ENV_MEM_FRACTION)
    if allocator == "platform":
        where = f"environment {ENV_ALLOCATOR}" if ENV_ALLOCATOR in environ else "placement.memory.allocator"
        jax_fraction, jax_source = None, f"allocator from {where}"
    elif from_env is not None:
        jax_fraction, jax_source = from_env, f"environment {ENV_MEM_FRACTION}"
    elif mem.jax_fraction is not None:
        jax_fraction, jax_source = float(mem.jax_fraction), "placement.memory.jax_fraction"
    else:
        jax_fraction = round(1.0 - mem.margin - (vllm_share or 0.0), 6)
        jax_source = ("derived: 1 - vLLM - placement.memory.margin" if vllm_share is not None
                      else "derived: 1 - placement.memory.margin")
    return MemoryBudget(vllm_share, jax_fraction, float(mem.margin), bool(preallocate), allocator,
                        vllm_source or "", jax_source)


def _key_of(source: str) -> str:
    """The config key / variable a source string names, for errors."""
    if source.startswith("environment "):
        return f"environment variable {source.split()[1]}"
    if source.startswith("derived"):
        return "placement.memory.jax_fraction (derived)"
    return f"config key '{source.split()[0]}'"


def check_memory_budget(config: RunConfig, environ: Mapping[str, str] | None = None) -> MemoryBudget:
    """`memory_budget` of the actor pool, checked: each share in (0, 1], vLLM + JAX <= 1 − margin.
    Raises ``ConfigError`` naming the keys (and environment variables) involved."""
    mem = config.placement.memory
    if not 0.0 <= mem.margin < 1.0:
        raise ConfigError(f"config key 'placement.memory.margin'={mem.margin!r}: must be in [0, 1)")
    if mem.jax_fraction is not None and not 0.0 < mem.jax_fraction <= 1.0:
        raise ConfigError(f"config key 'placement.memory.jax_fraction'={mem.jax_fraction!r}: must be in (0, 1]")
    share = config.rollout.gpu_memory_utilization
    if share is not None and not 0.0 < share <= 1.0:
        raise ConfigError(f"config key 'rollout.gpu_memory_utilization'={share!r}: must be in (0, 1]")
    budget = memory_budget(config, environ)
    limit = 1.0 - budget.margin
    if budget.jax_fraction is not None and budget.jax_fraction <= 0.0:
        raise ConfigError(
            f"config keys 'rollout.gpu_memory_utilization'={budget.vllm_share} and 'placement.memory.margin'="
            f"{budget.margin} leave no GPU memory for JAX (1 - {budget.vllm_share} - {budget.margin} <= 0); lower "
            "vLLM's share")
    if budget.jax_fraction is not None and not 0.0 < budget.jax_fraction <= 1.0:
        raise ConfigError(f"{_key_of(budget.jax_source)}={budget.jax_fraction}: must be in (0, 1]")
    if budget.total > limit + 1e-9:
        terms = []
        if budget.vllm_share is not None:
            terms.append(f"{_key_of(budget.vllm_source)}={budget.vllm_share} (vLLM)")
        if budget.jax_fraction is not None:
            terms.append(f"{_key_of(budget.jax_source)}={budget.jax_fraction} (JAX)")
        raise ConfigError(
            f"GPU memory budget: {' + '.join(terms)} = {budget.total:.3g} of each GPU, more than 1 - "
            f"placement.memory.margin = {limit:.3g}; one of them would fail to start or run out of memory. Lower "
            "a share, or leave placement.memory.jax_fraction null (JAX then gets the rest minus the margin)")
    return budget


def worker_env(config: RunConfig, *, vllm_colocated: bool = True,
               environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a pool's worker processes: the budget's variables (`MemoryBudget.env`)."""
    return memory_budget(config, environ, vllm_colocated=vllm_colocated).env()


__all__ = ["DEFAULT_VLLM_GPU_SHARE", "ENV_ALLOCATOR", "ENV_MEM_FRACTION", "ENV_PREALLOCATE", "MemoryBudget",
           "check_memory_budget", "memory_budget", "worker_env"]
