"""Process-reward-model training step: binary cross-entropy on the score at each step's boundary token only.

A PRM is a value-head decoder (``jaxrl_hf.models.value_head.ValueModel``) whose output ``v_t`` at a step's
boundary token (`jaxrl_hf.rewards.prm_data`) is the logit of "the solution is still correct after this step"
(Lightman et al. 2023, "Let's Verify Step by Step"; Wang et al. 2024, Math-Shepherd). With boundary mask ``m_t``
and labels ``y_t`` the loss is

    L = sum_t m_t · BCE(sigmoid(v_t), y_t) / sum_t m_t,    BCE(p, y) = -(y log p + (1 - y) log(1 - p)),

computed stably as ``softplus(v) - y·v``; every other token contributes nothing. The optimizer, train state and
learning-rate split (backbone vs the ``score`` head) are the reward-model trainer's (`jaxrl_hf.rewards.rm_training`).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.value_head import value_forward
from jaxrl_hf.rewards.rm_training import RMTrainState

Params = dict[str, Any]
Batch = dict[str, jax.Array]


def step_bce(logits: jax.Array, labels: jax.Array, step_mask: jax.Array) -> jax.Array:
    """Mean binary cross-entropy of ``sigmoid(logits)`` vs ``labels`` over positions where ``step_mask`` is 1
    (``softplus(v) - y·v``; 0 when there is no step)."""
    logits = logits.astype(jnp.float32)
    per_token = jax.nn.softplus(logits) - labels * logits
    return jnp.sum(per_token * step_mask) / jnp.maximum(jnp.sum(step_mask), 1.0)


def prm_loss(params: Params, config: DecoderConfig, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Step BCE of a batch (`prm_data.make_step_batch` layout) and metrics: step accuracy at threshold 0.5 and
    the mean predicted probability of correct / incorrect steps."""
    values = value_forward(params, config, batch["input_ids"], batch["attention_mask"])
    mask, labels = batch["step_mask"], batch["step_labels"]
    loss = step_bce(values, labels, mask)
    prob = jax.nn.sigmoid(values.astype(jnp.float32))
    correct = ((prob > 0.5) == (labels > 0.5)).astype(jnp.float32)
    pos, neg = mask * labels, mask * (1.0 - labels)
    metrics = {"loss": loss, "step_accuracy": jnp.sum(correct * mask) / jnp.maximum(jnp.sum(mask), 1.0),
               "prob_good_steps": jnp.sum(prob * pos) / jnp.maximum(jnp.sum(pos), 1.0),
               "prob_bad_steps": jnp.sum(prob * neg) / jnp.maximum(jnp.sum(neg), 1.0)}
    return loss, metrics


def make_prm_train_step(config: DecoderConfig, optimizer: optax.GradientTransformation,
                        donate: bool = True) -> Callable[[RMTrainState, Batch], tuple[RMTrainState, dict[str, jax.Array]]]:
    """Jitted ``(state, batch) -> (state, metrics)``: one optimizer step on `prm_loss` (metrics before the update)."""

    def step(state: RMTrainState, batch: Batch) -> tuple[RMTrainState, dict[str, jax.Array]]:
        grads, metrics = jax.grad(prm_loss, has_aux=True)(state.params, config, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return RMTrainState(state.step + 1, params, opt_state), {**metrics, "grad_norm": optax.tree.norm(grads)}

    return jax.jit(step, donate_argnums=(0,) if donate else ())


def make_step_score_fn(config: DecoderConfig) -> Callable[[Params, jax.Array, jax.Array], jax.Array]:
    """Jitted ``(params, input_ids, attention_mask) -> per-token step probabilities sigmoid(v) [B, T]``."""
    return jax.jit(lambda p, ids, mask: jax.nn.sigmoid(value_forward(p, config, ids, mask).astype(jnp.float32)))
