"""DAPO's data-side pieces (Yu et al. 2025, arXiv 2503.14476): overlong reward shaping, overlong filtering
and dynamic-sampling group filtering. Clip-higher and the token-level loss live in ``policy_losses`` /
``aggregation`` (``clip_ratio_high``, ``loss_agg_mode="token-mean"``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_hf.algos.masked import group_count, group_ids, group_std

Array = jax.Array


def compute_overlong_penalty(
    response_length: Array,
    max_response_length: int,
    overlong_buffer_len: int,
    penalty_factor: float = 1.0,
) -> Array:
    """Soft overlong punishment R_length (DAPO eq.13), lengths in tokens, scaled by ``penalty_factor``:

        0                              if |y| ≤ L_max − L_cache
        ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| ≤ L_max
        −1                             if |y| > L_max

    It is added to the rule reward of each sample.
    """
    if not 0 < overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_buffer.len must be in (0, max_response_length={max_response_length}], got {overlong_buffer_len}"
        )
    length = jnp.asarray(response_length, jnp.float32)
    expected = max_response_length - overlong_buffer_len
    penalty = jnp.clip((expected - length) / overlong_buffer_len, -1.0, 0.0)
    return penalty * penalty_factor


def is_truncated(response_mask: Array, eos_mask: Array | None = None, *, max_response_length: int | None = None) -> Array:
    """Per-sample flag: the response hit the length limit without ending (no EOS/stop token).

    ``eos_mask [B, T]`` marks the positions holding an EOS/stop token; without it a sample is truncated when
    its valid length equals ``max_response_length`` (default: the mask width).
    """
    length = jnp.sum(response_mask.astype(jnp.int32), axis=-1)
    limit = response_mask.shape[-1] if max_response_length is None else max_response_length
    at_limit = length >= limit
    if eos_mask is None:
        return at_limit
    ended = jnp.any((eos_mask != 0) & (response_mask != 0), axis=-1)
    return at_limit & ~ended


def overlong_filter_mask(response_mask: Array, truncated: Array) -> Array:
    """Overlong filtering (DAPO §3.4): the loss mask with truncated samples' tokens removed, so a response cut
    off by the length limit is neither rewarded nor punished for its (unknown) outcome."""
    keep = (~jnp.asarray(truncated, bool)).astype(response_mask.dtype)
    return response_mask * keep[:, None]


def filter_groups(metric: Array, index: Array, *, keep_singletons: bool = True) -> Array:
    """Dynamic sampling (DAPO eq.11 constraint 0 < |{o_i correct}| < G): ``keep [B]`` is True for the samples of
    groups whose ``metric`` (e.g. accuracy or score) is not constant across the group, i.e. whose group std
    is > 0. Groups of one cannot be judged and are kept unless ``keep_singletons=False``."""
    metric = jnp.asarray(metric, jnp.float32)
    gid = group_ids(index)
    varies = group_std(metric, gid) > 0
    if keep_singletons:
        varies = varies | (group_count(gid) == 1)
    return varies
