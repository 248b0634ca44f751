"""Packaging: every sub-package is installed, and mesh/ is installed as ``jaxrl_hf.mesh``, never as ``mesh``."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        return tomllib.load(fh)


def test_package_list_matches_the_source_tree():
    """The explicit ``packages`` list names every folder with an ``__init__.py`` (a new sub-package that is
    not listed would be missing from a wheel)."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {"jaxrl_hf.mesh"}
    for root, dirs, files in os.walk(os.path.join(REPO, "jaxrl_hf")):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        if "__init__.py" in files:
            found.add(os.path.relpath(root, REPO).replace(os.sep, "."))
    for root, dirs, files in os.walk(os.path.join(REPO, "mesh")):
        dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
        if "__init__.py" in files:
            found.add("jaxrl_hf." + os.path.relpath(root, REPO).replace(os.sep, "."))
    assert listed == found


def test_mesh_maps_into_the_package_namespace():
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == {"jaxrl_hf.mesh": "mesh"}


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
