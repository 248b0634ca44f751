"""Critic loss and entropy bonus."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_hf.algos.aggregation import agg_loss
from jaxrl_hf.algos.logits import entropy_from_logits
from jaxrl_hf.algos.masked import masked_mean

Array = jax.Array


def compute_value_loss(
    vpreds: Array,
    returns: Array,
    values: Array,
    response_mask: Array,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    *,
    loss_scale_factor: float | None = None,
    global_denominator: Array | None = None,
) -> tuple[Array, Array]:
    """Clipped value loss (PPO2 value clipping): ½ · agg(max((V − R)², (V_clip − R)²)), with
    V_clip = V_old + clip(V − V_old, −c, c). Returns ``(vf_loss, vf_clipfrac)``."""
    vpred_clipped = jnp.clip(vpreds, values - cliprange_value, values + cliprange_value)
    losses1 = (vpreds - returns) ** 2
    losses2 = (vpred_clipped - returns) ** 2
    loss = 0.5 * agg_loss(jnp.maximum(losses1, losses2), response_mask, loss_agg_mode,
                          loss_scale_factor=loss_scale_factor, global_denominator=global_denominator)
    clipfrac = masked_mean(jax.lax.stop_gradient((losses2 > losses1).astype(vpreds.dtype)), response_mask)
    return loss, clipfrac


def compute_entropy_loss(
    logits: Array, response_mask: Array, loss_agg_mode: str = "token-mean", *, vocab_chunk_size: int | None = None
) -> Array:
    """Aggregated token entropy H = −Σ_v p_v log p_v (the entropy bonus is −coeff · this)."""
    return agg_loss(entropy_from_logits(logits, vocab_chunk_size=vocab_chunk_size), response_mask, loss_agg_mode)
