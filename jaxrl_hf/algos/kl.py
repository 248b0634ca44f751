"""KL estimators between the policy and the reference, KL-in-reward shaping, and KL coefficient controllers.

Estimators (Schulman, "Approximating KL divergence", 2020), with x = log π − log π_ref per token:

* ``kl`` / ``k1``            x                                  (unbiased, high variance, can be < 0)
* ``abs``                    |x|
* ``mse`` / ``k2``           ½ x²                               (biased, low variance; ∇ = x ∇log π)
* ``low_var_kl`` / ``k3``    e^{−x} + x − 1, x clamped to ±20, result clamped to ±10 (unbiased, ≥ 0)
* ``full``                   Σ_v π_v (log π_v − log π_ref,v) over the vocabulary (pass full log-probs or logits)
* ``<name>+``                straight-through: the *value* of ``<name>`` with the *gradient* of k2, i.e.
                             sg(base) + k2 − sg(k2). k2's gradient is the unbiased gradient of KL(π‖π_ref)
                             when tokens are sampled from π (the k1/k3 gradients are not).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_hf.algos.masked import masked_mean

Array = jax.Array

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")


def _base_kl(log_prob: Array, ref_log_prob: Array, name: str) -> Array:
    if name in ("kl", "k1"):
        return log_prob - ref_log_prob
    if name == "abs":
        return jnp.abs(log_prob - ref_log_prob)
    if name in ("mse", "k2"):
        return 0.5 * jnp.square(log_prob - ref_log_prob)
    if name in ("low_var_kl", "k3"):
        kl = jnp.clip(ref_log_prob - log_prob, -20.0, 20.0)
        return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)
    if name == "full":
        logp = jax.nn.log_softmax(log_prob.astype(jnp.float32), axis=-1)
        logq = jax.nn.log_softmax(ref_log_prob.astype(jnp.float32), axis=-1)
        return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
    valid = list(KL_ESTIMATORS) + [k + "+" for k in KL_ESTIMATORS if k != "full"]
    raise ValueError(f"unknown kl_penalty {name!r}; valid: {valid}")


def kl_penalty(log_prob: Array, ref_log_prob: Array, kl_penalty: str = "low_var_kl") -> Array:
    """Per-token KL estimate (formulas in the module docstring). ``full`` takes ``[..., V]`` log-probs or
    logits and returns ``[...]``; all others take and return ``[B, T]``."""
    if kl_penalty.endswith("+"):
        base_name = kl_penalty[:-1]
        if base_name == "full":
            raise ValueError("kl_penalty 'full+' is not defined: 'full' already has the exact gradient")
        base = _base_kl(log_prob, ref_log_prob, base_name)
        k2 = 0.5 * jnp.square(log_prob - ref_log_prob)
        sg = jax.lax.stop_gradient
        return sg(base) + (k2 - sg(k2))
    return _base_kl(log_prob, ref_log_prob, kl_penalty)


def apply_kl_penalty(
    token_level_scores: Array,
    old_log_prob: Array,
    ref_log_prob: Array,
    response_mask: Array,
    kl_coef: float | Array,
    kl_penalty_type: str = "kl",
) -> tuple[Array, Array]:
    """KL in the reward (InstructGPT / HybridFlow PPO): r_t = score_t − β · KL_t on valid tokens.

    Returns ``(token_level_rewards, current_kl)`` where ``current_kl`` is the batch mean of the per-sequence
    token-mean KL (the quantity the adaptive controller tracks).
    """
    mask = response_mask.astype(token_level_scores.dtype)
    kld = kl_penalty(old_log_prob, ref_log_prob, kl_penalty_type) * mask
    rewards = token_level_scores - kl_coef * kld
    current_kl = jnp.mean(masked_mean(kld, mask, axis=-1))
    return rewards, current_kl


class KLControllerState(NamedTuple):
    """The KL coefficient β and the controller's constants (a pytree, so it can live in a jitted train state;
    update with :func:`update_kl_controller`)."""

    value: Array
    target_kl: float = 0.0
    horizon: float = 0.0
    adaptive: bool = False


def init_kl_controller(kl_coef: float, *, kind: str = "fixed", target_kl: float = 0.1, horizon: float = 10000.0) -> KLControllerState:
    """Creates a fixed or adaptive (Ziegler et al. 2019, arXiv 1909.08593 §2.2) KL controller."""
    if kind not in ("fixed", "adaptive"):
        raise ValueError(f"unknown kl_ctrl.type {kind!r}; valid: ['fixed', 'adaptive']")
    if kind == "adaptive" and not horizon > 0:
        raise ValueError(f"kl_ctrl.horizon must be > 0 for the adaptive controller, got {horizon}")
    return KLControllerState(jnp.asarray(kl_coef, jnp.float32), float(target_kl), float(horizon), kind == "adaptive")


def update_kl_controller(state: KLControllerState, current_kl: Array | float, n_steps: int | Array) -> KLControllerState:
    """Adaptive: β ← β · (1 + clip(KL/KL_target − 1, −0.2, 0.2) · n_steps / horizon); fixed: unchanged."""
    target = jnp.where(state.adaptive, state.target_kl, 1.0)
    horizon = jnp.where(state.adaptive, state.horizon, 1.0)
    error = jnp.clip(current_kl / target - 1.0, -0.2, 0.2)
    updated = state.value * (1.0 + error * n_steps / horizon)
    return state._replace(value=jnp.where(state.adaptive, updated, state.value))
