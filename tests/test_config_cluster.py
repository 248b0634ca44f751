"""verl's ``trainer.nnodes`` / ``trainer.n_gpus_per_node`` against ``placement`` (`jaxrl_hf.config.cluster`), the
actor pool built from them, and the placement-group layout of a pool pinned to nodes (no Ray needed here;
``tests/test_controller_multinode.py`` places such pools on a real 2-node Ray cluster)."""

import pytest

from jaxrl_hf.config import ConfigError, config_from_dict, load_config
from jaxrl_hf.controller import ResourcePool
from jaxrl_hf.controller.node_placement import bundle_plan, forwarded_env
from jaxrl_hf.trainer.roles import make_pool

MICRO = "actor.ppo_micro_batch_size_per_device=1"


def placement_of(*overrides: str) -> tuple:
    c = load_config("grpo", preset="smoke", overrides=[MICRO, *overrides])
    p = c.placement
    return c.trainer.nnodes, c.trainer.n_gpus_per_node, p.num_processes, p.devices_per_process, p.train.dp


def test_defaults_leave_the_pool_unpinned_on_one_process():
    assert placement_of() == (None, None, 1, 1, 1)
    assert placement_of("placement.num_processes=2", "placement.devices_per_process=2") == (None, None, 2, 2, 4)


@pytest.mark.parametrize("overrides, expected", [
    # GPU cluster: one process per GPU, n_gpus_per_node processes on each node; dp covers all devices
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=2"], (2, 2, 4, 1, 4)),
    # CPU: a node's "GPUs" are host devices, here two per process -> one process per node
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "placement.devices_per_process=2"], (2, 2, 2, 2, 4)),
    # n_gpus_per_node alone: verl's nnodes default 1
    (["trainer.n_gpus_per_node=4"], (1, 4, 4, 1, 4)),
    # nnodes alone: n_gpus_per_node derived from placement (processes default to one per node)
    (["trainer.nnodes=2"], (2, 1, 2, 1, 2)),
    (["trainer.nnodes=2", "placement.num_processes=4", "placement.devices_per_process=2", "placement.train.tp=2"],
     (2, 4, 4, 2, 4)),
    # both sides given and agreeing
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=4", "placement.num_processes=4", "placement.devices_per_process=2",
      "placement.train.tp=2"], (2, 4, 4, 2, 4)),
    # an explicit dp stays; tp shares the devices with the derived dp
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "placement.train.tp=2"], (2, 2, 4, 1, 2)),
])
def test_cluster_keys_derive_the_actor_pool(overrides, expected):
    assert placement_of(*overrides) == expected


@pytest.mark.parametrize("overrides, message", [
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=4", "placement.num_processes=3"],
     r"'trainer.nnodes' x 'trainer.n_gpus_per_node' = 2 x 4 = 8 devices, but 'placement.num_processes' x "
     r"'placement.devices_per_process' = 3 x 1 = 3"),
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=3", "placement.devices_per_process=2"],
     r"'trainer.n_gpus_per_node'=3: must be a multiple of placement.devices_per_process=2"),
    (["trainer.nnodes=2", "placement.num_processes=3"],
     r"'placement.num_processes'=3: must be a multiple of trainer.nnodes=2"),
    (["trainer.nnodes=0"], r"'trainer.nnodes'=0: must be > 0"),
    (["trainer.n_gpus_per_node=-8"], r"'trainer.n_gpus_per_node'=-8: must be > 0"),
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=3", "placement.train.tp=4"],
     r"pp\*tp=4 must divide the actor pool's 6 devices .* or set placement.train.dp"),
    (["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "placement.train.dp=2"],
     r"pp\*tp\*dp=2 must equal the actor pool's devices .*=4"),
])
def test_inconsistent_cluster_keys_name_them(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("grpo", preset="smoke", overrides=[MICRO, *overrides])


def test_resolved_cluster_config_round_trips_and_builds_a_pinned_actor_pool():
    config = load_config("ppo", preset="smoke,split_critic",
                         overrides=[MICRO, "trainer.nnodes=2", "trainer.n_gpus_per_node=2"])
    assert config_from_dict(config.to_dict()) == config  # a saved config.yaml resolves to itself
    actor = make_pool(config, "actor")
    assert (actor.name, actor.num_processes, actor.devices_per_process, actor.nnodes, actor.strategy) == \
        ("actor", 4, 1, 2, "STRICT_SPREAD")
    critic = make_pool(config, "critic", config.placement.critic)  # a pool of its own is not pinned
    assert (critic.num_processes, critic.nnodes, critic.strategy) == (1, None, "PACK")
    assert not actor.started and not critic.started


def test_bundle_plan_pins_consecutive_ranks_to_per_node_bundles():
    loose = bundle_plan(3, 0.25, 0, nnodes=None, strategy="PACK")
    assert loose.bundles == ({"CPU": 0.25},) * 3 and loose.bundle_of_rank == (0, 1, 2) and loose.strategy == "PACK"
    assert loose.describe() == "3 x {'CPU': 0.25}"
    gpu = bundle_plan(8, 0.5, 1, nnodes=2, strategy="STRICT_SPREAD")
    assert gpu.bundles == ({"CPU": 2.0, "GPU": 4.0},) * 2  # one bundle per node: 4 processes' CPU and GPUs
    assert gpu.bundle_of_rank == (0, 0, 0, 0, 1, 1, 1, 1) and gpu.process_resources == {"CPU": 0.5, "GPU": 1.0}
    assert gpu.describe() == ("2 nodes x {'CPU': 2.0, 'GPU': 4.0} (STRICT_SPREAD: each bundle on a different Ray "
                              "node, holding 4 processes of {'CPU': 0.5, 'GPU': 1.0})")
    empty = bundle_plan(2, 0, 0, nnodes=1, strategy="STRICT_SPREAD")  # a bundle is never empty
    assert empty.bundles == ({"CPU": 0.002},) and empty.process_resources == {"CPU": 0.001}


def test_pool_arguments_for_nodes_are_checked_before_starting():
    with pytest.raises(ValueError, match=r"ResourcePool 'p': 3 processes cannot be spread evenly over nnodes=2"):
        ResourcePool("p", num_processes=3, nnodes=2)
    with pytest.raises(ValueError, match=r"ResourcePool 'p': a pool pinned to nnodes=2 .* got strategy='PACK'"):
        ResourcePool("p", num_processes=2, nnodes=2, strategy="PACK")
    with pytest.raises(ValueError, match=r"ResourcePool 'p': nnodes must be a positive int or None, got 0"):
        ResourcePool("p", num_processes=2, nnodes=0)
    assert ResourcePool("p", num_processes=2).strategy == "PACK"


def test_forwarded_env_keeps_what_configures_jax_and_the_code_path():
    env = {"XLA_FLAGS": "--x", "JAX_COMPILATION_CACHE_DIR": "/c", "NCCL_SOCKET_IFNAME": "eth0", "HF_HOME": "/h",
           "PYTHONPATH": "/code", "JAXRL_HF_VLLM": "none", "JAX_PLATFORMS": "cpu", "CUDA_VISIBLE_DEVICES": "0",
           "HOME": "/home/u", "RAY_ADDRESS": "h:6379", "PATH": "/bin"}
    assert forwarded_env(env) == {"XLA_FLAGS": "--x", "JAX_COMPILATION_CACHE_DIR": "/c", "NCCL_SOCKET_IFNAME": "eth0",
                                  "HF_HOME": "/h", "PYTHONPATH": "/code", "JAXRL_HF_VLLM": "none"}
