"""Masked reductions and group bookkeeping used by every estimator and loss.

All functions are pure and ``jax.jit``-able. Masks are float or bool arrays broadcastable to the values;
positions with mask 0 never influence a result.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

#: The small constant verl adds to mask counts and variances; kept identical so results can be compared.
MASK_EPS = 1e-8


def masked_sum(values: Array, mask: Array, axis: int | None = None) -> Array:
    """Σ values·mask, with NaN/inf at masked positions ignored (they are replaced, not multiplied)."""
    mask = jnp.asarray(mask, dtype=values.dtype)
    return jnp.sum(jnp.where(mask != 0, values, 0.0) * mask, axis=axis)


def masked_mean(values: Array, mask: Array, axis: int | None = None) -> Array:
    """Σ values·mask / (Σ mask + 1e-8)."""
    mask = jnp.asarray(mask, dtype=values.dtype)
    return masked_sum(values, mask, axis) / (jnp.sum(mask, axis=axis) + MASK_EPS)


def masked_var(values: Array, mask: Array, unbiased: bool = True) -> Array:
    """Variance over the masked positions; Bessel-corrected (n/(n-1)) when ``unbiased``.

    With a single valid position the unbiased variance is undefined; like ``torch.var`` we return
    NaN-free 0 there instead of raising (the whitening below then only centres).
    """
    mask = jnp.asarray(mask, dtype=values.dtype)
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        n = jnp.sum(mask)
        var = jnp.where(n > 1, var * n / jnp.maximum(n - 1, 1.0), var)
    return var


def masked_whiten(values: Array, mask: Array, shift_mean: bool = True) -> Array:
    """(x − mean) / sqrt(var + 1e-8) with masked mean and unbiased masked variance (advantage whitening)."""
    mask = jnp.asarray(mask, dtype=values.dtype)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * jax.lax.rsqrt(var + MASK_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def group_ids(index: Array) -> Array:
    """Relabels arbitrary integer group ids ``index: [B]`` as dense ids in ``[0, B)`` (jit-able)."""
    index = jnp.asarray(index)
    if index.ndim != 1:
        raise ValueError(f"index must be 1-D [batch], got shape {index.shape}")
    _, inverse = jnp.unique(index, size=index.shape[0], return_inverse=True)
    return inverse.reshape(-1)


def group_count(gid: Array) -> Array:
    """Per-sample size of its group (``gid`` from :func:`group_ids`)."""
    n = gid.shape[0]
    counts = jax.ops.segment_sum(jnp.ones((n,), jnp.float32), gid, num_segments=n)
    return counts[gid]


def group_mean(x: Array, gid: Array, weights: Array | None = None) -> Array:
    """Per-sample (weighted) mean of ``x: [B]`` over its group."""
    n = x.shape[0]
    w = jnp.ones_like(x) if weights is None else weights.astype(x.dtype)
    num = jax.ops.segment_sum(x * w, gid, num_segments=n)
    den = jax.ops.segment_sum(w, gid, num_segments=n)
    return (num / jnp.where(den == 0, 1.0, den))[gid]


def group_std(x: Array, gid: Array) -> Array:
    """Per-sample unbiased (n−1) standard deviation of ``x: [B]`` over its group; 0 for singletons."""
    n = x.shape[0]
    mean = group_mean(x, gid)
    sq = jax.ops.segment_sum((x - mean) ** 2, gid, num_segments=n)[gid]
    cnt = group_count(gid).astype(x.dtype)
    return jnp.sqrt(jnp.where(cnt > 1, sq / jnp.maximum(cnt - 1, 1.0), 0.0))
