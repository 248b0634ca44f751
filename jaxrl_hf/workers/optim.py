"""AdamW with a warm-up + constant/cosine learning-rate schedule and global-norm gradient clipping.

Schedules (verl's ``optim.lr_scheduler``; ``W`` = ``warmup_steps``, ``S`` = ``total_steps``, ``ρ`` =
``min_lr_ratio``; ``s`` = the schedule step, 0 at the first update):

* warm-up (both):   lr(s) = lr · s / W                             for s < W   (linear from 0, as verl)
* ``constant``:     lr(s) = lr                                     for s ≥ W
* ``cosine``:       lr(s) = lr · (ρ + (1 − ρ) · ½ (1 + cos(π · p))),  p = clip((s − W) / max(1, S − W), 0, 1)

These are verl's ``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup`` lambdas
(``verl/utils/torch_functional.py``). verl steps its scheduler once per ``update_actor`` / ``update_critic``
call, so ``s`` counts *training steps*, not optimizer updates (a step takes ppo_epochs × mini-batches of
them): the workers pass the step's index to the train step (`jaxrl_hf.workers.train_step`), which sets the
learning rate held in the optimizer state (`set_learning_rate`) before every update of that step.

Gradient clipping rescales the whole gradient by ``min(1, c / ‖g‖₂)`` (global norm over all leaves).

The settings are a role's ``optim`` section (`jaxrl_hf.config.schema.OptimConfig`) and its ``grad_clip``.
"""

from __future__ import annotations

import math
import typing
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

from jaxrl_hf.config.build import field_types
from jaxrl_hf.config.schema import OptimConfig

LR_SCHEDULERS: tuple[str, ...] = typing.get_args(field_types(OptimConfig)["lr_scheduler"])


def check_optim(cfg: OptimConfig, where: str = "optim") -> None:
    """Raise ``ValueError`` naming ``where`` (e.g. ``actor.optim``) unless ``cfg`` describes a usable schedule."""
    problem = None
    if not cfg.lr > 0:
        problem = f"lr must be > 0, got {cfg.lr}"
    elif cfg.weight_decay < 0:
        problem = f"weight_decay must be >= 0, got {cfg.weight_decay}"
    elif len(cfg.betas) != 2 or not all(0 <= b < 1 for b in cfg.betas):
        problem = f"betas must be two numbers in [0, 1), got {cfg.betas}"
    elif cfg.warmup_steps < 0:
        problem = f"warmup_steps must be >= 0, got {cfg.warmup_steps}"
    elif cfg.lr_scheduler not in LR_SCHEDULERS:
        problem = f"lr_scheduler={cfg.lr_scheduler!r}; valid: {list(LR_SCHEDULERS)}"
    elif not 0 <= cfg.min_lr_ratio <= 1:
        problem = f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}"
    elif cfg.lr_scheduler == "cosine" and (cfg.total_steps or 0) <= cfg.warmup_steps:
        problem = (f"lr_scheduler='cosine' needs {where}.total_steps ({cfg.total_steps}) > {where}.warmup_steps "
                   f"({cfg.warmup_steps})")
    if problem is not None:
        raise ValueError(f"{where}.{problem}")


def learning_rate(cfg: OptimConfig, step: Any) -> Any:
    """The schedule in the module docstring, as a jit-able function of the schedule step ``s``."""
    s = jnp.asarray(step, jnp.float32)
    warm = cfg.lr * jnp.minimum(1.0, s / max(cfg.warmup_steps, 1))
    if cfg.lr_scheduler == "constant":
        after = jnp.float32(cfg.lr)
    else:
        progress = jnp.clip((s - cfg.warmup_steps) / max(1, (cfg.total_steps or 0) - cfg.warmup_steps), 0.0, 1.0)
        after = cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * progress)))
    return jnp.where(s < cfg.warmup_steps, warm, after)


def make_optimizer(cfg: OptimConfig, grad_clip: float | None, where: str = "optim") -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` (the role's ``grad_clip``; ``None``/≤0: no clipping) then AdamW
    (decoupled weight decay on every parameter, as verl). ``cfg`` is checked first (`check_optim`).

    The learning rate is a value in the optimizer state (``optax.inject_hyperparams``), ``cfg.lr`` until
    `set_learning_rate` replaces it: the train step sets the scheduled value before each update."""
    check_optim(cfg, where)
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("b1", "b2", "eps", "eps_root", "weight_decay"))(
        learning_rate=cfg.lr, b1=cfg.betas[0], b2=cfg.betas[1], eps=cfg.eps, weight_decay=cfg.weight_decay)
    if grad_clip is None or grad_clip <= 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)


def _holds_learning_rate(node: Any) -> bool:
    return isinstance(node, optax.InjectStatefulHyperparamsState) and "learning_rate" in node.hyperparams


def set_learning_rate(opt_state: Any, lr: Any) -> Any:
    """``opt_state`` (of a `make_optimizer` optimizer) with its AdamW learning rate replaced by ``lr``; jit-able.
    Raises ``ValueError`` if the state holds no learning rate (an optimizer not built by `make_optimizer`)."""
    found = []

    def replace(node: Any) -> Any:
        if not _holds_learning_rate(node):
            return node
        found.append(node)
        old = node.hyperparams["learning_rate"]
        return node._replace(hyperparams={**node.hyperparams, "learning_rate": jnp.asarray(lr, old.dtype)})

    new_state = jax.tree.map(replace, opt_state, is_leaf=_holds_learning_rate)
    if not found:
        raise ValueError("set_learning_rate: the optimizer state holds no injected learning rate; build the "
                         "optimizer with jaxrl_hf.workers.optim.make_optimizer")
    return new_state


LR_SCHEDULE_STEP = "lr_schedule_step"
"""``meta_info`` key of an ``update_actor`` / ``update_critic`` batch: the lr schedule step of that call's updates."""


def update_schedule_step(meta_info: Mapping[str, Any], global_step: int) -> int:
    """The schedule step of an update call: ``meta_info[LR_SCHEDULE_STEP]`` (the trainer sets it: the role's
    training steps so far), else the worker's training step − 1 (``set_step``; 0 before any)."""
    return int(meta_info.get(LR_SCHEDULE_STEP, max(int(global_step) - 1, 0)))
