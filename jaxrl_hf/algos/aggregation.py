"""Loss aggregation: turning a per-token loss matrix ``[B, T]`` into a scalar.

Modes (verl's ``actor.loss_agg_mode``):

* ``token-mean``               Σ_{i,t} m_it ℓ_it / Σ_{i,t} m_it                  (DAPO eq.10, token-level loss)
* ``seq-mean-token-mean``      (1/B') Σ_i [Σ_t m_it ℓ_it / Σ_t m_it]              (GRPO eq.4, sample-level)
* ``seq-mean-token-sum``       (1/B') Σ_i Σ_t m_it ℓ_it
* ``seq-mean-token-sum-norm``  (1/(B'·L)) Σ_i Σ_t m_it ℓ_it, L = ``loss_scale_factor`` (default T) (Dr.GRPO eq.3)
* ``token-sum``                Σ_{i,t} m_it ℓ_it

B' counts the sequences with at least one valid token (fully masked rows, e.g. overlong-filtered samples,
do not dilute the mean).

Gradient accumulation. A mini-batch split into micro-batches must give the same loss and gradient as the
whole mini-batch. Averaging per-micro-batch means does not (a micro-batch with few tokens would weigh as
much as one with many). Two exact forms are provided:

* :func:`agg_loss_parts` returns ``(numerator, denominator)``; sum both over micro-batches, divide once
  (:func:`combine_loss_parts`).
* :func:`agg_loss_denominator` computes the mini-batch denominator up front; pass it as
  ``global_denominator`` to :func:`agg_loss` for every micro-batch and *sum* the micro-batch losses.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from jaxrl_hf.algos.masked import MASK_EPS, masked_sum

Array = jax.Array

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


class LossParts(NamedTuple):
    """Additive pieces of an aggregated loss: ``loss = numerator / denominator``.

    Both fields add up across micro-batches (for ``token-sum`` the denominator is the constant 1 and is not
    summed; :func:`combine_loss_parts` handles it).
    """

    numerator: Array
    denominator: Array


def _check_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"invalid loss_agg_mode {loss_agg_mode!r}; valid modes: {list(LOSS_AGG_MODES)}")


def agg_loss_parts(
    loss_mat: Array, loss_mask: Array, loss_agg_mode: str, *, loss_scale_factor: float | None = None
) -> LossParts:
    """(numerator, denominator) of the chosen aggregation (see the module docstring for the formulas)."""
    _check_mode(loss_agg_mode)
    mask = jnp.asarray(loss_mask, dtype=loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        return LossParts(masked_sum(loss_mat, mask), jnp.sum(mask))
    if loss_agg_mode == "token-sum":
        return LossParts(masked_sum(loss_mat, mask), jnp.ones((), loss_mat.dtype))
    token_sums = masked_sum(loss_mat, mask, axis=-1)
    tokens_per_seq = jnp.sum(mask, axis=-1)
    valid_seq = (tokens_per_seq > 0).astype(loss_mat.dtype)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = token_sums / (tokens_per_seq + MASK_EPS)
        return LossParts(jnp.sum(seq_losses * valid_seq), jnp.sum(valid_seq))
    if loss_agg_mode == "seq-mean-token-sum":
        return LossParts(jnp.sum(token_sums * valid_seq), jnp.sum(valid_seq))
    scale = loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    return LossParts(jnp.sum(token_sums * valid_seq), jnp.sum(valid_seq) * scale)


def agg_loss_denominator(loss_mask: Array, loss_agg_mode: str, *, loss_scale_factor: float | None = None) -> Array:
    """The denominator of :func:`agg_loss_parts` for a whole mini-batch mask (tokens, sequences or L)."""
    dummy = jnp.zeros(jnp.shape(loss_mask), jnp.float32)
    return agg_loss_parts(dummy, loss_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor).denominator


def combine_loss_parts(parts: Sequence[LossParts], loss_agg_mode: str) -> Array:
    """Exact aggregate over micro-batches: Σ numerators / Σ denominators (1 for ``token-sum``)."""
    _check_mode(loss_agg_mode)
    if not parts:
        raise ValueError("combine_loss_parts needs at least one LossParts")
    numerator = sum(p.numerator for p in parts)
    if loss_agg_mode == "token-sum":
        denominator = parts[0].denominator
    else:
        denominator = sum(p.denominator for p in parts)
    return numerator / jnp.maximum(denominator, MASK_EPS)


def agg_loss(
    loss_mat: Array,
    loss_mask: Array,
    loss_agg_mode: str = "token-mean",
    *,
    loss_scale_factor: float | None = None,
    global_denominator: Array | float | None = None,
) -> Array:
    """Aggregates ``loss_mat [B, T]`` under ``loss_mask`` into a scalar (formulas in the module docstring).

    With ``global_denominator`` (from :func:`agg_loss_denominator` on the whole mini-batch) the result is
    this micro-batch's *share*: summing it over micro-batches gives the exact mini-batch loss and gradient.
    """
    numerator, denominator = agg_loss_parts(loss_mat, loss_mask, loss_agg_mode, loss_scale_factor=loss_scale_factor)
    if global_denominator is not None:
        denominator = jnp.asarray(global_denominator, loss_mat.dtype)
    return numerator / jnp.maximum(denominator, MASK_EPS)
