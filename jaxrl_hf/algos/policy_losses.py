"""Policy-gradient losses: ``fn(old_log_prob, log_prob, advantages, response_mask, *, loss_agg_mode,
clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c, rollout_is_weights, ...) -> (loss, metrics)``.

Names follow verl's ``actor.policy_loss.loss_mode``. ``metrics`` always holds ``pg_clipfrac``,
``pg_clipfrac_lower`` and ``ppo_kl`` (scalars), so a trainer logs every loss the same way.
``rollout_is_weights`` (from :mod:`jaxrl_hf.algos.rollout_correction`) multiply the per-token losses
before aggregation. ``global_denominator`` / ``loss_scale_factor`` are passed to :func:`agg_loss` (exact
gradient accumulation, see :mod:`jaxrl_hf.algos.aggregation`). A loss that needs more of the batch declares it,
``@register_policy_loss("name", needs=("ref_log_prob",))``: the actor then requires those columns in
``update_actor`` and passes them to the loss by name (per micro-batch).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxrl_hf.algos.aggregation import agg_loss
from jaxrl_hf.algos.declarations import register_declared, required_keywords
from jaxrl_hf.algos.masked import masked_mean
from jaxrl_hf.registry import Registry

Array = jax.Array
PolicyLossFn = Callable[..., tuple[Array, dict[str, Array]]]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", metadata={"needs": ()})

#: Log-ratio clamp (±20) applied before exp() for numerical safety, as in verl.
LOG_RATIO_CLAMP = 20.0


def register_policy_loss(name: str, *, override: bool = False, **metadata: Any):
    """Decorator: make ``fn`` available as ``actor.policy_loss.loss_mode=name``; ``needs=(column, ...)`` names
    extra batch columns the loss takes as keywords (module docstring)."""
    return register_declared(POLICY_LOSSES, name, override, metadata)


def get_policy_loss(name: str) -> PolicyLossFn:
    """Looks a policy loss up by name; an unknown name raises and lists the valid ones."""
    return POLICY_LOSSES.get(name)


#: What the actor passes every policy loss (positionally, then by keyword).
CALL_ARGUMENTS = ("old_log_prob", "log_prob", "advantages", "response_mask", "loss_agg_mode", "clip_ratio",
                  "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "rollout_is_weights", "global_denominator")


def policy_loss_needs(name: str) -> tuple[str, ...]:
    """The extra batch columns policy loss ``name`` takes: declared with ``needs=``, and the parameters its
    signature names without a default beyond `CALL_ARGUMENTS` (a loss written for verl needs no declaration)."""
    declared = POLICY_LOSSES.info(name)["needs"]
    return declared + tuple(n for n in required_keywords(get_policy_loss(name), CALL_ARGUMENTS) if n not in declared)


def _clip_range(clip_ratio: float, clip_ratio_low: float | None, clip_ratio_high: float | None) -> tuple[float, float]:
    low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    return low, high


def _weighted(pg_losses: Array, rollout_is_weights: Array | None) -> Array:
    if rollout_is_weights is None:
        return pg_losses
    return pg_losses * jax.lax.stop_gradient(rollout_is_weights).astype(pg_losses.dtype)


@register_policy_loss("vanilla")
def compute_policy_loss_vanilla(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    rollout_is_weights: Array | None = None,
    loss_scale_factor: float | None = None,
    global_denominator: Array | None = None,
    **_: object,
) -> tuple[Array, dict[str, Array]]:
    """PPO clipped surrogate (PPO eq.1 / HybridFlow eq.1) with decoupled clip-higher (DAPO eq.10) and dual-clip.

    r = exp(clamp(log π − log π_old, ±20));  ℓ = max(−A r, −A clip(r, 1−ε_low, 1+ε_high));
    for A < 0 additionally ℓ ← min(ℓ, −A c) (dual-clip, Ye et al. 2020, c = ``clip_ratio_c`` > 1).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip lower bound) must be > 1.0, got {clip_ratio_c}")
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    neg_kl = jnp.clip(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(neg_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * jnp.clip(ratio, 1.0 - low, 1.0 + high)
    clipped1 = jnp.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clipped2 = jnp.minimum(pg_losses3, clipped1)
    pg_losses = jnp.where(advantages < 0, clipped2, clipped1)
    pg_losses = _weighted(pg_losses, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor,
                    global_denominator=global_denominator)
    sg = jax.lax.stop_gradient
    metrics = {
        "pg_clipfrac": masked_mean(sg((pg_losses2 > pg_losses1).astype(log_prob.dtype)), response_mask),
        "pg_clipfrac_lower": masked_mean(
            sg(((clipped1 > pg_losses3) & (advantages < 0)).astype(log_prob.dtype)), response_mask
        ),
        "ppo_kl": masked_mean(sg(-neg_kl), response_mask),
    }
    return loss, metrics


@register_policy_loss("gspo")
def compute_policy_loss_gspo(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    *,
    loss_agg_mode: str = "seq-mean-token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    rollout_is_weights: Array | None = None,
    loss_scale_factor: float | None = None,
    global_denominator: Array | None = None,
    **_: object,
) -> tuple[Array, dict[str, Array]]:
    """GSPO-token (Zheng et al. 2025, arXiv 2507.18071, eq.(GSPO-token)).

    s_i = exp((1/|y_i|) Σ_t (log π − log π_old)) is the length-normalised sequence ratio; each token uses
    s_it = sg[s_i] · π_t / sg[π_t] (value s_i, gradient of the token's own log-prob), clamped at log 10,
    clipped to [1−ε_low, 1+ε_high] PPO-style. The paper aggregates per sequence, hence the default
    ``loss_agg_mode="seq-mean-token-mean"`` (other modes are honoured, as in verl).
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    sg = jax.lax.stop_gradient
    mask = response_mask.astype(log_prob.dtype)
    neg_kl = log_prob - old_log_prob
    seq_len = jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    seq_log_ratio = jnp.sum(neg_kl * mask, axis=-1) / seq_len
    log_ratio = log_prob - sg(log_prob) + sg(seq_log_ratio)[:, None]
    ratio = jnp.exp(jnp.minimum(log_ratio, 10.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * jnp.clip(ratio, 1.0 - low, 1.0 + high)
    pg_losses = _weighted(jnp.maximum(pg_losses1, pg_losses2), rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor,
                    global_denominator=global_denominator)
    metrics = {
        "pg_clipfrac": masked_mean(sg((pg_losses2 > pg_losses1).astype(log_prob.dtype)), response_mask),
        "pg_clipfrac_lower": jnp.zeros((), log_prob.dtype),
        "ppo_kl": masked_mean(sg(-neg_kl), response_mask),
    }
    return loss, metrics


@register_policy_loss("cispo")
def compute_policy_loss_cispo(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    *,
    loss_agg_mode: str = "token-mean",
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    rollout_is_weights: Array | None = None,
    loss_scale_factor: float | None = None,
    global_denominator: Array | None = None,
    **_: object,
) -> tuple[Array, dict[str, Array]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585, eq.4–5): ℓ = −sg[clip(r, 1−ε_low, 1+ε_high)] · A · log π.

    The importance weight is clipped and detached, so no token's gradient is ever zeroed (unlike PPO's
    clip); the gradient is −clip(r)·A·∇log π.
    """
    low, high = _clip_range(clip_ratio, clip_ratio_low, clip_ratio_high)
    sg = jax.lax.stop_gradient
    neg_kl = jnp.clip(log_prob - old_log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = jnp.exp(neg_kl)
    clipped = sg(jnp.clip(ratio, 1.0 - low, 1.0 + high))
    pg_losses = _weighted(-clipped * advantages * log_prob, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor,
                    global_denominator=global_denominator)
    metrics = {
        "pg_clipfrac": masked_mean(sg((ratio != clipped).astype(log_prob.dtype)), response_mask),
        "pg_clipfrac_lower": jnp.zeros((), log_prob.dtype),
        "ppo_kl": masked_mean(sg(-neg_kl), response_mask),
    }
    return loss, metrics


@register_policy_loss("gpg")
def compute_policy_loss_gpg(
    old_log_prob: Array,
    log_prob: Array,
    advantages: Array,
    response_mask: Array,
    *,
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: Array | None = None,
    loss_scale_factor: float | None = None,
    global_denominator: Array | None = None,
    **_: object,
) -> tuple[Array, dict[str, Array]]:
    """GPG (arXiv 2504.02546, eq.6): plain policy gradient ℓ = −A · log π, no ratio and no clipping."""
    pg_losses = _weighted(-log_prob * advantages, rollout_is_weights)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor,
                    global_denominator=global_denominator)
    zero = jnp.zeros((), log_prob.dtype)
    sg = jax.lax.stop_gradient
    metrics = {
        "pg_clipfrac": zero,
        "pg_clipfrac_lower": zero,
        "ppo_kl": masked_mean(sg(old_log_prob - log_prob), response_mask),
    }
    return loss, metrics
