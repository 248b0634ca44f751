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

Add one with ``@register_kl_estimator(name)`` (its ``<name>+`` form comes with it).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_hf.algos.masked import masked_mean
from jaxrl_hf.registry import Registry

Array = jax.Array

KLEstimatorFn = Callable[[Array, Array], Array]

#: ``algorithm.kl_penalty`` / ``actor.kl_loss_type`` names: every estimator above and its ``<name>+`` form.
KL_ESTIMATORS: Registry[KLEstimatorFn] = Registry("KL estimator", metadata={"straight_through": True})


def register_kl_estimator(name: str, *, override: bool = False,
                          **metadata: Any) -> Callable[[KLEstimatorFn], KLEstimatorFn]:
    """Decorator: make ``fn(log_prob, ref_log_prob) -> per-token KL`` available by ``name`` and, unless
    ``straight_through=False``, by ``name + "+"`` (its value with k2's gradient, module docstring)."""
    register = KL_ESTIMATORS.register(name, override=override, **metadata)
    register_plus = KL_ESTIMATORS.register(name + "+", override=override, straight_through=False)

    def decorator(fn: KLEstimatorFn) -> KLEstimatorFn:
        register(fn)
        if KL_ESTIMATORS.info(name)["straight_through"]:
            register_plus(_straight_through(fn))
        return fn

    return decorator


def _straight_through(base: KLEstimatorFn) -> KLEstimatorFn:
    def value_of_base_gradient_of_k2(log_prob: Array, ref_log_prob: Array) -> Array:
        k2 = 0.5 * jnp.square(log_prob - ref_log_prob)
        sg = jax.lax.stop_gradient
        return sg(base(log_prob, ref_log_prob)) + (k2 - sg(k2))

    return value_of_base_gradient_of_k2


@register_kl_estimator("kl")
@register_kl_estimator("k1")
def kl_k1(log_prob: Array, ref_log_prob: Array) -> Array:
    return log_prob - ref_log_prob


@register_kl_estimator("abs")
def kl_abs(log_prob: Array, ref_log_prob: Array) -> Array:
    return jnp.abs(log_prob - ref_log_prob)


@register_kl_estimator("mse")
@register_kl_estimator("k2")
def kl_k2(log_prob: Array, ref_log_prob: Array) -> Array:
    return 0.5 * jnp.square(log_prob - ref_log_prob)


@register_kl_estimator("low_var_kl")
@register_kl_estimator("k3")
def kl_k3(log_prob: Array, ref_log_prob: Array) -> Array:
    kl = jnp.clip(ref_log_prob - log_prob, -20.0, 20.0)
    return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)


@register_kl_estimator("full", straight_through=False)  # already the exact gradient
def kl_full(log_prob: Array, ref_log_prob: Array) -> Array:
    logp = jax.nn.log_softmax(log_prob.astype(jnp.float32), axis=-1)
    logq = jax.nn.log_softmax(ref_log_prob.astype(jnp.float32), axis=-1)
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def kl_penalty(log_prob: Array, ref_log_prob: Array, kl_penalty: str = "low_var_kl") -> Array:
    """Per-token KL estimate (formulas in the module docstring). ``full`` takes ``[..., V]`` log-probs or
    logits and returns ``[...]``; all others take and return ``[B, T]``. Unknown names raise listing the valid
    ones (`KL_ESTIMATORS`)."""
    return KL_ESTIMATORS.get(kl_penalty)(log_prob, ref_log_prob)


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
