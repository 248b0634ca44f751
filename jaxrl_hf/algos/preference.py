"""Offline preference-optimisation losses (DPO, IPO) and supervised fine-tuning's NLL, pure and jit-able.

Notation, per preference pair: ``π_c, π_r`` are the policy's log-probabilities of the chosen / rejected
response given the prompt, ``r_c, r_r`` the frozen reference model's, ``β > 0`` the strength of the implicit
KL constraint, and

    h = (π_c - r_c) - (π_r - r_r)                       (the implicit reward margin, in nats)

* DPO (Rafailov et al., 2023, eq. 7), ``loss_type="sigmoid"`` in TRL:   ``L = -log σ(β h)``
* IPO (Azar et al., 2023, eq. 17), ``loss_type="ipo"`` in TRL:           ``L = (h - 1/(2β))²``
  (as in TRL, IPO is meant to be fed length-normalised log-probabilities: the per-token mean, not the sum).

Metrics use TRL's ``DPOTrainer`` names: ``rewards/chosen = β (π_c - r_c)``, ``rewards/rejected = β (π_r - r_r)``,
``rewards/accuracies = [rewards/chosen > rewards/rejected]``, ``rewards/margins = rewards/chosen -
rewards/rejected``, each averaged over the real pairs (``pair_mask``), plus ``logps/chosen`` / ``logps/rejected``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_hf.algos.masked import masked_mean, masked_sum

Array = jax.Array

PREFERENCE_LOSSES = ("dpo", "ipo")


def implicit_margin(policy_chosen: Array, policy_rejected: Array, ref_chosen: Array, ref_rejected: Array) -> Array:
    """``h = (π_c - r_c) - (π_r - r_r)`` per pair ``[P]`` (float32)."""
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return (f(policy_chosen) - f(ref_chosen)) - (f(policy_rejected) - f(ref_rejected))


def dpo_sigmoid_loss(margin: Array, beta: float) -> Array:
    """DPO per pair: ``-log σ(β h) = softplus(-β h)`` (Rafailov et al., 2023, eq. 7); exact and finite for any h."""
    return jax.nn.softplus(-beta * margin)


def ipo_loss(margin: Array, beta: float) -> Array:
    """IPO per pair: ``(h - 1/(2β))²`` (Azar et al., 2023, eq. 17; β is their τ)."""
    return (margin - 1.0 / (2.0 * beta)) ** 2


def preference_loss(loss_type: str, policy_chosen: Array, policy_rejected: Array, ref_chosen: Array,
                    ref_rejected: Array, beta: float, pair_mask: Array | None = None) -> tuple[Array, dict[str, Array]]:
    """``(loss, metrics)``: the mean over real pairs of `dpo_sigmoid_loss` (``"dpo"``) or `ipo_loss` (``"ipo"``) of
    the margin ``h``, and TRL's reward metrics (module docstring). All inputs ``[P]``; ``pair_mask`` 0 drops a pair
    (batch padding)."""
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss {loss_type!r}; choose one of {list(PREFERENCE_LOSSES)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    margin = implicit_margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    mask = jnp.ones_like(margin) if pair_mask is None else jnp.asarray(pair_mask, jnp.float32)
    per_pair = dpo_sigmoid_loss(margin, beta) if loss_type == "dpo" else ipo_loss(margin, beta)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    mean = lambda x: masked_sum(x, mask) / count  # noqa: E731
    chosen_reward = beta * (jnp.asarray(policy_chosen, jnp.float32) - jnp.asarray(ref_chosen, jnp.float32))
    rejected_reward = beta * (jnp.asarray(policy_rejected, jnp.float32) - jnp.asarray(ref_rejected, jnp.float32))
    loss = mean(per_pair)
    metrics = {
        "train/loss": loss,
        "rewards/chosen": mean(chosen_reward),
        "rewards/rejected": mean(rejected_reward),
        "rewards/accuracies": mean((chosen_reward > rejected_reward).astype(jnp.float32)),
        "rewards/margins": mean(chosen_reward - rejected_reward),
        "logps/chosen": mean(jnp.asarray(policy_chosen, jnp.float32)),
        "logps/rejected": mean(jnp.asarray(policy_rejected, jnp.float32)),
    }
    return loss, metrics


def sequence_log_probs(token_log_probs: Array, loss_mask: Array, average: bool = False) -> Array:
    """``Σ_t log p(y_t | y_<t, x) · m_t`` per row ``[B]`` (the response log-likelihood), or with ``average`` the
    per-token mean ``Σ_t log p · m_t / Σ_t m_t`` (IPO's length normalisation)."""
    mask = jnp.asarray(loss_mask, jnp.float32)
    total = masked_sum(token_log_probs, mask, axis=-1)
    return total / jnp.maximum(jnp.sum(mask, axis=-1), 1.0) if average else total


def token_mean_nll(token_log_probs: Array, loss_mask: Array) -> Array:
    """SFT loss: ``-Σ_{b,t} log p(y_{b,t}) · m_{b,t} / Σ m`` (token-mean negative log-likelihood over the batch's
    supervised tokens, verl's ``loss_agg_mode="token-mean"``)."""
    return -masked_mean(token_log_probs, loss_mask)
