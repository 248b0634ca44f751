"""Worker groups on real Ray actors forming real multi-controller JAX programs.

Two pools share one local Ray cluster: ``main`` (2 processes x 4 fake CPU devices = one 8-device JAX
program) and ``side`` (1 process x 2 devices). Test workers are defined here and shipped to the
processes by value.
"""

import os
import sys
import time

import jax
import numpy as np
import pytest
import ray

from jaxrl_hf.controller import (
    PAD_ROWS_KEY,
    Batch,
    Dispatch,
    GroupFuture,
    MeshCoords,
    RankCall,
    ResourcePool,
    Worker,
    WorkerGroup,
    colocate,
    register,
)
from jaxrl_hf.controller.worker import process_local_rows

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def main_pool(ray_cluster):
    pool = ResourcePool("main", num_processes=2, devices_per_process=4)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def side_pool(ray_cluster):
    pool = ResourcePool("side", num_processes=1, devices_per_process=2)
    yield pool
    pool.shutdown()


# ---------------------------------------------------------------------------- the outside check
class Echo(Worker):
    @register(dispatch=Dispatch.DP_COMPUTE)
    def echo(self, batch: Batch) -> Batch:
        n = len(batch)
        return batch.union(Batch.from_dict({"procs": np.full(n, jax.process_count()),
                                            "devs": np.full(n, jax.device_count())}))


def test_outside_check_two_processes_form_one_8_device_program(main_pool):
    out = WorkerGroup(main_pool, Echo).echo(Batch.from_dict({"x": np.arange(16)}))
    np.testing.assert_array_equal(out["x"], np.arange(16))
    assert (out["procs"] == 2).all() and (out["devs"] == 8).all()
    info = main_pool.process_info
    assert [i["process_index"] for i in info] == [0, 1] and info[0]["pid"] != info[1]["pid"]
    assert all(i["local_device_count"] == 4 for i in info)


# ---------------------------------------------------------------------------- collectives
class Summer(Worker):
    def __init__(self, axis: str):
        self.build_mesh({axis: jax.device_count()})
        self.axis = axis

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def psum_of_device_ids(self) -> float:
        """Each of the 8 devices contributes (global position + 1); psum over all = 36."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        local = np.arange(4, dtype=np.float32) + 4 * jax.process_index() + 1
        x = jax.make_array_from_process_local_data(NamedSharding(self.mesh, P(self.axis)), local)
        psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, self.axis), mesh=self.mesh,
                                     in_specs=P(self.axis), out_specs=P()))
        return float(np.asarray(psum(x).addressable_shards[0].data)[0])

    @register(dispatch=Dispatch.DP_COMPUTE_METRIC)
    def global_sum(self, batch: Batch) -> dict:
        """Sum of the whole batch, computed by one jitted program over both processes' rows."""
        from jax.sharding import NamedSharding, PartitionSpec as P

        x = jax.make_array_from_process_local_data(NamedSharding(self.mesh, P(self.axis)), batch["v"])
        total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(self.mesh, P()))(x)
        return {"rank": self.rank, "sum": float(np.asarray(total.addressable_shards[0].data))}


def test_psum_and_global_reduction_span_both_processes(main_pool):
    group = WorkerGroup(main_pool, Summer, "dp")
    assert group.psum_of_device_ids() == [36.0, 36.0]
    values = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    metrics = group.global_sum(Batch.from_dict({"v": values}))
    reference = float(values.astype(np.float64).sum())
    assert [m["rank"] for m in metrics] == [0, 1]
    for m in metrics:  # both ranks hold the global result, not their half
        assert m["sum"] == pytest.approx(reference, abs=1e-5)
    group.close()


# ---------------------------------------------------------------------------- mesh-aware protocol
class TensorParallel(Worker):
    """Mesh (dp=4, tp=2) whose tp axis spans the two processes: both get the whole batch."""

    def __init__(self):
        devices = np.array(jax.devices()).reshape(2, 4).T  # [i, j] = device i of process j
        self.build_mesh({"dp": 4, "tp": 2}, devices)

    @register(dispatch=Dispatch.MESH_DP)
    def forward(self, batch: Batch) -> Batch:
        from jax.sharding import NamedSharding, PartitionSpec as P

        x = jax.make_array_from_process_local_data(NamedSharding(self.mesh, P("dp")), batch["x"])
        y = jax.jit(lambda a: a * 3.0, out_shardings=NamedSharding(self.mesh, P("dp")))(x)
        return Batch.from_dict({"y": process_local_rows(y), "rank": np.full(len(batch), self.rank)})

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def coords(self) -> dict:
        return self.mesh_coords().as_dict()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def use_data_parallel_mesh(self) -> None:
        """Rebuild the mesh as dp=8 (e.g. switching from training to generation layout)."""
        self.build_mesh({"dp": 8})


