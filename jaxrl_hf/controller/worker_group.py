"""`WorkerGroup`: the driver's handle on one role running in every process of a resource pool.

``WorkerGroup(pool, worker_cls, *init_args)`` instantiates ``worker_cls`` in each process of ``pool``
(after the processes have joined one multi-controller JAX program) and exposes each `register`-ed
method as a group method: calling it dispatches the arguments with the method's protocol, runs all
ranks, and collects (blocking) or returns a `GroupFuture` (``blocking=False``, or `GroupMethod.submit`).

Colocation: groups created on the *same* pool object share its processes and JAX runtime and run one
after another; each stays addressable on its own::

    pool = ResourcePool("actor_ref", num_processes=8)
    actor = WorkerGroup(pool, ActorWorker, cfg, role="actor")
    ref = WorkerGroup(pool, ReferenceWorker, cfg, role="ref")
    ref.compute_ref_log_prob(batch); actor.update_actor(batch)
    # or, the same in one call:
    roles = colocate(pool, actor=(ActorWorker, (cfg,)), ref=(ReferenceWorker, (cfg,)))
    roles.ref.compute_ref_log_prob(batch); roles.actor.update_actor(batch)

Groups on different pools run concurrently; pass one's future to the other to move data
worker-to-worker.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import ray

from jaxrl_hf.controller.batch import Batch
from jaxrl_hf.controller.futures import GroupFuture, RankRef, gather_results
from jaxrl_hf.controller.layout import GroupLayout
from jaxrl_hf.controller.protocols import Protocol, Registration, RankCall, registered_methods
from jaxrl_hf.controller.resource_pool import ResourcePool
from jaxrl_hf.controller.worker import Worker


# Shared arguments at least this large are put in the object store once instead of being
# serialised into every rank's call (below it, one object-store put costs more than inlining the payload).
SHARED_PAYLOAD_PUT_BYTES = 1 << 20


def _array_bytes(value: Any) -> int:
    """Bytes of a Batch's or numpy array's numeric data (0 for anything else)."""
    if isinstance(value, Batch):
        return value.nbytes
    return value.nbytes if isinstance(value, np.ndarray) else 0


def _flatten(call: RankCall) -> tuple[tuple[str, ...], list[Any]]:
    """(keyword names, positional values then keyword values) for `ProcessHost.call`."""
    return tuple(call.kwargs), [*call.args, *call.kwargs.values()]


def _share_large_arguments(flat: list[tuple[tuple[str, ...], list[Any]]]) -> list[tuple[tuple[str, ...], list[Any]]]:
    """Replace every large argument object that several ranks receive by one ``ray.put`` ref."""
    uses: dict[int, int] = {}  # in how many ranks' calls each argument object appears
    for _, values in flat:
        for key in {id(v) for v in values}:
            uses[key] = uses.get(key, 0) + 1
    shared: dict[int, ray.ObjectRef] = {}
    for _, values in flat:
        for i, value in enumerate(values):
            if uses[id(value)] > 1 and _array_bytes(value) >= SHARED_PAYLOAD_PUT_BYTES:
                if id(value) not in shared:
                    shared[id(value)] = ray.put(value)
                values[i] = shared[id(value)]
    return flat


class GroupMethod:
    """A registered worker method seen from the driver: call it, or `submit` for a future."""

    def __init__(self, group: WorkerGroup, name: str, registration: Registration):
        self._group, self.name, self.registration = group, name, registration
        self.__doc__ = getattr(getattr(group.worker_cls, name), "__doc__", None)

    @property
    def protocol(self) -> Protocol:
        """The method's transfer protocol."""
        return self.registration.protocol

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Blocking methods return the collected result, non-blocking ones a `GroupFuture`."""
        future = self.submit(*args, **kwargs)
        return future.get() if self.registration.blocking else future

    def submit(self, *args: Any, **kwargs: Any) -> GroupFuture:
        """Dispatch to all ranks and return at once with a `GroupFuture`."""
        return self._group._submit(self.name, self.protocol, args, kwargs)

    def __repr__(self) -> str:
        return f"<group method {self._group.role}.{self.name} ({self.protocol.name})>"


class WorkerGroup:
    """One role (``worker_cls``) instantiated in every process of ``pool``; see the module docstring.

    ``role`` names the role (default: the class name, suffixed if the pool already hosts it);
    ``init_kwargs`` are keyword arguments for ``worker_cls.__init__``.
    """

    def __init__(
        self,
        pool: ResourcePool,
        worker_cls: type[Worker],
        *init_args: Any,
        role: str | None = None,
        init_kwargs: dict[str, Any] | None = None,
    ):
        if not isinstance(pool, ResourcePool):
            raise TypeError(f"WorkerGroup needs a ResourcePool, got {type(pool).__name__}")
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, Worker)):
            raise TypeError(f"worker_cls must be a subclass of jaxrl_hf.controller.Worker, got {worker_cls!r}")
        self.pool, self.worker_cls = pool, worker_cls
        self._methods = registered_methods(worker_cls)
        clashes = sorted(set(self._methods) & set(dir(WorkerGroup)))
        if clashes:
            raise ValueError(f"{worker_cls.__name__}: registered methods {clashes} clash with WorkerGroup attributes")
        pool.start()
        self.role = pool.claim_role(role or worker_cls.__name__, explicit=role is not None)
        try:
            # the class travels as bytes so that a worker that cannot import its module reports why
            spec = ray.put((ray.cloudpickle.dumps(worker_cls), tuple(init_args), dict(init_kwargs or {})))
            with pool.submit_lock:
                pool.check_healthy()
                refs = [host.add_role.remote(self.role, spec) for host in pool.hosts]
            coords = gather_results(refs, pool.name, self.role, "__init__", on_death=pool.mark_broken)
            self.layout = GroupLayout(self.role, pool.name, tuple(coords))
        except BaseException:
            self._remove_role_everywhere()
            raise
        for name, registration in self._methods.items():
            setattr(self, name, GroupMethod(self, name, registration))

    @property
    def world_size(self) -> int:
        """Number of processes (ranks) of the group."""
        return self.pool.num_processes

    @property
    def method_names(self) -> list[str]:
        """Names of the registered methods exposed on this group."""
        return sorted(self._methods)

    def __repr__(self) -> str:
        return f"WorkerGroup(role={self.role!r}, cls={self.worker_cls.__name__}, pool={self.pool.name!r}, ranks={self.world_size})"

    def refresh_layout(self) -> GroupLayout:
        """Re-read every rank's `Worker.mesh_coords` (after a worker rebuilt its mesh)."""
        with self.pool.submit_lock:
            self.pool.check_healthy()
            refs = [host.mesh_coords.remote(self.role) for host in self.pool.hosts]
        coords = gather_results(refs, self.pool.name, self.role, "mesh_coords", on_death=self.pool.mark_broken)
        self.layout = GroupLayout(self.role, self.pool.name, tuple(coords))
        return self.layout

    def _submit(self, method: str, protocol: Protocol, args: tuple, kwargs: dict) -> GroupFuture:
        """Dispatch one call to every rank (same order on all ranks) and return its future."""
        self.pool.check_healthy()
        if not protocol.accepts_futures:  # user protocols see values, fetched on the driver
            args = tuple(a.get() if isinstance(a, GroupFuture) else a for a in args)
            kwargs = {k: v.get() if isinstance(v, GroupFuture) else v for k, v in kwargs.items()}
        calls = protocol.dispatch(self.layout, args, kwargs)
        flat = _share_large_arguments([_flatten(call) for call in calls])
        with self.pool.submit_lock:
            self.pool.check_healthy()
            # arguments travel as top-level task arguments: Ray resolves ObjectRefs among them (ALL_TO_ALL
            # futures, shared puts) and prefetches them before the method runs
            rank_refs = []
            for host, call, (kw_names, values) in zip(self.pool.hosts, calls, flat):
                rows_ref, data_ref = host.call.options(num_returns=2).remote(
                    self.role, method, call.pad_rows, kw_names, *values
                )
                rank_refs.append(RankRef(data_ref, rows_ref))
        return GroupFuture(rank_refs, protocol, self.layout, method, on_death=self.pool.mark_broken)

    def _remove_role_everywhere(self) -> None:
        if self.pool.started and self.pool._broken is None:
            with self.pool.submit_lock:
                refs = [host.remove_role.remote(self.role) for host in self.pool.hosts]
            try:
                ray.get(refs, timeout=30)
            except Exception:  # noqa: BLE001 - best effort cleanup
                pass
        self.pool.release_role(self.role)

    def close(self) -> None:
        """Remove this role's worker instances from the pool's processes."""
        self._remove_role_everywhere()


