"""Weight-sync paths (`jaxrl_hf.rollout.sync_plan`): the decision for every kind of leaf and target, the CPU
paths executed on real JAX arrays (zero-copy where the plan says so, values equal everywhere), the JAX-side
gather the GPU path uses run on CPU devices, the metrics, and the sleep/wake accounting. The CUDA execution
itself has not run here (no GPU); these tests cover everything around it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_hf.rollout.engine_memory import SleepMeter
from jaxrl_hf.rollout.sync_plan import (HOST, SYNC_PATHS, LeafPlacement, SyncStats, SyncTarget, TransferPlan,
                                        plan_transfer, sync_metrics)
from jaxrl_hf.rollout.weight_sync import describe_leaf, gather_onto_device, hf_weight_stream, leaf_to_torch

torch = pytest.importorskip("torch")
GPU0, GPU1 = SyncTarget("device", 0), SyncTarget("device", 1)


@pytest.mark.parametrize("leaf, target, path, copies", [
    # CPU (what ran before and runs here)
    (LeafPlacement("host"), HOST, "host_view", 0),                                     # numpy
    (LeafPlacement("host", (0,), "one"), HOST, "host_view", 0),                        # JAX CPU buffer
    (LeafPlacement("host", (0, 1), "replicas"), HOST, "host_view", 0),
    (LeafPlacement("host", (0, 1, 2, 3), "shards"), HOST, "host_gather", 1),
    (LeafPlacement("host", (0, 1), "shards", multi_process=True), HOST, "host_gather", 1),
    # GPU: stays on the device
    (LeafPlacement("device", (0,), "one"), GPU0, "device_view", 0),
    (LeafPlacement("device", (0, 1), "replicas"), GPU0, "device_view", 0),
    (LeafPlacement("device", (0, 1), "replicas"), GPU1, "device_view", 0),
    (LeafPlacement("device", (0, 1, 2, 3), "shards"), GPU0, "device_gather", 1),
    (LeafPlacement("device", (0,), "shards", multi_process=True), GPU0, "device_gather", 1),
    (LeafPlacement("device", (1,), "one"), GPU0, "peer_copy", 1),
    (LeafPlacement("device", (2, 3), "shards"), GPU0, "device_gather", 2),           # gather on cuda:2, then copy
    # mixed memories (JAX on the CPU with vLLM on a GPU is what the doctor flags)
    (LeafPlacement("host", (0,), "one"), GPU0, "host_to_device", 1),
    (LeafPlacement("host", (0, 1), "shards"), GPU0, "host_to_device", 2),
    (LeafPlacement("device", (0,), "one"), HOST, "device_to_host", 1),
])
def test_plan_per_leaf_and_target(leaf, target, path, copies):
    plan = plan_transfer(leaf, target)
    assert plan.path == path and len(plan.copies) == copies, plan
    assert plan.copied == (path not in ("host_view", "device_view"))
    if path == "device_view":
        assert plan.source_device == target.device  # DLPack wraps the buffer on vLLM's own device
    if path == "device_gather":
        assert plan.gather_onto == (target.device if target.device in leaf.devices or leaf.multi_process
                                    else leaf.devices[0])


def test_sync_target_needs_a_device_id_exactly_for_a_device():
    with pytest.raises(ValueError, match="device id"):
        SyncTarget("device")
    with pytest.raises(ValueError, match="device id"):
        SyncTarget("host", 0)
    assert GPU1.torch_device == "cuda:1" and HOST.torch_device == "cpu"


def _mesh():
    return Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("dp", "tp"))


def test_describe_leaf_on_cpu_devices():
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    assert describe_leaf(x) == LeafPlacement("host")
    assert describe_leaf(jnp.asarray(x)).pieces == "one"
    mesh = _mesh()
    replicated = jax.device_put(x, NamedSharding(mesh, P()))
    sharded = jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))
    assert describe_leaf(replicated) == LeafPlacement("host", tuple(range(8)), "replicas")
    assert describe_leaf(sharded) == LeafPlacement("host", tuple(range(8)), "shards")


def test_cpu_paths_alias_or_copy_as_planned():
    x = np.random.default_rng(0).normal(size=(8, 6)).astype(np.float32)
    single = jnp.asarray(x)
    tensor, plan = leaf_to_torch(single, HOST)
    assert plan.path == "host_view"
    assert tensor.data_ptr() == single.unsafe_buffer_pointer()  # zero-copy: the JAX buffer itself
    mesh = _mesh()
    replicated = jax.device_put(x, NamedSharding(mesh, P()))
    tensor, plan = leaf_to_torch(replicated, HOST)
    assert plan.path == "host_view"
    assert tensor.data_ptr() in {s.data.unsafe_buffer_pointer() for s in replicated.addressable_shards}
    sharded = jax.device_put(x, NamedSharding(mesh, P("dp", "tp")))
    tensor, plan = leaf_to_torch(sharded, HOST)
    assert plan.path == "host_gather" and plan.copied
    np.testing.assert_array_equal(tensor.numpy(), x)
    tensor, plan = leaf_to_torch(x, HOST)  # numpy: from_numpy, zero-copy
    assert plan.path == "host_view" and tensor.data_ptr() == x.ctypes.data


def test_gather_onto_one_device_joins_the_shards_there():
    """The JAX half of the GPU ``device_gather`` path (``jax.device_put`` of a sharded array onto vLLM's device),
    run on CPU devices: one buffer on the named device with the full values, which DLPack then wraps."""
    x = np.random.default_rng(1).normal(size=(8, 6)).astype(np.float32)
    sharded = jax.device_put(x, NamedSharding(_mesh(), P("dp", "tp")))
    joined = gather_onto_device(sharded, 3)
    assert joined.sharding.device_set == {jax.devices()[3]}
    np.testing.assert_array_equal(np.asarray(joined), x)
    assert torch.from_dlpack(joined).data_ptr() == joined.unsafe_buffer_pointer()
    with pytest.raises(ValueError, match="no local JAX device with hardware id 99"):
        gather_onto_device(sharded, 99)


def test_stream_stats_and_metrics_by_path():
    from _models_helpers import random_params, tiny_config

    config = tiny_config(vocab_size=96, hidden_size=64, head_dim=32, max_position_embeddings=64)
    params = jax.tree.map(jnp.asarray, random_params(config, seed=2))
    from jaxrl_hf.mesh.rules import train_activation_rules
    from jaxrl_hf.models import param_shardings

    sharded = jax.device_put(params, param_shardings(config, _mesh(), train_activation_rules()))
    total = sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(params))
    for tree, main in ((params, "host_view"), (sharded, None)):
        stream, stats = hf_weight_stream(tree, config)
        names = [name for name, _ in stream]
        assert names[0] == "model.embed_tokens.weight" and stats.bytes_total == total
        assert stats.bytes_zero_copy + stats.bytes_gathered == total == sum(stats.bytes_by_path.values())
        metrics = sync_metrics(stats, 0.25)
        assert metrics["perf/weight_sync_bytes"] == total and metrics["perf/weight_sync_s"] == 0.25
        assert metrics["perf/weight_sync_copied_bytes"] == stats.bytes_gathered
        assert SYNC_PATHS[int(metrics["perf/weight_sync_path"])] == stats.main_path
        if main is not None:
            assert stats.bytes_by_path == {main: total} and stats.bytes_gathered == 0
    # the sharded tree: sharded leaves gathered, replicated ones (norms) aliased
    assert stats.bytes_by_path["host_gather"] == stats.bytes_gathered > 0
    assert stats.bytes_by_path.get("host_view", 0) == stats.bytes_zero_copy


def test_stats_mark_all_copied_and_describe():
    stats = SyncStats()
    stats.add(100, TransferPlan("device_view", source_device=0))
    stats.add(300, TransferPlan("device_gather", ("all-gather",), source_device=0, gather_onto=0))
    assert (stats.bytes_zero_copy, stats.bytes_gathered, stats.main_path) == (100, 300, "device_gather")
    stats.mark_all_copied("device_gather")
    assert stats.bytes_gathered == 400 and stats.bytes_by_path == {"device_gather": 400}
    assert "device_gather 0.0 MB" in stats.describe()


def test_sleep_meter_accounts_freed_and_regained_bytes():
    """The accounting around vLLM's sleep/wake; the reader stands in for ``torch.cuda.mem_get_info`` (no GPU)."""
    free = {"cuda:0": 10_000}
    meter = SleepMeter("cuda:0", free_bytes=lambda device: free[device])
    meter.measure("sleep", lambda: free.update({"cuda:0": 70_000}))        # weights offloaded, KV cache dropped
    meter.measure("wake", lambda: free.update({"cuda:0": 40_000}))         # weights back
    meter.measure("wake", lambda: free.update({"cuda:0": 12_000}))         # KV cache back
    assert meter.metrics() == {"perf/rollout_sleep_freed_bytes": 60_000.0, "perf/rollout_wake_regained_bytes": 58_000.0}
    assert meter.metrics() == {}  # reset after reporting
    host = SleepMeter("cpu", free_bytes=lambda device: pytest.fail("nothing is measured on the host"))
    assert host.measure("sleep", lambda: 7) == 7 and host.metrics() == {}


def test_device_replication_used_across_processes_runs_on_one_process_mesh():
    """`gather_multihost`'s device branch (several JAX processes on GPUs): replicate over the leaf's mesh, then
    take this process's copy on vLLM's device. Its two steps, on a one-process CPU mesh."""
    from jaxrl_hf.rollout.weight_sync import _identity, _replica_on

    x = np.arange(48, dtype=np.float32).reshape(8, 6)
    sharded = jax.device_put(x, NamedSharding(_mesh(), P("dp", "tp")))
    full = jax.jit(_identity, out_shardings=NamedSharding(_mesh(), P()))(sharded)
    local = _replica_on(full, 5)
    assert local.sharding.device_set == {jax.devices()[5]}
    np.testing.assert_array_equal(np.asarray(local), x)
    tensor, plan = leaf_to_torch(local, HOST)  # then the ordinary path: one buffer, aliased
    assert plan.path == "host_view" and tensor.data_ptr() == local.unsafe_buffer_pointer()
