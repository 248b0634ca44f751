"""Single controller (HybridFlow §2.4): the driver holds the RL control flow, worker groups hold
the models.

* `Batch` — the container flowing between roles (arrays + per-sample objects + meta info).
* `ResourcePool` — a named set of processes/devices backed by a Ray placement group; its processes
  form one multi-controller JAX program.
* `Worker` + `register` — a role's per-process code and its transfer protocols (`Dispatch`).
* `WorkerGroup` — the driver's handle on a role in every process of a pool; calls dispatch,
  run and collect, or return a `GroupFuture` that can feed another group worker-to-worker.

Colocation: several `WorkerGroup`s on one `ResourcePool` share its processes and JAX runtime
(`colocate(pool, actor=..., ref=...)` creates them together).

Ray is imported only by the Ray-backed names (`ResourcePool`, `ensure_ray`, `WorkerGroup`, `GroupMethod`,
`colocate`), on first access: a worker driven in-process (launch/bench/bench_gpu.py, the benches) runs without
Ray installed.
"""

from jaxrl_hf.controller.batch import PAD_ROWS_KEY, Batch
from jaxrl_hf.controller.errors import (ControllerError, PoolBrokenError, WorkerDiedError, WorkerMethodError,
                                        WorkerTimeoutError)
from jaxrl_hf.controller.futures import GroupFuture, set_call_timeout
from jaxrl_hf.controller.layout import GroupLayout, MeshCoords, coords_from_mesh, coords_from_process_grid
from jaxrl_hf.controller.protocols import Dispatch, Protocol, RankCall, register
from jaxrl_hf.controller.worker import Worker, WorkerContext, process_local_rows

_RAY_BACKED = {"ResourcePool": "resource_pool", "ensure_ray": "resource_pool", "GroupMethod": "worker_group",
               "WorkerGroup": "worker_group", "colocate": "worker_group"}


def __getattr__(name: str):
    """The Ray-backed names, imported (with Ray) on first access (PEP 562)."""
    if name in _RAY_BACKED:
        import importlib

        value = getattr(importlib.import_module(f"jaxrl_hf.controller.{_RAY_BACKED[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "PAD_ROWS_KEY",
    "Batch",
    "ControllerError",
    "Dispatch",
    "GroupFuture",
    "GroupLayout",
    "GroupMethod",
    "MeshCoords",
    "PoolBrokenError",
    "Protocol",
    "RankCall",
    "ResourcePool",
    "Worker",
    "WorkerContext",
    "WorkerDiedError",
    "WorkerTimeoutError",
    "set_call_timeout",
    "WorkerGroup",
    "WorkerMethodError",
    "colocate",
    "coords_from_mesh",
    "coords_from_process_grid",
    "ensure_ray",
    "process_local_rows",
    "register",
]
