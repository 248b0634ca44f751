"""GPU pools keep every GPU of a node visible and pick each process's own explicitly (`node_placement.local_gpu`):
checked with Ray's fake GPU counts on CPU (``ray.init(num_gpus=8)``) in a child process with its own Ray."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxrl_hf.controller.node_placement import NOSET_VISIBLE_DEVICES, local_gpu

SCRIPT = r"""
import json, os, sys
import ray
from ray.util.placement_group import placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from jaxrl_hf.controller.node_placement import NOSET_VISIBLE_DEVICES, local_gpu

ray.init(num_cpus=2, num_gpus=8, include_dashboard=False, log_to_driver=False)

@ray.remote(num_cpus=0, num_gpus=1)
def where():
    return {"ids": [int(i) for i in ray.get_gpu_ids()], "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "local": local_gpu()}

group = placement_group([{"GPU": 1}] * 8, strategy="PACK")
ray.get(group.ready())
out = {}
for name, env in (("noset", NOSET_VISIBLE_DEVICES), ("default", {})):
    out[name] = ray.get([where.options(runtime_env={"env_vars": env}, scheduling_strategy=PlacementGroupSchedulingStrategy(
        group, placement_group_bundle_index=r)).remote() for r in range(8)])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def placements():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_ranks_get_distinct_gpus_and_see_the_whole_node(placements):
    noset = placements["noset"]
    assert sorted(p["local"] for p in noset) == list(range(8))  # one distinct GPU per rank
    for p in noset:
        assert p["ids"] == [p["local"]]  # the id JAX (local_device_ids), vLLM (LOCAL_RANK) and torch (cuda:N) take
        assert p["visible"] is None  # nothing hides the node's other GPUs
    # Ray's default narrows each process to its GPU, which renumbers it cuda:0: what the pools now avoid
    assert all(p["visible"] == str(p["ids"][0]) for p in placements["default"])


def test_local_gpu_needs_exactly_one():
    assert local_gpu([3]) == 3
    with pytest.raises(RuntimeError, match="holds 2 GPUs"):
        local_gpu([0, 1])
    assert NOSET_VISIBLE_DEVICES == {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