def test_mesh_dp_replicates_across_tp_and_collects_tp0(main_pool):
    group = WorkerGroup(main_pool, TensorParallel)
    assert group.layout.coords == (MeshCoords(0, 1, 0, 2, 0, 1), MeshCoords(0, 1, 1, 2, 0, 1))
    assert [c["tp_rank"] for c in group.coords()] == [0, 1]
    x = np.arange(8, dtype=np.float32)
    out = group.forward(Batch.from_dict({"x": x}))
    np.testing.assert_allclose(out["y"], 3 * x)
    assert (out["rank"] == 0).all()  # only tp rank 0 contributes; rank 1 computed the same rows
    group.use_data_parallel_mesh()
    assert group.refresh_layout().coords == (MeshCoords(0, 2), MeshCoords(1, 2))
    out = group.forward(Batch.from_dict({"x": x}))
    np.testing.assert_allclose(out["y"], 3 * x)
    np.testing.assert_array_equal(out["rank"], [0] * 4 + [1] * 4)  # now split by dp across processes
    group.close()


# ---------------------------------------------------------------------------- protocols over Ray
def first_rank_only(layout, outputs):
    return outputs[0]


def per_rank_offsets(layout, args, kwargs):
    return [RankCall((10 * rank,) + args, kwargs) for rank in range(layout.world_size)]


class Sampler(Worker):
    @register(dispatch=Dispatch.DP_COMPUTE)
    def sample(self, batch: Batch, n: int) -> Batch:
        """n interleaved samples per prompt, tagged with the rank and its padding count."""
        out = batch.repeat(n, interleave=True)
        return out.union(Batch.from_dict({
            "rank": np.full(len(out), self.rank),
            "sample": np.tile(np.arange(n), len(batch)),
            "seen_pad": np.full(len(out), batch.meta_info[PAD_ROWS_KEY]),
        }))

    @register(dispatch=Dispatch.ALL_TO_ALL)
    def scale(self, x: float) -> float:
        return x * (self.rank + 1)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def whoami(self, prefix: str) -> str:
        return f"{prefix}{self.rank}/{jax.process_index()}"

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def count_rows(self, batch: Batch) -> int:
        return len(batch)

    @register(dispatch=(per_rank_offsets, first_rank_only))
    def offset(self, base: int, x: int) -> int:
        return base + x + self.rank


def test_protocols_over_ray_with_padding(main_pool):
    group = WorkerGroup(main_pool, Sampler)
    prompts = [f"q{i}" for i in range(13)]
    out = group.sample(Batch.from_dict({"prompt": prompts, "id": np.arange(13)}), n=2)
    # 13 rows on 2 ranks: padded to 14, rank 1 saw one padding row whose samples were dropped
    assert list(out["prompt"]) == [p for p in prompts for _ in range(2)]
    np.testing.assert_array_equal(out["sample"], np.tile([0, 1], 13))
    np.testing.assert_array_equal(out["rank"], np.repeat([0, 1], [14, 12]))
    np.testing.assert_array_equal(out["seen_pad"], np.repeat([0, 1], [14, 12]))
    assert group.scale([1.5, 2.0]) == [1.5, 4.0]
    assert group.whoami("r") == ["r0/0", "r1/1"]
    # futures into ONE_TO_ALL (every rank resolves the whole value) and ALL_TO_ALL (rank i <- rank i)
    assert group.count_rows(group.sample.submit(Batch.from_dict({"id": np.arange(5)}), n=3)) == [15, 15]
    assert group.scale(group.scale.submit([1.0, 1.0])) == [1.0, 4.0]
    big = Batch.from_dict({"x": np.zeros((600, 1024), np.float32)})  # 2.4 MB: put once, shared
    assert group.count_rows(big) == [600, 600]
    assert group.offset(5) == 5  # custom dispatch: rank r gets base 10*r; custom collect: rank 0 only
    with pytest.raises(ValueError, match="ALL_TO_ALL argument #0 must be a list with one element per rank"):
        group.scale([1.0])
    group.close()


# ---------------------------------------------------------------------------- colocation
class ActorRole(Worker):
    def __init__(self):
        self.params = np.ones(3)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def update_actor(self, delta: float) -> dict:
        self.params = self.params + delta
        return {"pid": os.getpid(), "process_index": jax.process_index(), "params": self.params.tolist()}

    @register(dispatch=Dispatch.ONE_TO_ALL, blocking=False)
    def busy(self, seconds: float) -> float:
        time.sleep(seconds)
        return time.monotonic()


class RefRole(Worker):
    @register(dispatch=Dispatch.DP_COMPUTE)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        return Batch.from_dict({"ref_log_prob": -batch["x"], "pid": np.full(len(batch), os.getpid())})

    @register(dispatch=Dispatch.ONE_TO_ALL, blocking=False)
    def busy(self, seconds: float) -> float:
        time.sleep(seconds)
        return time.monotonic()


