"""The actor's compiled programs, built from its config alone: the update step and the log-prob forward.

One code path for the worker (`jaxrl_hf.workers.actor.ActorRolloutRefWorker` runs them on placed arrays) and
the ahead-of-time memory plan (`jaxrl_hf.memory_plan` lowers them on abstract arrays). Nothing here touches
concrete params: ``param_shapes`` may be arrays or ``jax.ShapeDtypeStruct`` trees.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import optax

from jaxrl_hf.backends.cpu.fused_adamw import fused_update_for
from jaxrl_hf.config.schema import ActorConfig, OptimConfig
from jaxrl_hf.workers.common import WorkerConfigError
from jaxrl_hf.workers.losses import (ACTOR_SUMMED_METRICS, ActorLossConfig, LogProbFn, actor_loss, actor_loss_config,
                                     actor_denominators)
from jaxrl_hf.workers.optim import make_optimizer
from jaxrl_hf.workers.train_step import TrainState, make_train_step, train_state_shardings

LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


@functools.partial(jax.jit, static_argnames=("log_prob_fn",))
def log_probs_program(params: Any, micro: Mapping[str, jax.Array], temperature: jax.Array, *,
                      log_prob_fn: LogProbFn) -> tuple[jax.Array, jax.Array]:
    """``(log_prob, entropy)`` ``[b, R]`` of one micro-batch of ``LOG_PROB_INPUTS`` (``compute_log_prob``)."""
    return log_prob_fn(params, micro, temperature)


@dataclasses.dataclass(frozen=True)
class ActorUpdate:
    """The pieces of ``update_actor``: the loss view, the optimizer, the train-state layout and the jitted
    ``step(state, micro_batches) -> (state, metrics)`` (`jaxrl_hf.workers.train_step.make_train_step`)."""

    loss_cfg: ActorLossConfig
    optim: OptimConfig
    optimizer: optax.GradientTransformation
    state_shardings: TrainState
    step: Any


def build_actor_update(actor: ActorConfig, temperature: float, log_prob_fn: LogProbFn, param_shapes: Any,
                       param_shardings: Any, mesh: jax.sharding.Mesh, live_fn: Any = None,
                       combine: Any = None, unrolled_layers: int = 0, cpu_backend: str = "auto") -> ActorUpdate:
    """`ActorUpdate` of the ``actor`` section (``temperature``: the rollout's, as the log-probs use it) for params
    shaped ``param_shapes`` laid out as ``param_shardings`` on ``mesh``; ``log_prob_fn``: the padded or packed
    forward of the update pass, ``live_fn``, ``combine``: `make_train_step`'s (token-budget micro-batches; LoRA:
    ``param_shapes``/``param_shardings`` are then the adapters'); ``unrolled_layers``, ``cpu_backend``: `fused_update_for`'s. A bad
    loss key raises `WorkerConfigError` naming it."""
    try:
        loss_cfg = actor_loss_config(actor, temperature)
    except ValueError as err:
        raise WorkerConfigError(f"actor config: {err}") from None
    optimizer = make_optimizer(actor.optim, actor.grad_clip, where="actor.optim")
    state_shardings = train_state_shardings(param_shapes, param_shardings, optimizer, mesh)
    loss_fn = functools.partial(actor_loss, log_prob_fn=log_prob_fn, cfg=loss_cfg)
    step = make_train_step(loss_fn, actor.optim, optimizer=optimizer,
                           denominator_fn=actor_denominators(loss_cfg.loss_agg_mode),
                           summed_aux=ACTOR_SUMMED_METRICS, state_shardings=state_shardings, live_fn=live_fn,
                           combine=combine, fused=fused_update_for(actor.optim, actor.grad_clip, param_shapes, mesh,
                                                                 unrolled_layers, cpu_backend))
    return ActorUpdate(loss_cfg, actor.optim, optimizer, state_shardings, step)
