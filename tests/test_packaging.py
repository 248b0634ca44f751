"""Packaging: every sub-package is installed, mesh/ is installed as ``jaxrl_hf.mesh`` (never as ``mesh``), and
configs/ as package data ``jaxrl_hf/configs``: a non-editable install runs ``jaxrl-hf-train`` from anywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)


def test_package_list_matches_the_source_tree():
    """The explicit ``packages`` list names every folder with an ``__init__.py`` (a new sub-package that is
    not listed would be missing from a wheel)."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {"jaxrl_hf.mesh", "jaxrl_hf.configs"}  # folders mapped into the package (package-dir)
    for root, dirs, files in os.walk(os.path.join(REPO, "jaxrl_hf")):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        if "__init__.py" in files:
            found.add(os.path.relpath(root, REPO).replace(os.sep, "."))
    for root, dirs, files in os.walk(os.path.join(REPO, "mesh")):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        if "__init__.py" in files:
            found.add("jaxrl_hf." + os.path.relpath(root, REPO).replace(os.sep, "."))
    assert listed == found


def test_mesh_and_configs_map_into_the_package_namespace():
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == {"jaxrl_hf.mesh": "mesh", "jaxrl_hf.configs": "configs"}
    assert _pyproject()["project"]["scripts"] == {"jaxrl-hf-train": "jaxrl_hf.trainer.cli:main",
                                                  "jaxrl-hf-export-hf": "jaxrl_hf.trainer.hf_export:main"}


def test_mesh_is_not_a_top_level_module_and_resolves_from_a_checkout(tmp_path):
    """From another directory, through the installed (editable) package: ``jaxrl_hf.mesh`` is the repository's
    ``mesh/``, and a bare ``import mesh`` finds nothing (a user's own ``mesh`` module is not shadowed)."""
    code = ("import importlib.util, jaxrl_hf.mesh as m, jaxrl_hf.mesh.rules\n"
            "print(m.__file__)\n"
            "print(importlib.util.find_spec('mesh'))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    path, spec = proc.stdout.split("\n")[:2]
    assert os.path.samefile(path, os.path.join(REPO, "mesh", "__init__.py"))
    assert spec == "None"


def _config_files() -> list[str]:
    """Every file under configs/ (relative paths): what the wheel must ship under jaxrl_hf/configs/."""
    root = os.path.join(REPO, "configs")
    return sorted(os.path.relpath(os.path.join(b, n), root) for b, _, names in os.walk(root) for n in names)


@pytest.mark.slow
def test_non_editable_install_finds_its_configs_and_runs_the_console_scripts(tmp_path):
    """``pip install --no-deps --no-build-isolation`` of a copy of the source tree into a fresh venv (dependencies
    from this interpreter's site-packages, its editable jaxrl_hf left out): the wheel holds every config file,
    and from a directory outside the repository the installed package loads every algorithm and preset config
    from itself, ``jaxrl-hf-train --help`` / ``jaxrl-hf-export-hf --help`` work, and the installed
    ``jaxrl-hf-train --preset smoke`` trains (one step, its workers importing the installed copy too) and exits 0,
    with its metrics in ``metrics.jsonl`` and, its stderr being no terminal, heartbeat lines instead of bars."""
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", ".venv*", "runs", "__pycache__", "*.egg-info",
                                                               "build", "out", ".pytest_cache", "docs"))
    (source / "docs").mkdir()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "deps_from_test_env.pth"), "w") as fh:  # a plain path: its .pth files stay inert
        fh.write(sysconfig.get_path("purelib") + "\n")
    wheels = tmp_path / "wheels"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(wheels), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = wheels.glob("jaxrl_hf-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in _config_files() if f"jaxrl_hf/configs/{f}" not in names]
    assert not missing, f"configs missing from the wheel: {missing}"
    assert "jaxrl_hf/mesh/__init__.py" in names and not any(n.startswith("configs/") for n in names)
    assert "jaxrl_hf/backends/cpu/csrc/panel_matmul.cc" in names  # the CPU decode kernel's source, built on first use
    assert "jaxrl_hf/backends/cpu/csrc/shared_items.h" in names  # and the header every kernel includes
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                           "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAXRL_HF_CONFIG_DIR")}
    env["JAX_PLATFORMS"] = "cpu"
    code = ("import jaxrl_hf, os\n"
            "from jaxrl_hf.config import ALGOS, config_dir, load_config\n"
            "print(jaxrl_hf.__file__)\nprint(config_dir())\n"
            "for algo in ALGOS:\n    load_config(algo, preset='smoke')\n"
            "for preset in sorted(os.listdir(config_dir() / 'presets')):\n"
            "    load_config('ppo', preset='smoke,' + preset[:-5])\n"
            "print(sorted(os.listdir(config_dir() / 'verl_recipes')))\n")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=outside, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    module, configs, recipes = proc.stdout.splitlines()[:3]
    assert module.startswith(site) and configs == os.path.join(site, "jaxrl_hf", "configs")
    assert recipes == str(sorted(os.listdir(os.path.join(REPO, "configs", "verl_recipes"))))
    for script, expected in (("jaxrl-hf-train", "--preset"), ("jaxrl-hf-export-hf", "--max-shard-size")):
        proc = subprocess.run([str(venv / "bin" / script), "--help"], cwd=outside, env=env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0 and expected in proc.stdout, proc.stderr[-3000:]

    run_dir = tmp_path / "run"
    start = time.perf_counter()
    proc = subprocess.run([str(venv / "bin" / "jaxrl-hf-train"), "--preset", "smoke", "trainer.total_steps=1",
                           f"trainer.run_dir={run_dir}", "trainer.progress_interval_s=1"], cwd=outside, env=env,
                          capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(f"installed smoke run: {seconds:.0f} s")
    (record,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and record["training/global_step"] == 1.0
    for key in ("critic/score/mean", "actor/pg_loss", "response_length/mean", "timing_s/step"):
        assert isinstance(record[key], float), key
    assert [r["step"] for r in map(json.loads, (run_dir / "validation.jsonl").read_text().splitlines())] == [0, 1]
    assert "done: dapo, 1 steps" in proc.stderr
    assert "  ... " in proc.stderr and " s in starting the workers" in proc.stderr  # the heartbeat
    assert "\r" not in proc.stderr  # no bar drawn into a pipe
