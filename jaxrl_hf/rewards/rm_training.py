"""Bradley-Terry reward-model training step (Ouyang et al., 2022, §3.5 eq. 1; Stiennon et al., 2020).

The reward of a sequence is the value head of a ``ValueModel`` read at its last real token (the
end-of-sequence token of the response). For pairs ``(chosen, rejected)`` the loss is
``mean(-log sigmoid(r(chosen) - r(rejected)))`` (``jaxrl_hf.rewards.bradley_terry.bt_loss``). Chosen and
rejected sequences go through the model as one ``[2P, T]`` forward. Everything here is pure and jit-able;
the optimizer is optax AdamW with warm-up, gradient clipping, no weight decay on norms and the head, and
a larger learning rate for the freshly initialised head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.value_head import value_forward
from jaxrl_hf.rewards.bradley_terry import bt_loss

Params = dict[str, Any]
Batch = dict[str, jax.Array]


def last_token_index(attention_mask: jax.Array) -> jax.Array:
    """Index of the last position with ``attention_mask == 1`` in each row (left or right padding)."""
    positions = jnp.arange(attention_mask.shape[-1], dtype=jnp.int32)
    return jnp.max(jnp.where(attention_mask > 0, positions, -1), axis=-1)


def sequence_scores(params: Params, config: DecoderConfig, input_ids: jax.Array,
                    attention_mask: jax.Array) -> jax.Array:
    """Reward ``[B]`` float32: the value head at each row's last real token. Rows must hold >= 1 token."""
    values = value_forward(params, config, input_ids, attention_mask)
    last = last_token_index(attention_mask)
    return jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]


def pair_scores(params: Params, config: DecoderConfig, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """``(r_chosen [P], r_rejected [P])`` from one forward over the stacked ``[2P, T]`` sequences."""
    ids = jnp.concatenate([batch["chosen_ids"], batch["rejected_ids"]], axis=0)
    mask = jnp.concatenate([batch["chosen_mask"], batch["rejected_mask"]], axis=0)
    scores = sequence_scores(params, config, ids, mask)
    n = batch["chosen_ids"].shape[0]
    return scores[:n], scores[n:]


def preference_loss(params: Params, config: DecoderConfig, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Bradley-Terry loss over the batch's real pairs (``pair_mask``) and metrics: accuracy, mean margin."""
    chosen, rejected = pair_scores(params, config, batch)
    mask = batch["pair_mask"].astype(jnp.float32)
    loss = bt_loss(chosen, rejected, mask)
    count = jnp.maximum(jnp.sum(mask), 1.0)
    accuracy = jnp.sum((chosen > rejected).astype(jnp.float32) * mask) / count
    margin = jnp.sum((chosen - rejected) * mask) / count
    return loss, {"loss": loss, "accuracy": accuracy, "margin": margin}


@dataclass(frozen=True)
class RMOptimConfig:
    """AdamW settings: ``lr`` for the backbone, ``lr * head_lr_multiplier`` for the ``score`` head."""

    lr: float = 2e-5
    head_lr_multiplier: float = 10.0
    weight_decay: float = 0.0
    warmup_steps: int = 5
    max_grad_norm: float = 1.0
    b1: float = 0.9
    b2: float = 0.95

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"RMOptimConfig.lr must be > 0, got {self.lr}")
        if not self.head_lr_multiplier > 0:
            raise ValueError(f"RMOptimConfig.head_lr_multiplier must be > 0, got {self.head_lr_multiplier}")
        if self.weight_decay < 0 or self.warmup_steps < 0 or not self.max_grad_norm > 0:
            raise ValueError(f"RMOptimConfig needs weight_decay >= 0, warmup_steps >= 0, max_grad_norm > 0; got {self}")


def _matrices(params: Any) -> Any:
    """Weight-decay mask: matrices (ndim >= 2) only, not norm scales."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def warmup_schedule(lr: float, warmup_steps: int) -> optax.Schedule:
    """The learning rate of update ``k`` (0-based): ``lr · k / warmup_steps`` during the warm-up, then ``lr``."""
    return optax.linear_schedule(0.0, lr, warmup_steps) if warmup_steps else optax.constant_schedule(lr)


def make_optimizer(cfg: RMOptimConfig, params: Params) -> optax.GradientTransformation:
    """``clip_by_global_norm`` then AdamW with linear warm-up; the head gets ``head_lr_multiplier`` x lr
    and no weight decay; in the backbone only matrices are decayed."""

    def adamw(lr: float, weight_decay: float) -> optax.GradientTransformation:
        return optax.adamw(warmup_schedule(lr, cfg.warmup_steps), b1=cfg.b1, b2=cfg.b2, weight_decay=weight_decay,
                           mask=_matrices)

    labels = {k: jax.tree.map(lambda _: "head" if k == "score" else "backbone", v) for k, v in params.items()}
    return optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.multi_transform({"backbone": adamw(cfg.lr, cfg.weight_decay),
                             "head": adamw(cfg.lr * cfg.head_lr_multiplier, 0.0)}, labels),
    )


class RMTrainState(NamedTuple):
    """Step counter, value-model params and optimizer state."""

    step: jax.Array
    params: Params
    opt_state: Any


def init_train_state(params: Params, optimizer: optax.GradientTransformation) -> RMTrainState:
    """Fresh state at step 0."""
    return RMTrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))


def make_train_step(config: DecoderConfig, optimizer: optax.GradientTransformation,
                    donate: bool = True) -> Callable[[RMTrainState, Batch], tuple[RMTrainState, dict[str, jax.Array]]]:
    """Jitted ``(state, batch) -> (state, metrics)``: one AdamW step on the Bradley-Terry loss.

    ``metrics`` (loss, accuracy, margin, grad_norm) are those of the batch *before* the update.
    """

    def step(state: RMTrainState, batch: Batch) -> tuple[RMTrainState, dict[str, jax.Array]]:
        grads, metrics = jax.grad(preference_loss, has_aux=True)(state.params, config, batch)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {**metrics, "grad_norm": optax.tree.norm(grads)}
        return RMTrainState(state.step + 1, params, opt_state), metrics

    return jax.jit(step, donate_argnums=(0,) if donate else ())


def make_score_fn(config: DecoderConfig) -> Callable[[Params, jax.Array, jax.Array], jax.Array]:
    """Jitted ``(params, input_ids, attention_mask) -> scores [B]``."""
    return jax.jit(lambda params, ids, mask: sequence_scores(params, config, ids, mask))
