"""`ResourcePool`: a named set of processes and their devices, backed by a Ray placement group.

On a GPU cluster each process owns one GPU; on a CPU-only machine each process owns
``devices_per_process`` host devices (XLA's forced host device count, for tests and development).
The processes start on first use and form one multi-controller JAX program, also when they sit on
several Ray nodes (``nnodes``: ``num_processes / nnodes`` processes on each of that many nodes; JAX's
coordination service runs on rank 0's node; see `jaxrl_hf.controller.node_placement`). Every `WorkerGroup`
created on the same pool object runs in these same processes (colocation, HybridFlow §2.4);
different pools get different processes (and, on GPUs, different devices).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from jaxrl_hf.controller.errors import ControllerError, PoolBrokenError, WorkerDiedError
from jaxrl_hf.controller.node_placement import (NOSET_VISIBLE_DEVICES, BundlePlan, bundle_plan, describe_nodes,
                                               forwarded_env)
from jaxrl_hf.controller.process import ProcessHost

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def ensure_ray() -> None:
    """Connect to Ray if not connected: ``RAY_ADDRESS`` (an existing cluster) or a new local one. Never another run's
    cluster found on the same host (Ray's default without an address): that run's end would kill this one's actors."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        ray.init(address="local", include_dashboard=False)


class ResourcePool:
    """A named set of ``num_processes`` processes, each owning ``devices_per_process`` devices.

    Args:
      name: pool name (used in errors and actor names).
      num_processes: processes in the pool = JAX processes of its program.
      devices_per_process: CPU: forced host devices per process (default 1). GPU: must be 1/None.
      cpus_per_process: logical Ray CPUs each process reserves; fractional so that many processes fit
        a small machine (a CPU-heavy JAX process still uses whatever cores the OS gives it).
      use_gpu: one GPU per process; default: whether the Ray cluster has GPUs.
      nnodes: spread the processes evenly over exactly this many Ray nodes (one placement-group bundle per
        node, ``STRICT_SPREAD``; ranks fill the nodes in order); ``num_processes`` must be a multiple of it.
        None: one bundle per process, placed with ``strategy``.
      strategy: placement group strategy; default ``PACK`` (as few nodes as have room), ``STRICT_SPREAD``
        with ``nnodes`` (the only strategy that pins a pool to nodes).
      ready_timeout_s: how long to wait for resources and for the JAX program to form.
      imports: ``.py`` files / module names every process imports after joining the JAX program and before
        any worker is created (user code registering estimators, losses ...; `jaxrl_hf.user_modules`).
      env_vars: environment variables every process gets before JAX starts, over the forwarded ones (e.g. the
        GPU memory budget, `jaxrl_hf.config.memory_budget`).
      cpu_env_vars: more variables, for a pool whose processes run JAX on CPUs only (decided at start, after
        ``use_gpu``; e.g. the host allocator's tunables, `jaxrl_hf.config.host_malloc`).
    """

    def __init__(
        self,
        name: str,
        num_processes: int = 1,
        devices_per_process: int | None = None,
        *,
        cpus_per_process: float = 0.25,
        use_gpu: bool | None = None,
        nnodes: int | None = None,
        strategy: str | None = None,
        ready_timeout_s: float = 120.0,
        imports: Sequence[str] = (),
        env_vars: Mapping[str, str] | None = None,
        cpu_env_vars: Mapping[str, str] | None = None,
    ):
        if not isinstance(name, str) or not name:
            raise ValueError(f"ResourcePool name must be a non-empty string, got {name!r}")
        if not isinstance(num_processes, int) or num_processes < 1:
            raise ValueError(f"ResourcePool {name!r}: num_processes must be a positive int, got {num_processes!r}")
        if devices_per_process is not None and (not isinstance(devices_per_process, int) or devices_per_process < 1):
            raise ValueError(
                f"ResourcePool {name!r}: devices_per_process must be a positive int, got {devices_per_process!r}"
            )
        if cpus_per_process < 0:
            raise ValueError(f"ResourcePool {name!r}: cpus_per_process must be >= 0, got {cpus_per_process}")
        strategy = strategy or ("PACK" if nnodes is None else "STRICT_SPREAD")
        if strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"ResourcePool {name!r}: strategy {strategy!r} not in {PLACEMENT_STRATEGIES}")
        try:  # the layout's checks (nnodes divides num_processes, strategy), before anything starts
            bundle_plan(num_processes, cpus_per_process, 0, nnodes=nnodes, strategy=strategy)
        except ValueError as err:
            raise ValueError(f"ResourcePool {name!r}: {err}") from None
        self.name = name
        self.num_processes = num_processes
        self.requested_devices_per_process = devices_per_process
        self.cpus_per_process = float(cpus_per_process)
        self.use_gpu = use_gpu
        self.nnodes = nnodes
        self.strategy = strategy
        self.ready_timeout_s = ready_timeout_s
        self.imports = tuple(imports)
        self.env_vars = dict(env_vars or {})
        self.cpu_env_vars = dict(cpu_env_vars or {})
        self.submit_lock = threading.RLock()  # one submission order for all ranks (SPMD lockstep)
        self._hosts: list[Any] | None = None
        self._placement_group = None
        self._process_info: list[dict[str, Any]] = []
        self._roles: set[str] = set()
        self._broken: str | None = None
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------------ properties
    @property
    def platform(self) -> str:
        """``"gpu"`` or ``"cpu"`` (decided when the pool starts)."""
        return "gpu" if self.use_gpu else "cpu"

    @property
    def devices_per_process(self) -> int:
        """Devices each process owns."""
        return self.requested_devices_per_process or 1

    @property
    def started(self) -> bool:
        """Whether the processes are running."""
        return self._hosts is not None

    @property
    def hosts(self) -> list[Any]:
        """Ray actor handles of the processes, rank order (starts the pool if needed)."""
        self.start()
        assert self._hosts is not None
        return self._hosts

    @property
    def process_info(self) -> list[dict[str, Any]]:
        """Per rank: pid, node_id, node_ip, process_index, process_count, device_count, local_device_count, backend."""
        self.start()
        return list(self._process_info)

    def __repr__(self) -> str:
        state = "broken" if self._broken else ("started" if self.started else "not started")
        return (
            f"ResourcePool({self.name!r}, num_processes={self.num_processes}, "
            f"devices_per_process={self.devices_per_process}, nnodes={self.nnodes}, {state})"
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Reserve resources, start the processes and form the JAX program (idempotent)."""
        with self._start_lock:
            if self._hosts is not None:
                return
            self.check_healthy()
            ensure_ray()
            self._decide_platform()
            plan = bundle_plan(self.num_processes, self.cpus_per_process, 1 if self.use_gpu else 0,
                               nnodes=self.nnodes, strategy=self.strategy)
            group = placement_group(
                [dict(b) for b in plan.bundles], strategy=plan.strategy,
                name=f"jaxrl_hf.{self.name}.{uuid.uuid4().hex[:8]}",
            )
            try:
                ray.get(group.ready(), timeout=self.ready_timeout_s)
            except ray.exceptions.GetTimeoutError:
                remove_placement_group(group)
                raise ControllerError(
                    f"ResourcePool {self.name!r}: {plan.describe()} could not be reserved "
                    f"within {self.ready_timeout_s} s; available: {ray.available_resources()}; "
                    f"alive nodes (total resources): {describe_nodes(ray.nodes())}"
                ) from None
            self._placement_group = group
            env = {**forwarded_env(), **self.env_vars,
                   **(NOSET_VISIBLE_DEVICES if self.use_gpu else self.cpu_env_vars)}
            hosts = [self._spawn(group, rank, plan, env) for rank in range(self.num_processes)]
            try:
                self._process_info = self._join(hosts)
                self._check_nodes(plan)
                self._import_user_modules(hosts)
            except BaseException:
                self._kill(hosts)
                remove_placement_group(group)
                self._placement_group = None
                raise
            self._hosts = hosts

    def _decide_platform(self) -> None:
        if self.use_gpu is None:
            self.use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        if self.use_gpu and self.devices_per_process != 1:
            raise ValueError(
                f"ResourcePool {self.name!r}: on GPUs each process owns one GPU; got "
                f"devices_per_process={self.requested_devices_per_process} (use num_processes instead)"
            )

    def _spawn(self, group: Any, rank: int, plan: BundlePlan, env: dict[str, str]) -> Any:
        actor_cls = ray.remote(ProcessHost)
        return actor_cls.options(
            num_cpus=plan.process_resources.get("CPU", 0),
            num_gpus=plan.process_resources.get("GPU", 0),
            max_concurrency=1,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=plan.bundle_of_rank[rank]),
            runtime_env={"env_vars": env},  # a node started by `ray start` has its own environment
        ).remote(self.name, rank, self.num_processes, self.platform, self.devices_per_process)

    def _join(self, hosts: list[Any]) -> list[dict[str, Any]]:
        from jaxrl_hf.controller.futures import gather_results

        coordinator = None
        if len(hosts) > 1:
            coordinator = gather_results(
                [hosts[0].coordinator_address.remote()], self.name, "<pool>", "coordinator_address",
                self.ready_timeout_s,
            )[0]
        info = gather_results(
            [h.join.remote(coordinator, int(self.ready_timeout_s)) for h in hosts],
            self.name, "<pool>", "jax.distributed.initialize", self.ready_timeout_s,
        )
        expected = self.num_processes * self.devices_per_process
        for rank, item in enumerate(info):
            if item["process_count"] != self.num_processes or item["device_count"] != expected:
                raise ControllerError(
                    f"ResourcePool {self.name!r} rank {rank}: JAX program has {item['process_count']} "
                    f"processes / {item['device_count']} devices, expected {self.num_processes} / {expected}"
                )
        return info

    def _check_nodes(self, plan: BundlePlan) -> None:
        """A pinned pool's ranks sit ``processes_per_bundle`` to a node on ``nnodes`` distinct nodes."""
        if plan.nnodes is None:
            return
        nodes_of_bundle: dict[int, set[str]] = {}
        for rank, info in enumerate(self._process_info):
            nodes_of_bundle.setdefault(plan.bundle_of_rank[rank], set()).add(info["node_id"])
        distinct = {node for nodes in nodes_of_bundle.values() for node in nodes}
        if len(distinct) != plan.nnodes or any(len(nodes) != 1 for nodes in nodes_of_bundle.values()):
            raise ControllerError(
                f"ResourcePool {self.name!r}: asked for nnodes={plan.nnodes} with {plan.processes_per_bundle} "
                f"processes each, but the ranks landed on nodes {[i['node_id'][:8] for i in self._process_info]}"
            )

    def _import_user_modules(self, hosts: list[Any]) -> None:
        if self.imports:
            from jaxrl_hf.controller.futures import gather_results

            gather_results([h.import_user_modules.remote(self.imports) for h in hosts], self.name, "<pool>",
                           "import_user_modules", self.ready_timeout_s)

    @staticmethod
    def _kill(hosts: list[Any]) -> None:
        for host in hosts:
            try:
                ray.kill(host, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass

    def shutdown(self) -> None:
        """Kill the processes and release the placement group; the pool cannot be restarted."""
        with self._start_lock:
            if self._hosts is not None:
                self._kill(self._hosts)
            if self._placement_group is not None:
                try:
                    remove_placement_group(self._placement_group)
                except Exception:  # noqa: BLE001 - Ray already gone
                    pass
            self._hosts, self._placement_group = None, None
            self._broken = self._broken or "shut down"

    def __enter__(self) -> ResourcePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ roles and health
    def claim_role(self, name: str, explicit: bool) -> str:
        """Reserve a role name on this pool; an implicit name gets a numeric suffix when taken."""
        if explicit and name in self._roles:
            raise ValueError(f"ResourcePool {self.name!r} already hosts role {name!r}; roles: {sorted(self._roles)}")
        candidate, n = name, 1
        while candidate in self._roles:
            candidate, n = f"{name}_{n}", n + 1
        self._roles.add(candidate)
        return candidate

    def release_role(self, name: str) -> None:
        """Free a role name."""
        self._roles.discard(name)

    def mark_broken(self, failure: WorkerDiedError) -> None:
        """Record that a process died: the SPMD program cannot continue."""
        if self._broken is None:
            self._broken = str(failure)

    def check_healthy(self) -> None:
        """Raise `PoolBrokenError` if a process of this pool died (or it was shut down)."""
        if self._broken is not None:
            raise PoolBrokenError(f"ResourcePool {self.name!r} is unusable: {self._broken}")
