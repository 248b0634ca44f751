"""Split placement for asynchronous training: a generation-only replica of the actor on a pool of its own, and the
actor-side method that hands it the weights.

* `RolloutWorker` (``placement.rollout.colocate=false``): loads the same model, places it on a ``('pp','tp','dp')``
  mesh over its own pool's devices (``placement.rollout``: pp 1, the actor's tp, dp the rest) and serves
  ``generate_sequences`` with ``rollout.name``'s engine and ``rollout.loop`` exactly as the actor's colocated
  rollout does (the same code path: it subclasses `ActorRolloutRefWorker`), but holds no optimizer state and
  cannot update. ``set_weights`` replaces its params with the actor's.
* `WeightSourceActorWorker`: `ActorRolloutRefWorker` plus ``get_weights``, the actor's current params as host
  numpy arrays (gathered across the actor's processes; rank 0 returns them, the other ranks ``None``).

The trainer passes ``actor.get_weights.submit()``'s future straight to ``rollout.set_weights``: the rollout
processes fetch the arrays from Ray's object store themselves, the driver never holds them (HybridFlow §2.4's
futures; `jaxrl_hf.controller.futures`). Ray runs one caller's calls on a worker in order, so a generation
submitted before a ``set_weights`` still samples with the older weights: that is the staleness
``trainer.max_staleness`` bounds (`jaxrl_hf.trainer.async_rollout`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf.config.schema import ParallelSizes, RunConfig
from jaxrl_hf.controller import Batch, Dispatch, register
from jaxrl_hf.workers.actor import ActorRolloutRefWorker
from jaxrl_hf.workers.routing_replay import check_router_replay
from jaxrl_hf.workers.protocols import MESH_DP_MERGE
from jaxrl_hf.workers.common import WorkerConfigError, lm_param_shardings, load_model, worker_run_config
from jaxrl_hf.workers.train_step import TrainState


def rollout_pool_config(config: RunConfig) -> RunConfig:
    """``config`` with ``placement`` describing the rollout pool: its processes and devices, pp 1, the actor's tp
    (when it divides the pool's devices, else 1), dp the rest, no generation layout; no Ulysses split."""
    p, pool = config.placement, config.placement.rollout
    devices = pool.num_processes * pool.devices_per_process
    tp = p.train.tp if devices % p.train.tp == 0 else 1
    placement = dataclasses.replace(
        p, num_processes=pool.num_processes, devices_per_process=pool.devices_per_process,
        train=ParallelSizes(pp=1, tp=tp, dp=devices // tp), generate=dataclasses.replace(p.generate, pp=None, tp=None))
    actor = dataclasses.replace(config.actor, ulysses_sequence_parallel_size=1, offload_optimizer=False)
    return dataclasses.replace(config, placement=placement, actor=actor)


def host_params(params: Any) -> Any:
    """The params tree as host numpy arrays, whole on every process (sharded leaves gathered)."""
    if jax.process_count() == 1:
        return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params)
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), params)


class WeightSourceActorWorker(ActorRolloutRefWorker):
    """The actor of a run with a separate rollout group: `ActorRolloutRefWorker` + ``get_weights``."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def get_weights(self) -> Any:
        """The current params as host numpy arrays on rank 0 (``None`` on the other ranks)."""
        self._require_model("get_weights")
        with self._optimizer_on_device():
            tree = host_params(self.state.params)
        return tree if jax.process_index() == 0 else None


class RolloutWorker(ActorRolloutRefWorker):
    """Generation only, on the rollout pool's own mesh (see the module docstring)."""

    def __init__(self, config: RunConfig | Mapping[str, Any]):
        super().__init__(rollout_pool_config(worker_run_config(config)), role="actor_rollout")
        self.weights_version = 0
        self._idle_since: float | None = None  # wall clock when the last call ended (idle until the next one)
        self._idle_s = 0.0

    def _call_started(self) -> None:
        if self._idle_since is not None:
            self._idle_s += time.time() - self._idle_since
        self._idle_since = None

    def _call_ended(self) -> None:
        self._idle_since = time.time()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load the initial policy (the actor's own starting point), place it, build the engine."""
        self.model = load_model(self.config.model)
        self.shardings = lm_param_shardings(self.model.config, self.model.params, self.mesh, None, self.rule_set)
        params = jax.device_put(self.model.params, self.shardings)
        self.model.params = None
        self.state = TrainState(params=params, opt_state=None, step=jnp.zeros((), jnp.int32))
        self.replay_routing = check_router_replay(self.config.actor.router_replay.mode, self.model.config,
                                                  self.engine_name, self.config.rollout.loop, self.dp_processes)
        self.engine = self._build_engine()  # with R3 it records the routing the actor replays
        self.rollout_loop.setup(self.config.rollout, self.model.tokenizer)
        return {"role": "rollout", "num_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
                "devices": jax.device_count(), "mesh": dict(self.mesh.shape)}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def set_weights(self, weights: Sequence[Any] | Any, version: int) -> dict[str, float]:
        """Replace the params with ``weights`` (the actor's ``get_weights`` per rank: the one that is not
        ``None``) after ``version`` actor updates. Returns ``perf/weight_sync_bytes`` and the seconds taken
        (fetch from the object store excluded: it happens before the call starts)."""
        self._require_model("set_weights")
        if isinstance(weights, (list, tuple)):
            weights = next((w for w in weights if w is not None), None)
        if weights is None:
            raise WorkerConfigError("RolloutWorker.set_weights: no rank of the actor returned weights")
        if jax.tree.structure(weights) != jax.tree.structure(self.state.params):
            raise WorkerConfigError("RolloutWorker.set_weights: the actor's params tree differs from the rollout "
                                    "model's (placement.rollout must serve the same model.path)")
        self._call_started()
        start = time.perf_counter()
        params = jax.device_put(weights, self.shardings)
        self.state = self.state._replace(params=params)
        self.engine.set_params(params)
        jax.block_until_ready(params)
        self.weights_version = int(version)
        self._call_ended()
        nbytes = float(sum(np.asarray(w).nbytes for w in jax.tree.leaves(weights)))
        return {"perf/weight_sync_bytes": nbytes, "timing_s/weight_sync_rollout": time.perf_counter() - start}

    @register(dispatch=MESH_DP_MERGE)
    def generate_sequences(self, batch: Batch) -> Batch:
        """`ActorRolloutRefWorker.generate_sequences` with the weights version and the seconds this worker sat
        idle since its previous call (``meta_info``: ``weights_version``, ``rollout_idle_s``)."""
        self._call_started()
        try:
            out = ActorRolloutRefWorker.generate_sequences(self, batch)
        finally:
            self._call_ended()
        out.meta_info.update(weights_version=self.weights_version, rollout_idle_s=self._idle_s)
        self._idle_s = 0.0
        return out

    def update_actor(self, batch: Batch) -> Batch:  # not registered: a rollout group never trains
        raise RuntimeError("RolloutWorker cannot update_actor: it only generates (placement.rollout)")