def test_colocated_roles_share_processes_and_run_one_after_another(main_pool):
    roles = colocate(main_pool, actor=ActorRole, ref=(RefRole, ()))
    actor, ref = roles.actor, roles.ref
    with pytest.raises(ValueError, match="already hosts role 'actor'"):
        WorkerGroup(main_pool, ActorRole, role="actor")
    with pytest.raises(TypeError, match="colocate role 'critic'"):
        colocate(main_pool, critic=(ActorRole,))
    state = actor.update_actor(0.5)
    logp = ref.compute_ref_log_prob(Batch.from_dict({"x": np.arange(4.0)}))
    pids = [s["pid"] for s in state]
    assert [s["process_index"] for s in state] == [0, 1]
    assert list(logp["pid"]) == [pids[0]] * 2 + [pids[1]] * 2  # same processes, same JAX runtime
    assert [p["pid"] for p in main_pool.process_info] == pids
    np.testing.assert_array_equal(logp["ref_log_prob"], -np.arange(4.0))
    assert actor.update_actor(0.5)[0]["params"] == [2.0, 2.0, 2.0]  # role state persists per role
    # time-sharing: two colocated 1 s calls submitted together finish ~2 s apart
    start = time.monotonic()
    a, r = actor.busy(1.0), ref.busy(1.0)
    assert isinstance(a, GroupFuture)
    a_end, r_end = max(a.get()), max(r.get())
    assert r_end - start >= 1.9 and r_end - a_end >= 0.9
    actor.close()
    ref.close()


# ---------------------------------------------------------------------------- futures
def _restore_tracer(path, value):
    with open(path, "a") as f:
        f.write(f"{os.getpid()} {value}\n")
    return Tracer(path, value)


class Tracer:
    """A per-sample object that logs the pid of every process that unpickles it."""

    def __init__(self, path, value):
        self.path, self.value = path, value

    def __reduce__(self):
        return _restore_tracer, (self.path, self.value)


class Producer(Worker):
    @register(dispatch=Dispatch.DP_COMPUTE, blocking=False)
    def generate(self, prompts: Batch, trace_path: str, n: int) -> Batch:
        out = prompts.repeat(n, interleave=True)
        tokens = np.stack([out["id"] * 100 + k for k in range(4)], axis=1)
        tracers = [Tracer(trace_path, int(i)) for i in out["id"]]
        return out.union(Batch.from_dict({"tokens": tokens, "tracer": tracers}))


class Consumer(Worker):
    @register(dispatch=Dispatch.DP_COMPUTE)
    def score(self, rollout: Batch) -> Batch:
        assert all(t.value == i for t, i in zip(rollout["tracer"], rollout["id"]))
        return Batch.from_dict({"id": rollout["id"], "score": rollout["tokens"].sum(axis=1),
                                "pid": np.full(len(rollout), os.getpid())})


@pytest.mark.parametrize("direction", ["2->1", "1->2", "2->2 colocated"])
def test_future_moves_worker_to_worker_without_the_driver(main_pool, side_pool, tmp_path, direction):
    src_pool, dst_pool = {"2->1": (main_pool, side_pool), "1->2": (side_pool, main_pool),
                          "2->2 colocated": (main_pool, main_pool)}[direction]
    producer = WorkerGroup(src_pool, Producer, role="producer")
    consumer = WorkerGroup(dst_pool, Consumer, role="consumer")
    trace = tmp_path / "unpickled_by.txt"
    future = producer.generate(Batch.from_dict({"id": np.arange(7)}), str(trace), n=3)  # 21 rows
    assert isinstance(future, GroupFuture)
    scored = consumer.score(future)
    ids = np.repeat(np.arange(7), 3)
    np.testing.assert_array_equal(scored["id"], ids)
    np.testing.assert_array_equal(scored["score"], 4 * 100 * ids + 6)
    reads = [tuple(map(int, line.split())) for line in trace.read_text().splitlines()]
    readers = {pid for pid, _ in reads}
    consumer_pids = [p["pid"] for p in dst_pool.process_info]
    assert os.getpid() not in readers, "the driver deserialised the producer's data"
    assert readers == set(consumer_pids) == set(scored["pid"].tolist())
    if direction == "2->2 colocated":
        # producer rank 0 made prompts 0-3 (12 rows), rank 1 prompts 4-6; consumer rank 0 takes rows
        # 0-10, all from producer rank 0, so it must not have fetched producer rank 1's output
        assert {value for pid, value in reads if pid == consumer_pids[0]} <= {0, 1, 2, 3}
    producer.close()
    consumer.close()


def test_groups_on_disjoint_pools_run_concurrently(main_pool, side_pool):
    a = WorkerGroup(main_pool, ActorRole, role="concurrent_a")
    b = WorkerGroup(side_pool, RefRole, role="concurrent_b")
    start = time.monotonic()
    fa, fb = a.busy(2.0), b.busy(2.0)
    fa.get(), fb.get()
    elapsed = time.monotonic() - start
    assert 2.0 <= elapsed < 3.5, f"disjoint pools took {elapsed:.2f} s for two 2 s calls (serial = 4 s)"
    a.close()
    b.close()
