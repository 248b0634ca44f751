"""Bradley-Terry preference loss for reward-model training (Ouyang et al., 2022, eq. 1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def bt_loss(chosen_scores: jax.Array, rejected_scores: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Mean of ``-log sigmoid(r_chosen - r_rejected)`` over preference pairs (optionally masked).

    Computed as ``softplus(r_rejected - r_chosen)``, which is exact and finite for any score gap.
    Pure and jit-able; ``chosen_scores`` and ``rejected_scores`` have the same shape ``[P]``.
    """
    chosen = jnp.asarray(chosen_scores, jnp.float32)
    rejected = jnp.asarray(rejected_scores, jnp.float32)
    if chosen.shape != rejected.shape:
        raise ValueError(f"bt_loss: chosen {chosen.shape} and rejected {rejected.shape} scores differ in shape")
    per_pair = jax.nn.softplus(rejected - chosen)
    if mask is None:
        return jnp.mean(per_pair)
    weight = jnp.asarray(mask, jnp.float32)
    return jnp.sum(per_pair * weight) / jnp.maximum(jnp.sum(weight), 1.0)


def bt_accuracy(chosen_scores: jax.Array, rejected_scores: jax.Array) -> jax.Array:
    """Fraction of pairs the reward model ranks correctly (``r_chosen > r_rejected``)."""
    return jnp.mean((jnp.asarray(chosen_scores) > jnp.asarray(rejected_scores)).astype(jnp.float32))
