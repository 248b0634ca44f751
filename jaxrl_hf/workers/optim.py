"""AdamW with a warm-up + constant/cosine learning-rate schedule and global-norm gradient clipping.

Schedules (verl's ``optim.lr_scheduler``; ``s`` = optimizer steps taken so far, ``W`` = ``warmup_steps``,
``S`` = ``total_steps``, ``ρ`` = ``min_lr_ratio``):

* warm-up (both):   lr(s) = lr · (s + 1) / W                      for s < W   (linear, never exactly 0)
* ``constant``:     lr(s) = lr                                     for s ≥ W
* ``cosine``:       lr(s) = lr · (ρ + (1 − ρ) · ½ (1 + cos(π · p))),  p = clip((s − W) / max(1, S − W), 0, 1)

Gradient clipping rescales the whole gradient by ``min(1, c / ‖g‖₂)`` (global norm over all leaves).

The settings are a role's ``optim`` section (`jaxrl_hf.config.schema.OptimConfig`) and its ``grad_clip``.
"""

from __future__ import annotations

import math
import typing
from typing import Any

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
    """The schedule in the module docstring, as a jit-able function of the step count."""
    s = jnp.asarray(step, jnp.float32)
    warm = cfg.lr * jnp.minimum(1.0, (s + 1.0) / max(cfg.warmup_steps, 1))
    if cfg.lr_scheduler == "constant":
        after = jnp.float32(cfg.lr)
    else:
        progress = jnp.clip((s - cfg.warmup_steps) / max(1, (cfg.total_steps or 0) - cfg.warmup_steps), 0.0, 1.0)
        after = cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * progress)))
    return jnp.where(s < cfg.warmup_steps, warm, after)


def make_optimizer(cfg: OptimConfig, grad_clip: float | None, where: str = "optim") -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` (the role's ``grad_clip``; ``None``/≤0: no clipping) then AdamW
    (decoupled weight decay on every parameter, as verl). ``cfg`` is checked first (`check_optim`)."""
    check_optim(cfg, where)
    adamw = optax.adamw(lambda count: learning_rate(cfg, count), b1=cfg.betas[0], b2=cfg.betas[1], eps=cfg.eps,
                        weight_decay=cfg.weight_decay)
    if grad_clip is None or grad_clip <= 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)
