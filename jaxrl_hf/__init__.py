"""jaxrl_hf: reinforcement learning for LLMs on JAX/XLA in the HybridFlow design.

Sub-packages, one concern each:
  algos/       pure-function advantage estimators, policy/value losses, KL estimators, DAPO pieces
  models/      flax Llama/Qwen2/Qwen3/Mistral/Gemma 2/Gemma 3 decoder, weight import/export, hub-cache ids, tokenizer
  rollout/     generation engines (native JAX, vLLM)
  controller/  single controller: resource pools, worker groups, transfer protocols, Batch
  workers/     actor/critic/reference/reward workers
  trainer/     the RL control flow per algorithm
  rewards/     rule scorers and reward managers
  data/        datasets and resumable loaders
  placement/   auto device mapping (HybridFlow Algorithm 1)
  registry.py  the name -> object registry every pluggable piece is looked up in
  user_modules.py  imports the user's own code (``--import``) so what it registers is there by name
  mesh         device meshes, logical-axis rule sets, the 3D-HybridEngine (the repository's top-level ``mesh/``)

The design keeps the mesh code in a top-level ``mesh/`` folder. It is never a bare top-level module: an install
maps it to ``jaxrl_hf.mesh`` (``package-dir`` in pyproject.toml), and in a source checkout (no install, or a
copy on another machine) the finder below resolves ``jaxrl_hf.mesh`` to the ``mesh/`` beside this package.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.1.0"

_HERE = os.path.dirname(os.path.abspath(__file__))
_CHECKOUT_MESH = os.path.join(os.path.dirname(_HERE), "mesh")


class _CheckoutMeshFinder(importlib.abc.MetaPathFinder):
    """Resolves exactly ``jaxrl_hf.mesh`` to the ``mesh/`` folder next to this package (source checkouts)."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 (importlib protocol)
        if fullname != __name__ + ".mesh":
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(_CHECKOUT_MESH, "__init__.py"), submodule_search_locations=[_CHECKOUT_MESH])


if not os.path.isdir(os.path.join(_HERE, "mesh")) and os.path.isfile(os.path.join(_CHECKOUT_MESH, "__init__.py")):
    if not any(isinstance(f, _CheckoutMeshFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _CheckoutMeshFinder())
