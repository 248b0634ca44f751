"""Pure router losses and load statistics of a mixture-of-experts policy (`jaxrl_hf.models.moe`).

Inputs are one forward pass's routing, stacked over the decoder layers: ``logits [L, N, E]`` (float32 router
logits of the ``N`` flattened tokens), ``experts [L, N, k]`` (the chosen experts; ``-1`` in a dense layer of a
model mixing dense and sparse layers, which every function leaves out) and ``token_mask [N]`` (1 for a real token,
0 for padding). ``S`` is the set of (sparse layer, real token) pairs.

* `load_balancing_loss` (Switch Transformer, Fedus et al. 2022, eqs. 4–6, pooled over the layers as Qwen's
  ``router_aux_loss_coef`` term is)::

      f_e = (1/|S|) Σ_{(l,n)∈S} Σ_j 1[e_{l,n,j} = e]        (expert e's share of the routed choices, times k)
      P_e = (1/|S|) Σ_{(l,n)∈S} softmax(z_{l,n})_e          (its mean router probability)
      L_aux = E · Σ_e f_e · P_e

  ``L_aux = k`` when routing is uniform; its gradient flows through ``P`` only (the choices are discrete).
* `router_z_loss` (ST-MoE, Zoph et al. 2022, eq. 5): ``L_z = (1/|S|) Σ_{(l,n)∈S} (log Σ_e exp z_{l,n,e})²``.
* `expert_load`: per sparse layer, each expert's share of that layer's routed choices (sums to 1 per layer).
* `router_metrics`: the aux loss, the z-loss, the mean over sparse layers of the largest and smallest expert share,
  and the routed choices that reached no expert (0 for the dropless experts of `jaxrl_hf.models.moe`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _pair_weights(experts: Array, token_mask: Array) -> Array:
    """``[L, N]`` float32: 1 for a (sparse layer, real token) pair, 0 otherwise."""
    sparse = (experts[..., 0] >= 0).astype(jnp.float32)
    return sparse * token_mask.astype(jnp.float32)[None, :]


def _choice_counts(experts: Array, num_experts: int) -> Array:
    """``[L, N, E]``: how many of a token's ``k`` choices went to each expert (``-1`` counts nowhere)."""
    return jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=-2)


def load_balancing_loss(logits: Array, experts: Array, token_mask: Array) -> Array:
    """Switch Transformer's auxiliary load-balancing loss ``E · Σ_e f_e P_e`` (module docstring), a float32 scalar."""
    num_experts = logits.shape[-1]
    w = _pair_weights(experts, token_mask)
    count = jnp.maximum(jnp.sum(w), 1.0)
    f = jnp.einsum("ln,lne->e", w, _choice_counts(experts, num_experts)) / count
    p = jnp.einsum("ln,lne->e", w, jax.nn.softmax(logits.astype(jnp.float32), axis=-1)) / count
    return num_experts * jnp.sum(f * p)


def router_z_loss(logits: Array, experts: Array, token_mask: Array) -> Array:
    """ST-MoE's router z-loss: the mean over ``S`` of ``logsumexp(z)²`` (module docstring)."""
    w = _pair_weights(experts, token_mask)
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return jnp.sum(w * lse ** 2) / jnp.maximum(jnp.sum(w), 1.0)


def expert_load(experts: Array, token_mask: Array, num_experts: int) -> tuple[Array, Array]:
    """``(share [L, E], sparse [L])``: each expert's share of a layer's routed choices over its real tokens, and
    which layers are sparse (a dense layer's row is 0)."""
    w = _pair_weights(experts, token_mask)
    counts = jnp.einsum("ln,lne->le", w, _choice_counts(experts, num_experts))
    total = jnp.sum(counts, axis=-1, keepdims=True)
    return counts / jnp.maximum(total, 1.0), jnp.any(experts[..., 0] >= 0, axis=-1)


def router_metrics(logits: Array, experts: Array, token_mask: Array) -> dict[str, Array]:
    """``moe/aux_loss``, ``moe/z_loss``, ``moe/expert_load_max`` / ``_min`` (mean over sparse layers of the largest /
    smallest share) and ``moe/tokens_dropped`` (routed choices of real tokens that reached no expert)."""
    num_experts, k = logits.shape[-1], experts.shape[-1]
    share, sparse = expert_load(experts, token_mask, num_experts)
    layers = jnp.maximum(jnp.sum(sparse), 1)
    w = _pair_weights(experts, token_mask)
    routed = jnp.sum(w[..., None] * _choice_counts(experts, num_experts))
    return {"moe/aux_loss": load_balancing_loss(logits, experts, token_mask),
            "moe/z_loss": router_z_loss(logits, experts, token_mask),
            "moe/expert_load_max": jnp.sum(jnp.where(sparse, share.max(-1), 0.0)) / layers,
            "moe/expert_load_min": jnp.sum(jnp.where(sparse, share.min(-1), 0.0)) / layers,
            "moe/tokens_dropped": k * jnp.sum(w) - routed}


__all__ = ["expert_load", "load_balancing_loss", "router_metrics", "router_z_loss"]
