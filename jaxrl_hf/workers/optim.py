"""AdamW with a warm-up + constant/cosine learning-rate schedule and global-norm gradient clipping.

Schedules (verl's ``optim.lr_scheduler``; ``s`` = optimizer steps taken so far, ``W`` = ``warmup_steps``,
``S`` = ``total_steps``, ``ρ`` = ``min_lr_ratio``):

* warm-up (both):   lr(s) = lr · (s + 1) / W                      for s < W   (linear, never exactly 0)
* ``constant``:     lr(s) = lr                                     for s ≥ W
* ``cosine``:       lr(s) = lr · (ρ + (1 − ρ) · ½ (1 + cos(π · p))),  p = clip((s − W) / max(1, S − W), 0, 1)

Gradient clipping rescales the whole gradient by ``min(1, c / ‖g‖₂)`` (global norm over all leaves).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp
import optax

LR_SCHEDULERS = ("constant", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The ``<role>.optim`` section plus the role's ``grad_clip`` (``None``/≤0 disables clipping)."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_scheduler: str = "constant"
    min_lr_ratio: float = 0.0
    total_steps: int = 0
    grad_clip: float | None = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), got {self.betas}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ValueError(f"optim.lr_scheduler={self.lr_scheduler!r}; valid: {list(LR_SCHEDULERS)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.lr_scheduler == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"optim.lr_scheduler='cosine' needs optim.total_steps ({self.total_steps}) > "
                             f"optim.warmup_steps ({self.warmup_steps})")

    @classmethod
    def from_dict(cls, optim: Mapping[str, Any], grad_clip: float | None = None,
                  where: str = "optim") -> "OptimConfig":
        """Build from a config section; unknown keys raise naming ``where`` and listing the valid keys."""
        valid = {f.name for f in dataclasses.fields(cls)} - {"grad_clip"}
        unknown = sorted(set(optim) - valid)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {sorted(valid)}")
        kwargs = dict(optim)
        if "betas" in kwargs:
            kwargs["betas"] = tuple(float(b) for b in kwargs["betas"])
        for key in ("warmup_steps", "total_steps"):
            if key in kwargs:
                kwargs[key] = int(kwargs[key])
        for key in ("lr", "weight_decay", "eps", "min_lr_ratio"):
            if key in kwargs:
                kwargs[key] = float(kwargs[key])
        try:
            return cls(**kwargs, grad_clip=grad_clip)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


def learning_rate(cfg: OptimConfig, step: Any) -> Any:
    """The schedule in the module docstring, as a jit-able function of the step count."""
    s = jnp.asarray(step, jnp.float32)
    warm = cfg.lr * jnp.minimum(1.0, (s + 1.0) / max(cfg.warmup_steps, 1))
    if cfg.lr_scheduler == "constant":
        after = jnp.float32(cfg.lr)
    else:
        progress = jnp.clip((s - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps), 0.0, 1.0)
        after = cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * progress)))
    return jnp.where(s < cfg.warmup_steps, warm, after)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """``clip_by_global_norm(grad_clip)`` then AdamW (decoupled weight decay on every parameter, as verl)."""
    adamw = optax.adamw(lambda count: learning_rate(cfg, count), b1=cfg.betas[0], b2=cfg.betas[1], eps=cfg.eps,
                        weight_decay=cfg.weight_decay)
    if cfg.grad_clip is None or cfg.grad_clip <= 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
