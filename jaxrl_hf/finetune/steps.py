"""The jitted SFT and DPO programs: losses on a batch, one AdamW step, the reference log-probs.

* SFT (`sft_loss`): the decoder over packed buffers (``segment_ids`` as the attention mask, per-conversation
  ``position_ids``), then `jaxrl_hf.algos.preference.token_mean_nll` over the assistant tokens.
* DPO / IPO (`dpo_loss`): one forward over the ``[2P, T]`` chosen ++ rejected batch, the response log-likelihood of
  each row (`sequence_log_probs`: summed for DPO, per-token mean for IPO), then
  `jaxrl_hf.algos.preference.preference_loss` against the batch's precomputed reference log-probs.

Log-probs come from `jaxrl_hf.models.forward.token_log_probs_and_entropy` (chunked over the sequence, so the full
``[B, T, vocab]`` logits never exist at once). A step's metrics are those of the batch before the update.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import optax

from jaxrl_hf.algos.preference import preference_loss, sequence_log_probs, token_mean_nll
from jaxrl_hf.finetune.policy import TrainState, full_params
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.forward import token_log_probs_and_entropy

Batch = Mapping[str, jax.Array]
LossFn = Callable[[Any, Batch], tuple[jax.Array, dict[str, jax.Array]]]


def packed_token_log_probs(params: Any, config: DecoderConfig, batch: Batch) -> jax.Array:
    """``log p(targets[t] | tokens <= t of the same conversation)`` ``[N, L]`` on packed SFT buffers."""
    logp, _ = token_log_probs_and_entropy(params, config, batch["input_ids"], batch["targets"],
                                          attention_mask=batch["segment_ids"], positions=batch["position_ids"],
                                          with_entropy=False)
    return logp


def sft_loss(params: Any, config: DecoderConfig, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-mean NLL over the learned (assistant) tokens of the packed batch, and ``train/loss``."""
    loss = token_mean_nll(packed_token_log_probs(params, config, batch), batch["loss_mask"])
    return loss, {"train/loss": loss}


def response_log_probs(params: Any, config: DecoderConfig, batch: Batch, average: bool) -> jax.Array:
    """Response log-likelihood of every row ``[2P]`` of a preference batch (summed, or per-token mean)."""
    logp, _ = token_log_probs_and_entropy(params, config, batch["input_ids"], batch["targets"],
                                          attention_mask=batch["attention_mask"], with_entropy=False)
    return sequence_log_probs(logp, batch["loss_mask"], average=average)


def dpo_loss(params: Any, config: DecoderConfig, batch: Batch, loss_type: str,
             beta: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DPO (``"dpo"``) or IPO (``"ipo"``) loss of the batch against ``ref_logps [2P]`` and TRL's metrics."""
    logps = response_log_probs(params, config, batch, average=loss_type == "ipo")
    ref = batch["ref_logps"]
    p = logps.shape[0] // 2
    return preference_loss(loss_type, logps[:p], logps[p:], ref[:p], ref[p:], beta, batch["pair_mask"])


def make_reference_fn(config: DecoderConfig, average: bool) -> Callable[[Any, Batch], jax.Array]:
    """Jitted ``(params, batch) -> [2P]`` response log-probs (for the frozen reference model)."""
    return jax.jit(lambda params, batch: response_log_probs(params, config, batch, average))


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, lora_cfg: Any,
                    donate: bool = True) -> Callable[[TrainState, Any, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """Jitted ``(state, frozen, batch) -> (state, metrics)``: gradients of ``loss_fn(full_params, batch)`` with
    respect to the trainable params only, clipped, one AdamW update; ``train/grad_norm`` is the norm before
    clipping."""

    def step(state: TrainState, frozen: Any, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        def objective(trainable: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
            return loss_fn(full_params(trainable, frozen, lora_cfg), batch)

        grads, metrics = jax.grad(objective, has_aux=True)(state.trainable)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.trainable)
        trainable = optax.apply_updates(state.trainable, updates)
        return TrainState(state.step + 1, trainable, opt_state), {**metrics, "train/grad_norm": optax.tree.norm(grads)}

    return jax.jit(step, donate_argnums=(0,) if donate else ())
