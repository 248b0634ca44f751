"""Resource pools and worker groups from ``placement`` (HybridFlow §2.4: placement is configuration).

* the actor pool hosts ``ActorRolloutRefWorker`` (actor + hybrid-engine rollout + reference, colocated);
* the critic (and Safe-RLHF's cost critic) share the actor pool when ``placement.critic.colocate`` (time-
  shared processes) or get their own pool (concurrent stages);
* the reward/cost models likewise with ``placement.reward``;
* with ``placement.rollout.colocate=false`` a `RolloutWorker` group on a pool of its own generates (split
  placement, `jaxrl_hf.trainer.async_rollout`); the actor then also serves ``get_weights``.

The actor pool spans ``trainer.nnodes`` Ray nodes when that is set (``placement.num_processes / nnodes``
processes on each; `jaxrl_hf.config.cluster`); a critic or reward pool of its own goes wherever it fits.

Every pool's processes import the config's ``imports`` before any worker is created in them, and get the GPU
memory budget in their environment before JAX starts (`jaxrl_hf.config.memory_budget`; vLLM's share only in
the actor pool, which hosts it), and on CPUs the allocator tunables that keep XLA's freed buffers for reuse
(`jaxrl_hf.config.host_malloc`, ``placement.memory.host_malloc``). ``trainer.device`` picks GPUs (``cuda``), host
devices (``cpu``) or whatever the Ray cluster has (``auto``); a GPU pool whose JAX came up on the CPU is an
error (`check_pool_backend`).
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

from jaxrl_hf.config.host_malloc import host_malloc_env
from jaxrl_hf.config.memory_budget import worker_env
from jaxrl_hf.config.schema import PoolConfig, RunConfig
from jaxrl_hf.trainer.preflight import check_pool_backend
from jaxrl_hf.trainer.step import Roles

if TYPE_CHECKING:  # imported where used: they import Ray, which `jaxrl_hf.trainer.metrics`' users need not have
    from jaxrl_hf.controller import ResourcePool, WorkerGroup


def actor_role_name(config: RunConfig) -> str:
    """``actor_rollout_ref`` when a KL term needs reference log-probs, else ``actor_rollout``."""
    needs_ref = config.algorithm.use_kl_in_reward or config.actor.use_kl_loss
    return "actor_rollout_ref" if needs_ref else "actor_rollout"


def make_pool(config: RunConfig, name: str, pool_cfg: PoolConfig | None = None) -> ResourcePool:
    """The (not yet started) pool ``name``: the actor pool from ``placement`` and ``trainer.nnodes``, a
    separate critic/reward pool from its ``pool_cfg``."""
    from jaxrl_hf.controller import ResourcePool

    p = config.placement
    procs = pool_cfg.num_processes if pool_cfg else p.num_processes
    devices = pool_cfg.devices_per_process if pool_cfg else p.devices_per_process
    every, cpu_only = host_malloc_env(p.memory.host_malloc, os.environ)
    return ResourcePool(name, procs, devices, cpus_per_process=p.cpus_per_process,
                        nnodes=None if pool_cfg else config.trainer.nnodes,
                        ready_timeout_s=config.trainer.ray_init_timeout_s, imports=config.imports,
                        use_gpu={"auto": None, "cpu": False, "cuda": True}[config.trainer.device],
                        env_vars={**worker_env(config, vllm_colocated=pool_cfg is None or name == "rollout"),
                                  **every},
                        cpu_env_vars=cpu_only)


class RoleBuilder(contextlib.AbstractContextManager):
    """Creates the pools and groups of a run; ``close()`` shuts down every pool it started."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.pools: list[ResourcePool] = []

    def _pool(self, name: str, pool_cfg: PoolConfig | None = None) -> ResourcePool:
        pool = make_pool(self.config, name, pool_cfg)
        self.pools.append(pool)
        pool.start()
        check_pool_backend(pool)  # a GPU pool whose JAX came up on the CPU stops here
        return pool

    def build(self) -> Roles:
        """Start the pools, create the groups and call ``init_model`` on each."""
        from jaxrl_hf.controller import WorkerGroup
        from jaxrl_hf.workers import ActorRolloutRefWorker, CostModelWorker, CriticWorker, RewardModelWorker
        from jaxrl_hf.workers.rollout_worker import RolloutWorker, WeightSourceActorWorker

        c = self.config
        worker_config = c  # the typed RunConfig itself (Ray pickles it); every worker reads its sections
        actor_pool = self._pool("actor")
        split_rollout = not c.placement.rollout.colocate
        actor_cls = WeightSourceActorWorker if split_rollout else ActorRolloutRefWorker
        actor = WorkerGroup(actor_pool, actor_cls, worker_config, actor_role_name(c), role="actor")
        groups = {"actor": actor}
        if split_rollout:  # a rollout group of its own (asynchronous training: trainer.max_staleness)
            groups["rollout"] = WorkerGroup(self._pool("rollout", c.placement.rollout), RolloutWorker, worker_config,
                                            role="rollout")
        critic_pool = actor_pool if c.placement.critic.colocate else None
        if c.critic.enable:
            critic_pool = critic_pool or self._pool("critic", c.placement.critic)
            groups["critic"] = WorkerGroup(critic_pool, CriticWorker, worker_config, role="critic")
            if c.algo == "safe_rlhf":
                groups["cost_critic"] = WorkerGroup(critic_pool, CriticWorker, worker_config, role="cost_critic")
        reward_pool = actor_pool if c.placement.reward.colocate else None
        if c.reward_model.enable:
            reward_pool = reward_pool or self._pool("reward", c.placement.reward)
            groups["reward_model"] = WorkerGroup(reward_pool, RewardModelWorker, worker_config, "reward", role="reward_model")
        if c.cost_model.enable:
            reward_pool = reward_pool or self._pool("reward", c.placement.reward)
            groups["cost_model"] = WorkerGroup(reward_pool, CostModelWorker, worker_config, "cost", role="cost_model")
        summaries = {name: group.init_model() for name, group in groups.items()}
        first = lambda summary: dict((summary[0] if isinstance(summary, list) else summary) or {})  # noqa: E731
        return Roles(**groups, actor_info=first(summaries["actor"]), critic_info=first(summaries.get("critic")))

    def close(self) -> None:
        for pool in reversed(self.pools):
            with contextlib.suppress(Exception):
                pool.shutdown()
        self.pools.clear()

    def __exit__(self, *exc: Any) -> None:
        self.close()
