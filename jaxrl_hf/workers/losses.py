"""Pure per-micro-batch losses of the actor and the critic, written for exact gradient accumulation.

Both receive a micro-batch dict (``input_ids``, ``attention_mask``, ``position_ids`` ``[b, P+R]``;
``responses``, ``response_mask`` and the per-token inputs ``[b, R]``) and the mini-batch denominator
(``algos.agg_loss_denominator`` of the whole mini-batch's ``response_mask``), and return this micro-batch's
*share* of the loss: the shares summed over the micro-batches equal the mini-batch loss exactly.

Actor (PPO objective with the verl extensions, HybridFlow eq.1 / DAPO eq.10)::

    L = pg_loss(π_old, π_θ, A; loss_mode, clip ε_low/ε_high, dual-clip c, TIS weights)
        − entropy_coeff · agg(H(π_θ))  +  kl_loss_coef · agg(KL_est(π_θ ‖ π_ref))   (GRPO eq.4 KL term)

Critic (PPO2 clipped value loss): ½ · agg(max((V − R)², (V_clip − R)²)).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_hf import algos
from jaxrl_hf.config.schema import ActorConfig, CriticConfig
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.algos.router_losses import router_metrics
from jaxrl_hf.models.forward import (hidden_states, hidden_states_and_routing, lm_head_log_probs, routed_experts_by_layer,
                                     routed_experts_by_token)
from jaxrl_hf.models.llama import constrain
from jaxrl_hf.models.value_head import value_forward
from jaxrl_hf.user_modules import call_registered

Array = jax.Array


def response_log_probs(params: Any, config: DecoderConfig, input_ids: Array, attention_mask: Array,
                       position_ids: Array, response_length: int, temperature: float = 1.0,
                       with_entropy: bool = True, chunk_size: int = 128, mesh: Any = None,
                       rules: Any = None, with_routing: bool = False, routed_experts: Array | None = None) -> tuple:
    """``(log π(y_t | x, y_<t), H_t)``, both ``[b, R]`` float32, for the last ``R`` tokens of ``input_ids``.

    The logits are divided by ``temperature`` (the rollout temperature, so these match the sampler's
    log-probs); the LM head only runs on the ``R`` positions that predict response tokens. ``with_routing`` (a
    mixture-of-experts model): a third element, the pass's `Routed` tokens. ``routed_experts [b, P+R, layers, k]``:
    the experts every token is routed to (routing replay, ``actor.router_replay``).
    """
    replay = None if routed_experts is None else routed_experts_by_layer(routed_experts)
    hidden, routing = hidden_states_and_routing(params, config, input_ids, attention_mask, position_ids, mesh, rules,
                                                replay) if with_routing else \
        (hidden_states(params, config, input_ids, attention_mask, position_ids, mesh, rules, replay), None)
    prompt_len = input_ids.shape[1] - response_length
    if prompt_len < 1:
        raise ValueError(f"input_ids width {input_ids.shape[1]} leaves no prompt before {response_length} response tokens")
    h = hidden[:, prompt_len - 1:-1]
    log_prob, entropy = lm_head_log_probs(params, config, h, input_ids[:, prompt_len:], temperature, chunk_size,
                                          with_entropy)
    out = (whole_rows(log_prob, mesh, rules), whole_rows(entropy, mesh, rules))
    return out + (Routed(*routing, attention_mask.reshape(-1)),) if routing is not None else out


class Routed(NamedTuple):
    """A mixture-of-experts forward's routing (`jaxrl_hf.models.forward.hidden_states_and_routing`) and which of its
    ``N`` flattened tokens are real (``token_mask [N]``: the attention mask, or the packed tokens)."""

    logits: Array
    experts: Array
    token_mask: Array


def whole_rows(per_token: Array, mesh: Any = None, rules: Any = None) -> Array:
    """``[b, R]`` per-token outputs laid out by rows only (batch over the data axes, tokens whole): sequence
    parallelism leaves them split over ``sp``; the losses and the host (`process_local_rows`) take whole rows (verl
    gathers its Ulysses outputs the same way)."""
    return constrain(per_token, ("batch", None), mesh, rules) if mesh is not None and rules is not None else per_token


def response_values(params: Any, config: DecoderConfig, input_ids: Array, attention_mask: Array,
                    position_ids: Array, response_length: int, mesh: Any = None, rules: Any = None) -> Array:
    """Critic values ``[b, R]``: V at the position *before* each response token (the state it was chosen in)."""
    values = value_forward(params, config, input_ids, attention_mask, position_ids, mesh, rules)
    return whole_rows(values[:, -response_length - 1:-1], mesh, rules)


@dataclasses.dataclass(frozen=True)
class ActorLossConfig:
    """Static options of the actor loss (hashable; see the module docstring): a flat view of the ``actor``
    section plus the rollout temperature, built by `actor_loss_config` (the defaults live in the schema)."""

    loss_mode: str
    loss_agg_mode: str
    clip_ratio: float
    clip_ratio_low: float | None
    clip_ratio_high: float | None
    clip_ratio_c: float
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    temperature: float
    rollout_correction_level: str | None
    rollout_correction_threshold: float
    router_aux_loss_coef: float
    router_z_loss_coef: float

    def __post_init__(self) -> None:
        for key in ("router_aux_loss_coef", "router_z_loss_coef"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"actor.{key}={getattr(self, key)!r}: must be >= 0 (0 turns the term off)")
        algos.get_policy_loss(self.loss_mode)  # raises listing the valid names
        if self.loss_agg_mode not in algos.LOSS_AGG_MODES:
            raise ValueError(f"actor.loss_agg_mode={self.loss_agg_mode!r}; valid: {list(algos.LOSS_AGG_MODES)}")
        if self.use_kl_loss:
            algos.kl_penalty(jnp.zeros((1, 1)), jnp.zeros((1, 1)), self.kl_loss_type)  # validates the name
        if self.rollout_correction_level not in (None,) + algos.rollout_correction.IS_LEVELS:
            raise ValueError(f"actor.rollout_correction.level={self.rollout_correction_level!r}; valid: "
                             f"[None, {', '.join(map(repr, algos.rollout_correction.IS_LEVELS))}]")
        if not self.temperature > 0:
            raise ValueError(f"rollout.temperature used for log-probs must be > 0, got {self.temperature}")

    def required_keys(self) -> tuple[str, ...]:
        """Batch keys ``update_actor`` needs under this configuration."""
        keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "old_log_probs",
                "advantages"]
        if self.use_kl_loss:
            keys.append("ref_log_prob")
        if self.rollout_correction_level is not None:
            keys.append("rollout_log_probs")
        keys += [k for k in algos.policy_loss_needs(self.loss_mode) if k not in keys]
        return tuple(keys)


def actor_loss_config(actor: ActorConfig, temperature: float) -> ActorLossConfig:
    """The loss view of the ``actor`` section; ``temperature`` is ``rollout.temperature`` (log-probs are taken
    of ``logits / T``, as the sampler's). Raises ``ValueError`` naming the bad key."""
    return ActorLossConfig(
        loss_mode=actor.policy_loss.loss_mode, loss_agg_mode=actor.loss_agg_mode, clip_ratio=actor.clip_ratio,
        clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c,
        entropy_coeff=actor.entropy_coeff, use_kl_loss=actor.use_kl_loss, kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type, temperature=temperature,
        rollout_correction_level=actor.rollout_correction.level,
        rollout_correction_threshold=actor.rollout_correction.threshold,
        router_aux_loss_coef=actor.router_aux_loss_coef, router_z_loss_coef=actor.router_z_loss_coef)


ACTOR_SUMMED_METRICS = ("pg_loss", "entropy", "kl_loss")


def response_denominator(loss_agg_mode: str) -> Any:
    """``denominator_fn`` for `make_train_step`: the aggregation denominator of the whole mini-batch."""
    def denominator(micro_batches: Mapping[str, Array]) -> Array:
        mask = micro_batches["response_mask"]
        return algos.agg_loss_denominator(mask.reshape(-1, mask.shape[-1]), loss_agg_mode)
    return denominator


def token_count(micro: Mapping[str, Array]) -> Array:
    """The real tokens (prompt and response) of a micro-batch or a stack of them: the attention mask's, or the packed
    tokens' (``pack_segment_ids > 0``)."""
    if "pack_segment_ids" in micro:
        return jnp.sum((micro["pack_segment_ids"] > 0).astype(jnp.float32))
    return jnp.sum(micro["attention_mask"].astype(jnp.float32))


def actor_denominators(loss_agg_mode: str) -> Any:
    """``denominator_fn`` of the actor's update: ``(the aggregation denominator, the mini-batch's real tokens)``;
    the second weighs each micro-batch's router losses (`actor_loss`) by its share of the tokens. A layout that
    carries neither token mask (one packed row per prompt group, `jaxrl_hf.workers.group_packing`, which a
    mixture-of-experts update does not use) gets the aggregation denominator alone."""
    agg = response_denominator(loss_agg_mode)

    def denominators(micro_batches: Mapping[str, Array]) -> Any:
        if "attention_mask" not in micro_batches and "pack_segment_ids" not in micro_batches:
            return agg(micro_batches)
        return agg(micro_batches), token_count(micro_batches)
    return denominators


LogProbFn = Callable[[Any, Mapping[str, Array], float], tuple[Array, Array]]
ValueFn = Callable[[Any, Mapping[str, Array]], Array]


def lm_log_prob_fn(model_config: DecoderConfig, mesh: Any = None, rules: Any = None,
                   chunk_size: int = 128, with_routing: bool = False, record_routing: bool = False) -> LogProbFn:
    """``fn(params, micro, temperature) -> (log_prob, entropy)`` of the decoder on a rollout micro-batch
    (``with_routing``, a mixture-of-experts model: ``+ (Routed,)``, for the update's router losses;
    ``record_routing``: ``+ (routed_experts [b, P+R, layers, k],)``, the experts of every token). A micro-batch
    with ``routed_experts`` is routed by them (routing replay)."""
    def fn(params: Any, micro: Mapping[str, Array], temperature: float) -> tuple:
        out = response_log_probs(params, model_config, micro["input_ids"], micro["attention_mask"],
                                 micro["position_ids"], micro["responses"].shape[1], temperature,
                                 with_entropy=True, chunk_size=chunk_size, mesh=mesh, rules=rules,
                                 with_routing=with_routing or record_routing,
                                 routed_experts=micro.get("routed_experts"))
        if not record_routing:
            return out
        return out[:2] + (routed_experts_by_token(out[2].experts, micro["input_ids"].shape[0]),)
    return fn


def value_head_fn(model_config: DecoderConfig, mesh: Any = None, rules: Any = None) -> ValueFn:
    """``fn(params, micro) -> values [b, R]`` of the value-head model on a rollout micro-batch."""
    def fn(params: Any, micro: Mapping[str, Array]) -> Array:
        return response_values(params, model_config, micro["input_ids"], micro["attention_mask"],
                               micro["position_ids"], micro["responses"].shape[1], mesh, rules)
    return fn


def actor_loss(params: Any, micro: Mapping[str, Array], denominator: Array, *, log_prob_fn: LogProbFn,
               cfg: ActorLossConfig) -> tuple[Array, dict[str, Array]]:
    """This micro-batch's share of the actor loss and its metrics (module docstring).

    ``log_prob_fn`` is the policy (`lm_log_prob_fn` for the decoder); the loss itself is model-agnostic.
    """
    mask = micro["response_mask"].astype(jnp.float32)
    denominator, tokens = denominator if isinstance(denominator, tuple) else (denominator, None)
    log_prob, entropy, *routed = log_prob_fn(params, micro, cfg.temperature)
    weights = None
    if cfg.rollout_correction_level is not None:
        weights = algos.compute_rollout_is_weights(micro["old_log_probs"], micro["rollout_log_probs"], mask,
                                                   level=cfg.rollout_correction_level,
                                                   threshold=cfg.rollout_correction_threshold)
    # without the column the update is one optimizer step at the sampling policy: π_old = sg(π_θ)
    old_log_prob = micro["old_log_probs"] if "old_log_probs" in micro else jax.lax.stop_gradient(log_prob)
    pg_loss, pg_metrics = call_registered(
        "policy loss", cfg.loss_mode, algos.get_policy_loss(cfg.loss_mode),
        old_log_prob, log_prob, micro["advantages"], mask, loss_agg_mode=cfg.loss_agg_mode,
        clip_ratio=cfg.clip_ratio, clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high,
        clip_ratio_c=cfg.clip_ratio_c, rollout_is_weights=weights, global_denominator=denominator,
        **{key: micro[key] for key in algos.policy_loss_needs(cfg.loss_mode)})
    entropy_share = algos.agg_loss(entropy, mask, cfg.loss_agg_mode, global_denominator=denominator)
    loss = pg_loss - cfg.entropy_coeff * entropy_share
    metrics = {"pg_loss": pg_loss, "entropy": jax.lax.stop_gradient(entropy_share), **pg_metrics}
    if cfg.use_kl_loss:
        kl = algos.kl_penalty(log_prob, micro["ref_log_prob"], cfg.kl_loss_type)
        kl_share = algos.agg_loss(kl, mask, cfg.loss_agg_mode, global_denominator=denominator)
        loss = loss + cfg.kl_loss_coef * kl_share
        metrics["kl_loss"] = kl_share
    if routed:  # a mixture-of-experts policy: its router losses, weighted by this micro-batch's share of the tokens
        if tokens is None:
            raise ValueError("actor_loss: a routed forward needs the (denominator, tokens) pair of actor_denominators")
        (r,) = routed
        router = router_metrics(r.logits, r.experts, r.token_mask)
        share = token_count(micro) / jnp.maximum(tokens, 1.0)
        loss = loss + share * (cfg.router_aux_loss_coef * router["moe/aux_loss"]
                               + cfg.router_z_loss_coef * router["moe/z_loss"])
        metrics.update(jax.lax.stop_gradient(router))
    return loss, metrics


@dataclasses.dataclass(frozen=True)
class CriticLossConfig:
    """Static options of the critic loss (the ``critic`` section's, through `critic_loss_config`)."""

    cliprange_value: float
    loss_agg_mode: str

    def __post_init__(self) -> None:
        if self.loss_agg_mode not in algos.LOSS_AGG_MODES:
            raise ValueError(f"critic.loss_agg_mode={self.loss_agg_mode!r}; valid: {list(algos.LOSS_AGG_MODES)}")
        if not self.cliprange_value > 0:
            raise ValueError(f"critic.cliprange_value must be > 0, got {self.cliprange_value}")


def critic_loss_config(critic: CriticConfig) -> CriticLossConfig:
    """The loss view of the ``critic`` section; raises ``ValueError`` naming the bad key."""
    return CriticLossConfig(cliprange_value=critic.cliprange_value, loss_agg_mode=critic.loss_agg_mode)


CRITIC_SUMMED_METRICS = ("vf_loss",)


def critic_loss(params: Any, micro: Mapping[str, Array], denominator: Array, *, value_fn: ValueFn,
                cfg: CriticLossConfig) -> tuple[Array, dict[str, Array]]:
    """This micro-batch's share of the clipped value loss (``algos.compute_value_loss``) and its metrics."""
    mask = micro["response_mask"].astype(jnp.float32)
    vpreds = value_fn(params, micro)
    loss, clipfrac = algos.compute_value_loss(vpreds, micro["returns"], micro["values"], mask, cfg.cliprange_value,
                                              cfg.loss_agg_mode, global_denominator=denominator)
    vpred_mean = algos.masked_mean(jax.lax.stop_gradient(vpreds), mask)
    return loss, {"vf_loss": loss, "vf_clipfrac": clipfrac, "vpred_mean": vpred_mean}
