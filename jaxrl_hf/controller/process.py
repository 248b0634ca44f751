"""`ProcessHost`: the Ray actor behind one process of a resource pool.

It owns the process's JAX runtime (device count, ``jax.distributed`` membership) and hosts the
worker instances of every role placed on the pool (colocation = several roles in one host). Calls
run one at a time in submission order, which keeps all processes of an SPMD program in step.
This module must not import jax at top level: the device count is fixed before JAX starts.
"""

from __future__ import annotations

import os
import socket
import traceback
from typing import Any

import ray

from jaxrl_hf.controller.batch import PAD_ROWS_KEY, Batch
from jaxrl_hf.controller.errors import WorkerMethodError
from jaxrl_hf.controller.futures import resolve_deferred
from jaxrl_hf.controller.layout import MeshCoords
from jaxrl_hf.controller.node_placement import local_gpu
from jaxrl_hf.controller.worker import Worker, WorkerContext

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def configure_host_devices(platform: str, devices_per_process: int) -> None:
    """Pin this process's JAX platform and CPU device count; must run before JAX initialises."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_DEVICE_COUNT_FLAG)]
    if platform == "cpu":
        flags.append(f"{_DEVICE_COUNT_FLAG}={devices_per_process}")
        os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = " ".join(flags)
    import jax

    if platform == "cpu":
        jax.config.update("jax_num_cpu_devices", devices_per_process)


def trim_padding(output: Any, pad_rows: int, input_rows: int | None) -> Any:
    """Drop the rows a Batch output produced from padding input rows (``k`` outputs per input row
    for an output ``k`` times as long as the input, e.g. interleaved samples)."""
    if not isinstance(output, Batch):
        return output
    meta = {k: v for k, v in output.meta_info.items() if k != PAD_ROWS_KEY}
    output = Batch(output.arrays, output.objects, meta)
    if pad_rows == 0:
        return output
    if not input_rows or len(output) % input_rows:
        raise ValueError(
            f"the input chunk had {pad_rows} padding rows out of {input_rows}, but the output Batch has "
            f"{len(output)} rows (not a multiple), so the padding rows cannot be removed; return k "
            "rows per input row, or use a dispatch that does not pad"
        )
    return output.unpad(pad_rows * (len(output) // input_rows))


class ProcessHost:
    """One process of a pool: JAX runtime + the worker instances of all roles placed on it."""

    def __init__(self, pool_name: str, rank: int, world_size: int, platform: str, devices_per_process: int):
        configure_host_devices(platform, devices_per_process)
        self.pool_name, self.rank, self.world_size, self.platform = pool_name, rank, world_size, platform
        self._workers: dict[str, Worker] = {}

    def coordinator_address(self) -> str:
        """``ip:port`` of a free port on this node (rank 0's, which serves JAX's coordination service), as the
        other nodes reach it: the node's IP as Ray knows it, never a loopback address."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, coordinator: str | None, timeout_s: int) -> dict[str, Any]:
        """Join the pool's multi-controller JAX program (all ranks must call this together)."""
        import jax

        gpu = None
        if self.platform == "gpu":  # every GPU of the node is visible: take Ray's one explicitly (node_placement)
            gpu = local_gpu()
            if self.world_size == 1:
                jax.config.update("jax_cuda_visible_devices", str(gpu))
        if self.world_size > 1:
            jax.distributed.initialize(
                coordinator, self.world_size, self.rank, initialization_timeout=int(timeout_s),
                local_device_ids=None if gpu is None else [gpu],
            )
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "local_device_count": jax.local_device_count(),
            "backend": jax.default_backend(),  # "cpu" in a GPU pool = no CUDA plugin (checked by the trainer)
            "gpu": gpu,
        }

    def import_user_modules(self, specs: tuple[str, ...]) -> None:
        """Import the pool's user modules in this process (`jaxrl_hf.user_modules`), before any role exists."""
        from jaxrl_hf.user_modules import import_user_modules

        try:
            import_user_modules(specs)
        except Exception as err:  # noqa: BLE001 - reported with pool/rank to the driver
            raise WorkerMethodError("<pool>", self.rank, "import_user_modules", type(err).__name__,
                                    traceback.format_exc()) from None

    def pid(self) -> int:
        """OS process id (tests use it to kill a process)."""
        return os.getpid()

    def add_role(self, role: str, spec: tuple[bytes, tuple, dict]) -> MeshCoords:
        """Instantiate the pickled worker class with ``(args, kwargs)`` for ``role``; return its
        mesh coordinates."""
        class_bytes, args, kwargs = spec
        if role in self._workers:
            raise ValueError(f"role {role!r} already exists on pool {self.pool_name!r} rank {self.rank}")
        context = WorkerContext(role, self.pool_name, self.rank, self.world_size)
        try:
            try:
                worker_cls = ray.cloudpickle.loads(class_bytes)
            except ImportError as err:
                raise ImportError(
                    f"the worker class cannot be unpickled in process {self.rank} of pool "
                    f"{self.pool_name!r}: {err}. Define it in an importable module (an installed "
                    "package), in the driver's __main__, or call "
                    "ray.cloudpickle.register_pickle_by_value(module) on the driver"
                ) from err
            worker = worker_cls._instantiate(context, tuple(args), dict(kwargs))
            coords = worker.mesh_coords()
        except Exception as err:  # noqa: BLE001 - reported with role/rank to the driver
            raise WorkerMethodError(role, self.rank, "__init__", type(err).__name__, traceback.format_exc()) from None
        self._workers[role] = worker
        return coords

    def remove_role(self, role: str) -> None:
        """Forget a role's worker instance (its memory is freed once unreferenced)."""
        self._workers.pop(role, None)

    def mesh_coords(self, role: str) -> MeshCoords:
        """Current mesh coordinates of ``role``'s worker in this process."""
        return self._worker(role).mesh_coords()

    def _worker(self, role: str) -> Worker:
        if role not in self._workers:
            raise KeyError(f"pool {self.pool_name!r} rank {self.rank} hosts no role {role!r}; roles: {list(self._workers)}")
        return self._workers[role]

    def call(self, role: str, method: str, pad_rows: int, kw_names: tuple[str, ...], *values: Any) -> Any:
        """Run ``role.method`` on this rank's arguments (``values`` = positional arguments, then the
        values of keywords ``kw_names``); deferred (future) arguments are fetched here, and output rows
        produced from padding input rows are dropped. Returns (row count or None, output): the
        group calls it with ``num_returns=2`` so the row count is a separate tiny object."""
        try:
            num_args = len(values) - len(kw_names)
            args, kwargs = values[:num_args], dict(zip(kw_names, values[num_args:]))
            resolved_args, resolved_kwargs = [], {}
            for value in args:
                value, pad = resolve_deferred(value)
                resolved_args.append(value)
                pad_rows = max(pad_rows, pad)
            for key, value in kwargs.items():
                resolved_kwargs[key], pad = resolve_deferred(value)
                pad_rows = max(pad_rows, pad)
            batch_rows = {
                name: len(v)
                for name, v in [*((f"#{i}", a) for i, a in enumerate(resolved_args)), *resolved_kwargs.items()]
                if isinstance(v, Batch)
            }
            if pad_rows and len(set(batch_rows.values())) > 1:
                raise ValueError(f"DP-split Batch arguments have different lengths on this rank: {batch_rows}")
            input_rows = next(iter(batch_rows.values()), None)
            output = getattr(self._worker(role), method)(*resolved_args, **resolved_kwargs)
            output = trim_padding(output, pad_rows, input_rows)
            return (len(output) if isinstance(output, Batch) else None), output
        except ray.exceptions.RayTaskError as err:
            if isinstance(getattr(err, "cause", None), WorkerMethodError):
                raise err.cause from None  # an input future failed: report the producer's error
            raise WorkerMethodError(role, self.rank, method, type(err).__name__, traceback.format_exc()) from None
        except Exception as err:  # noqa: BLE001 - reported with role/rank/method to the driver
            raise WorkerMethodError(role, self.rank, method, type(err).__name__, traceback.format_exc()) from None
