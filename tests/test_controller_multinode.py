"""A worker group spanning two Ray nodes: one multi-controller JAX program across them.

A real 2-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head node and a worker node,
each its own raylet with 1 CPU and a custom resource naming it). The actor pool of a config with
``trainer.nnodes=2 trainer.n_gpus_per_node=2 placement.devices_per_process=2`` puts one process on each node;
the two join one JAX program (2 processes, 4 devices) through ``jax.distributed`` with the coordinator on
rank 0's node, and a jitted computation sharded over all 4 devices matches numpy float64. CPU only: this
checks the placement and the program, not GPUs or a network between machines.
"""

import os
import signal
import sys
import time

import jax
import numpy as np
import pytest
import ray

from _models_helpers import assert_smoke_run_trained
from jaxrl_hf.config import load_config
from jaxrl_hf.controller import (ControllerError, Dispatch, ResourcePool, Worker, WorkerDiedError, WorkerGroup,
                                 register)
from jaxrl_hf.controller import worker_logs
from jaxrl_hf.trainer.roles import make_pool

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

NODE_MARKERS = ("jaxrl_hf_test_head", "jaxrl_hf_test_worker")
FORWARDED = "JAXRL_HF_TEST_FORWARDED"  # set in the driver after the nodes started: only forwarding delivers it


@pytest.fixture(scope="module")
def two_nodes():
    """A head node and one worker node; the driver connects to them. Torn down (cluster and connection) after
    the module, so no Ray state reaches other tests."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("this process is already connected to a Ray cluster; the test needs its own 2-node cluster")
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "num_gpus": 0, "resources": {NODE_MARKERS[0]: 1}, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, num_gpus=0, resources={NODE_MARKERS[1]: 1})
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        os.environ[FORWARDED] = "from-the-driver"
        yield cluster
    finally:
        os.environ.pop(FORWARDED, None)
        ray.shutdown()
        cluster.shutdown()


class CrossNode(Worker):
    """One process per node; a mesh over all 4 devices of the program."""

    def __init__(self):
        self.build_mesh({"dp": jax.device_count()})

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def where(self) -> dict:
        return {"node_id": ray.get_runtime_context().get_node_id(), "env": os.environ.get(FORWARDED),
                "process_index": jax.process_index(), "process_count": jax.process_count(),
                "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
                "mesh_processes": sorted({d.process_index for d in self.mesh.devices.flat})}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def gram_and_column_sums(self, x: np.ndarray, w: np.ndarray) -> dict:
        """(XW)ᵀ(XW) and the column sums of XW with X's rows sharded over both nodes' devices (each process
        supplies only the rows of its own devices); the contractions over rows cross the processes."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        rows = NamedSharding(self.mesh, P("dp"))
        xs = jax.make_array_from_callback(x.shape, rows, lambda index: x[index])
        replicated = NamedSharding(self.mesh, P())

        def stats(a, b):
            y = a @ b
            return y.T @ y, jax.shard_map(lambda v: jax.lax.psum(v.sum(0), "dp"), mesh=self.mesh,
                                          in_specs=P("dp"), out_specs=P())(y)

        gram, colsum = jax.jit(stats, out_shardings=(replicated, replicated))(xs, jax.device_put(w, replicated))
        local_rows = sorted({int(s.index[0].start or 0) for s in xs.addressable_shards})
        return {"gram": np.asarray(gram.addressable_shards[0].data),
                "colsum": np.asarray(colsum.addressable_shards[0].data), "local_row_starts": local_rows}


def test_pool_spans_both_nodes_as_one_jax_program(two_nodes):
    config = load_config("grpo", preset="smoke", overrides=[
        "trainer.nnodes=2", "trainer.n_gpus_per_node=2", "placement.devices_per_process=2",
        "placement.cpus_per_process=0.25", "actor.ppo_micro_batch_size_per_device=1", "trainer.ray_init_timeout_s=60"])
    pool = make_pool(config, "actor")
    assert (pool.num_processes, pool.devices_per_process, pool.nnodes) == (2, 2, 2)
    try:
        group = WorkerGroup(pool, CrossNode)
        where = group.where()
        node_ids = [w["node_id"] for w in where]
        assert node_ids[0] != node_ids[1]  # one process on each node
        markers = {n["NodeID"]: [m for m in NODE_MARKERS if m in n["Resources"]] for n in ray.nodes() if n["Alive"]}
        assert sorted(m for node in node_ids for m in markers[node]) == sorted(NODE_MARKERS)
        assert [i["node_id"] for i in pool.process_info] == node_ids
        for rank, w in enumerate(where):
            counts = (w["process_index"], w["process_count"], w["device_count"], w["local_device_count"])
            assert counts == (rank, 2, 4, 2)
            assert w["mesh_processes"] == [0, 1] and w["env"] == "from-the-driver"
        rng = np.random.default_rng(0)
        x, w = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 3)).astype(np.float32)
        y = x.astype(np.float64) @ w.astype(np.float64)
        results = group.gram_and_column_sums(x, w)
        assert [r["local_row_starts"] for r in results] == [[0, 2], [4, 6]]  # each node holds half of X
        for r in results:  # both ranks hold the global result
            np.testing.assert_allclose(r["gram"], y.T @ y, rtol=1e-5, atol=1e-4)
            np.testing.assert_allclose(r["colsum"], y.sum(0), rtol=1e-5, atol=1e-5)
    finally:
        pool.shutdown()


