"""Failure reporting, argument errors, and the issue's outside check run as a plain script."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import ray

from jaxrl_hf.controller import (
    Batch,
    ControllerError,
    Dispatch,
    PoolBrokenError,
    ResourcePool,
    Worker,
    WorkerDiedError,
    WorkerGroup,
    WorkerMethodError,
    register,
)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
REPO = Path(__file__).resolve().parents[1]

OUTSIDE_CHECK = textwrap.dedent(
    """
    import jax, numpy as np
    from jaxrl_hf.controller import Batch, Dispatch, ResourcePool, Worker, WorkerGroup, register
    class Echo(Worker):
        @register(dispatch=Dispatch.DP_COMPUTE)
        def echo(self, batch: Batch) -> Batch:
            n = len(batch)
            return batch.union(Batch.from_dict({"procs": np.full(n, jax.process_count()),
                                                "devs": np.full(n, jax.device_count())}))
    pool = ResourcePool("check", num_processes=2, devices_per_process=4)
    out = WorkerGroup(pool, Echo).echo(Batch.from_dict({"x": np.arange(16)}))
    """
)
VERIFY = textwrap.dedent(
    """
    import ray
    assert (out["x"] == np.arange(16)).all() and (out["procs"] == 2).all() and (out["devs"] == 8).all()
    print("OUTSIDE_CHECK_OK", ray.get_runtime_context().gcs_address)
    """
)


class Faulty(Worker):
    def __init__(self, fail_init_on_rank: int = -1):
        if self.rank == fail_init_on_rank:
            raise RuntimeError(f"cannot load weights on rank {self.rank}")

    @register(dispatch=Dispatch.DP_COMPUTE)
    def check_rows(self, batch: Batch) -> Batch:
        if self.rank == 1:
            raise ValueError(f"bad row {int(batch['x'][0])}")
        return batch

    @register(dispatch=Dispatch.ONE_TO_ALL, blocking=False)
    def hang(self, seconds: float) -> int:
        print(f"rank {self.rank} about to wait {seconds} s", file=sys.stderr, flush=True)  # in the death message
        time.sleep(seconds)
        return self.rank

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pids(self) -> int:
        return os.getpid()


class Sink(Worker):
    @register(dispatch=Dispatch.DP_COMPUTE)
    def take(self, batch: Batch) -> Batch:
        return batch


def test_remote_exception_names_role_rank_method_with_traceback(ray_cluster):
    with ResourcePool("faulty", num_processes=2, devices_per_process=1) as pool:
        group = WorkerGroup(pool, Faulty, role="scorer")
        with pytest.raises(WorkerMethodError) as info:
            group.check_rows(Batch.from_dict({"x": np.arange(4)}))
        err = info.value
        assert (err.role, err.rank, err.method, err.remote_type) == ("scorer", 1, "check_rows", "ValueError")
        message = str(err)
        assert "role 'scorer' rank 1 method 'check_rows' raised ValueError" in message
        assert "bad row 2" in message  # rank 1's chunk starts at row 2
        assert 'raise ValueError(f"bad row' in message  # the remote source line, from the traceback
        # a Python exception does not break the pool
        assert len(set(group.pids())) == 2
        # a failed future passed on worker-to-worker reports the producer's failure, not the consumer's
        sink = WorkerGroup(pool, Sink, role="sink")
        with pytest.raises(WorkerMethodError, match=r"role 'scorer' rank 1 method 'check_rows' raised ValueError"):
            sink.take(group.check_rows.submit(Batch.from_dict({"x": np.arange(4)})))

        with pytest.raises(WorkerMethodError, match=r"role 'loader' rank 0 method '__init__' raised RuntimeError"):
            WorkerGroup(pool, Faulty, 0, role="loader")
        WorkerGroup(pool, Faulty, role="loader")  # the failed role's name was released


def test_killed_process_is_reported_not_waited_on(ray_cluster):
    pool = ResourcePool("doomed", num_processes=2, devices_per_process=1)
    try:
        group = WorkerGroup(pool, Faulty, role="victim")
        pids = group.pids()
        future = group.hang(120.0)
        time.sleep(0.5)
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError) as info:
            future.get(timeout_s=60)
        assert time.monotonic() - start < 30
        assert (info.value.pool, info.value.role, info.value.rank, info.value.method) == ("doomed", "victim", 1, "hang")
        message = str(info.value)  # Ray's pid and exit detail, and the last lines of the worker's own log
        assert f"(pid {pids[1]})" in message and "exit detail:" in message, message
        assert "last lines of its log" in message and "rank 1 about to wait 120.0 s" in message, message
        with pytest.raises(PoolBrokenError, match="'doomed' is unusable.*rank 1 died"):
            group.pids()
    finally:
        pool.shutdown()


def test_bad_arguments_get_clear_errors(ray_cluster):
    with pytest.raises(ValueError, match="num_processes must be a positive int"):
        ResourcePool("x", num_processes=0)
    with pytest.raises(ValueError, match="devices_per_process must be a positive int"):
        ResourcePool("x", devices_per_process=0)
    with pytest.raises(ValueError, match="strategy 'TIGHT' not in"):
        ResourcePool("x", strategy="TIGHT")
    with pytest.raises(ControllerError, match=r"ResourcePool 'huge': 1 x \{'CPU': 512.0\} could not be reserved"):
        ResourcePool("huge", cpus_per_process=512, ready_timeout_s=2).start()
    with pytest.raises(TypeError, match="subclass of jaxrl_hf.controller.Worker"):
        WorkerGroup(ResourcePool("unused"), object)


def run_outside_check(env_update: dict, drop: tuple = ()) -> str:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_update)
    proc = subprocess.run(
        [sys.executable, "-c", OUTSIDE_CHECK + VERIFY], cwd="/tmp", env=env,
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("OUTSIDE_CHECK_OK"))
    return line.split()[1]


def test_outside_check_as_plain_script_starts_ray_itself(ray_cluster):
    gcs = run_outside_check({}, drop=("RAY_ADDRESS",))
    assert gcs != ray_cluster  # a fresh local cluster, started lazily by ResourcePool


def test_outside_check_honours_ray_address_of_an_existing_cluster(ray_cluster):
    assert run_outside_check({"RAY_ADDRESS": ray_cluster}) == ray_cluster