RoleSpec = type[Worker] | tuple  # a Worker class, or (class, init_args) / (class, init_args, init_kwargs)


def colocate(pool: ResourcePool, **roles: RoleSpec) -> SimpleNamespace:
    """Create one `WorkerGroup` per named role on ``pool`` (same processes, same JAX runtime).

    ``colocate(pool, actor=(ActorWorker, (cfg,)), ref=(ReferenceWorker, (cfg,)))`` returns a namespace
    whose attributes are the groups: ``roles.actor.update_actor(...)``, ``roles.ref.compute_ref_log_prob(...)``.
    If one role fails to start, the roles created before it are removed again.
    """
    groups: dict[str, WorkerGroup] = {}
    try:
        for name, spec in roles.items():
            if isinstance(spec, type):
                spec = (spec, ())
            valid = isinstance(spec, tuple) and len(spec) in (2, 3)
            worker_cls, init_args, init_kwargs = (*spec, {})[:3] if valid else (None, None, None)
            if not valid or not isinstance(init_args, (tuple, list)) or not isinstance(init_kwargs, dict):
                raise TypeError(
                    f"colocate role {name!r}: expected a Worker class or (class, init_args[, init_kwargs]), got {spec!r}"
                )
            groups[name] = WorkerGroup(pool, worker_cls, *init_args, role=name, init_kwargs=init_kwargs)
    except BaseException:
        for group in groups.values():
            group.close()
        raise
    return SimpleNamespace(**groups)


__all__ = ["GroupMethod", "WorkerGroup", "colocate"]