def test_pool_needing_more_nodes_than_the_cluster_has_fails_naming_it(two_nodes):
    pool = ResourcePool("three_nodes", num_processes=3, nnodes=3, cpus_per_process=0.1, ready_timeout_s=2)
    with pytest.raises(ControllerError, match=r"ResourcePool 'three_nodes': 3 nodes x \{'CPU': 0.1\} .*STRICT_SPREAD.*"
                                              r"could not be reserved within 2 s.*alive nodes") as info:
        pool.start()
    assert all(marker in str(info.value) for marker in NODE_MARKERS)  # the two nodes it could have used
    assert not pool.started
    pending = [g for g in ray.util.placement_group_table().values()
               if g["name"].startswith("jaxrl_hf.three_nodes.") and g["state"] != "REMOVED"]
    assert pending == []  # the reservation was given back


@pytest.mark.slow
def test_grpo_smoke_on_two_nodes(two_nodes, tmp_path):
    """``launch/train.py --algo grpo --preset smoke trainer.nnodes=2 trainer.n_gpus_per_node=2
    placement.devices_per_process=2`` on the 2-node cluster: the actor pool (one process per node) rolls out,
    trains and checkpoints for 2 steps."""
    from jaxrl_hf.trainer import run

    run_dir = tmp_path / "run"
    overrides = [f"trainer.run_dir={run_dir}", "trainer.nnodes=2", "trainer.n_gpus_per_node=2",
                 "placement.devices_per_process=2", "actor.ppo_micro_batch_size_per_device=1",
                 "trainer.val_before_train=false", "trainer.compilation_cache_dir=null"]
    assert run("grpo", preset="smoke", overrides=overrides) == 0
    assert_smoke_run_trained(run_dir, 2)
    assert os.path.isdir(run_dir / "checkpoints" / "global_step_2" / "actor")  # written by both nodes' processes


class LastWords(Worker):
    """Says a line in its log, then waits until killed."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def node_and_pid(self) -> tuple:
        return ray.get_runtime_context().get_node_id(), os.getpid()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def say(self) -> None:
        print(f"rank {self.rank} last words on its own node", file=sys.stderr, flush=True)

    @register(dispatch=Dispatch.ONE_TO_ALL, blocking=False)
    def wait(self, seconds: float) -> None:
        time.sleep(seconds)


def test_a_worker_killed_on_the_other_node_is_named_with_its_log_fetched_from_that_node(two_nodes, tmp_path,
                                                                                          monkeypatch):
    """The driver's own log lookup finds nothing (an empty directory stands in for this machine's Ray logs), so
    the tail in the message can only come from the dead worker's node: through Ray's state API where the cluster
    runs the dashboard, otherwise (minimal Ray, as here) through a task pinned to that node."""
    pool = ResourcePool("far", num_processes=2, nnodes=2, cpus_per_process=0.25, ready_timeout_s=180)  # a busy 2-core CPU starts two Ray nodes slowly
    try:
        group = WorkerGroup(pool, LastWords, role="far_worker")
        driver_node = ray.get_runtime_context().get_node_id()
        where = group.node_and_pid()
        rank = next(r for r, (node, _) in enumerate(where) if node != driver_node)
        node, pid = where[rank]
        group.say()  # written to the log before the kill
        future = group.wait(120.0)
        monkeypatch.setattr(worker_logs, "ray_logs_dir", lambda: str(tmp_path))  # nothing local for any pid
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            future.get(timeout_s=60)
        assert time.monotonic() - start < 30
        assert (info.value.pool, info.value.role, info.value.rank, info.value.method) == ("far", "far_worker", rank,
                                                                                         "wait")
        message = str(info.value)
        assert f"(pid {pid})" in message and f"on node {node[:8]}" in message, message
        assert ("fetched by a task on that node" in message or "fetched through Ray's state API" in message), message
        assert f"rank {rank} last words on its own node" in message, message
        assert not os.listdir(tmp_path)
    finally:
        pool.shutdown()


def test_fetching_a_log_from_a_node_that_is_gone_gives_up_in_time(two_nodes):
    start = time.monotonic()
    answer = worker_logs.remote_log_tail(12345, "ab" * 28, timeout_s=3)
    assert time.monotonic() - start < 8
    assert isinstance(answer, str) and answer.startswith("could not fetch its log from node abababab"), answer
