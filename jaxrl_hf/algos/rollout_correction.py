"""Rollout/trainer mismatch correction.

The rollout engine (vLLM, or the native sampler in another precision) and the trainer compute slightly
different probabilities for the same tokens, so the rollout is off-policy for the trainer's π_old. With
ρ_t = π_old(y_t) / π_rollout(y_t) = exp(log π_old − log π_rollout):

* truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"): per-token weights w_t = min(ρ_t, C), or per-sequence w = min(Π_t ρ_t, C)
  broadcast to the tokens; they multiply the policy loss (``rollout_is_weights``).
* rejection masks: drop tokens (``token``), whole sequences (``sequence``: Π ρ_t; ``geometric``:
  exp(mean log ρ_t)) whose ratio leaves [lower, upper]; optionally veto any sequence containing a token
  with ρ_t < ``veto_threshold`` (a catastrophic mismatch).
* mismatch metrics: k1 and k3 KL(π_rollout ‖ π_old) estimates, per-sequence perplexities and their ratio,
  and the normalised effective sample size ESS = (Σ w)² / (N Σ w²) of the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_hf.algos.masked import masked_mean, masked_sum

Array = jax.Array

IS_LEVELS = ("token", "sequence", "geometric")


def _log_ratio(old_log_prob: Array, rollout_log_prob: Array, response_mask: Array) -> Array:
    mask = response_mask.astype(jnp.float32)
    return jnp.where(mask != 0, jnp.clip(old_log_prob - rollout_log_prob, -20.0, 20.0), 0.0)


def _level_log_ratio(log_ratio: Array, response_mask: Array, level: str) -> Array:
    """Per-token log ρ at the requested level, broadcast to ``[B, T]``."""
    if level not in IS_LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; valid: {list(IS_LEVELS)}")
    if level == "token":
        return log_ratio
    mask = response_mask.astype(jnp.float32)
    seq = jnp.sum(log_ratio * mask, axis=-1)
    if level == "geometric":
        seq = seq / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)
    return jnp.broadcast_to(jnp.clip(seq, -20.0, 20.0)[:, None], log_ratio.shape)


def compute_rollout_is_weights(
    old_log_prob: Array,
    rollout_log_prob: Array,
    response_mask: Array,
    *,
    level: str = "token",
    threshold: float = 2.0,
) -> Array:
    """Truncated importance weights w = min(ρ, C) at token, sequence or geometric level (C = ``threshold``),
    0 on masked tokens, detached (they scale the loss, they are not optimised)."""
    if not threshold > 0:
        raise ValueError(f"rollout_is_threshold must be > 0, got {threshold}")
    log_ratio = _level_log_ratio(_log_ratio(old_log_prob, rollout_log_prob, response_mask), response_mask, level)
    weights = jnp.minimum(jnp.exp(log_ratio), threshold) * response_mask.astype(jnp.float32)
    return jax.lax.stop_gradient(weights)


def compute_rollout_rejection_mask(
    old_log_prob: Array,
    rollout_log_prob: Array,
    response_mask: Array,
    *,
    level: str = "token",
    upper: float = 2.0,
    lower: float | None = None,
    veto_threshold: float | None = None,
) -> Array:
    """The response mask with tokens/sequences whose ratio leaves [lower, upper] removed (lower defaults to
    1/upper); with ``veto_threshold`` a sequence holding any token with ρ_t < veto is removed entirely."""
    if lower is None:
        lower = 1.0 / upper
    if not 0 <= lower < upper:
        raise ValueError(f"rollout rejection bounds need 0 <= lower < upper, got lower={lower}, upper={upper}")
    token_log_ratio = _log_ratio(old_log_prob, rollout_log_prob, response_mask)
    ratio = jnp.exp(_level_log_ratio(token_log_ratio, response_mask, level))
    keep = (ratio >= lower) & (ratio <= upper)
    if veto_threshold is not None:
        valid = response_mask != 0
        vetoed = jnp.any(valid & (jnp.exp(token_log_ratio) < veto_threshold), axis=-1)
        keep = keep & ~vetoed[:, None]
    return response_mask * keep.astype(response_mask.dtype)


def compute_mismatch_metrics(
    old_log_prob: Array, rollout_log_prob: Array, response_mask: Array, weights: Array | None = None
) -> dict[str, Array]:
    """Training-vs-rollout mismatch diagnostics (all scalars):

    ``mismatch_k1``  mean_t (log π_rollout − log π_old)           ≈ KL(π_rollout ‖ π_old)
    ``mismatch_k3``  mean_t (ρ_t − 1 − log ρ_t)                    (non-negative estimator of the same KL)
    ``mismatch_abs_logprob_diff``  mean_t |log π_old − log π_rollout|
    ``training_ppl`` / ``rollout_ppl``  mean over sequences of exp(−token-mean log-prob); ``ppl_ratio`` their
    per-sequence ratio averaged; ``ess``  (Σ w)² / (N Σ w²) over valid tokens for the given (or raw ρ) weights.
    """
    mask = response_mask.astype(jnp.float32)
    log_ratio = _log_ratio(old_log_prob, rollout_log_prob, response_mask)
    ratio = jnp.exp(log_ratio)
    seq_valid = (jnp.sum(mask, axis=-1) > 0).astype(jnp.float32)
    n_seq = jnp.maximum(jnp.sum(seq_valid), 1.0)
    train_ppl = jnp.exp(-masked_mean(old_log_prob, mask, axis=-1))
    rollout_ppl = jnp.exp(-masked_mean(rollout_log_prob, mask, axis=-1))
    w = ratio if weights is None else weights
    n_tok = jnp.maximum(jnp.sum(mask), 1.0)
    ess = jnp.square(masked_sum(w, mask)) / (n_tok * jnp.maximum(masked_sum(jnp.square(w), mask), 1e-30))
    return {
        "mismatch_k1": masked_mean(-log_ratio, mask),
        "mismatch_k3": masked_mean(ratio - 1.0 - log_ratio, mask),
        "mismatch_abs_logprob_diff": masked_mean(jnp.abs(log_ratio), mask),
        "training_ppl": jnp.sum(train_ppl * seq_valid) / n_seq,
        "rollout_ppl": jnp.sum(rollout_ppl * seq_valid) / n_seq,
        "ppl_ratio": jnp.sum(train_ppl / rollout_ppl * seq_valid) / n_seq,
        "ess": ess,
    }
