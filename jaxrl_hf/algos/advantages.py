"""Advantage estimators: ``fn(token_level_rewards, response_mask, *, index, values, reward_baselines, gamma,
lam, norm_adv_by_std_in_grpo, ...) -> (advantages, returns)``, all ``[B, T]``.

Names follow verl's ``algorithm.adv_estimator`` values. Each estimator declares the batch inputs it cannot
work without (``@register_adv_estimator("grpo", needs=("index",))``); the trainer passes exactly those, plus
the ``algorithm.*`` values its signature names (``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``). Inputs:
``index: [B]`` integer prompt ids (the n samples of one prompt share an id; needing it means ``rollout.n >= 2``),
``values: [B, T]`` (the critic's; needing them turns the critic on), ``reward_baselines: [B]`` (ReMax's greedy
reward), or any other batch column by its name. An estimator written for verl needs no declaration: the
`SIGNATURE_INPUTS` its signature names are passed (required without a default, when present with one), and a
``config`` parameter gets the ``algorithm`` section (``config.get(key, default)`` works as on verl's). Each built-in
also accepts (and ignores) keywords it does not use, so every estimator can be called the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

from jaxrl_hf.algos.declarations import keyword_parameters, register_declared, signature_inputs
from jaxrl_hf.algos.masked import group_count, group_ids, group_mean, group_std, masked_whiten
from jaxrl_hf.registry import Registry

Array = jax.Array


class AdvantageEstimator(Protocol):
    def __call__(self, token_level_rewards: Array, response_mask: Array, **kwargs) -> tuple[Array, Array]: ...


ADV_ESTIMATORS: Registry[Callable[..., tuple[Array, Array]]] = Registry("advantage estimator", metadata={"needs": ()})


def register_adv_estimator(name: str, *, override: bool = False, **metadata: Any):
    """Decorator: make ``fn`` available as ``algorithm.adv_estimator=name``.

    ``needs=("index",)`` (or ``"values"``, ``"reward_baselines"``, a batch column's name) lists the inputs the
    estimator cannot work without (module docstring); ``fn`` must accept each as a keyword.
    """
    return register_declared(ADV_ESTIMATORS, name, override, metadata)


def get_adv_estimator(name: str) -> Callable[..., tuple[Array, Array]]:
    """Looks an estimator up by name; an unknown name raises and lists the valid ones."""
    return ADV_ESTIMATORS.get(name)


#: Batch inputs an estimator may take by naming them in its signature, as verl passes them to its registered
#: estimators (``index``: the group ids; ``reward_baselines``) plus the critic's ``values``.
SIGNATURE_INPUTS = ("index", "values", "reward_baselines")


def adv_estimator_needs(name: str) -> tuple[str, ...]:
    """The inputs estimator ``name`` cannot work without: those it declared with ``needs=``, and the
    `SIGNATURE_INPUTS` its signature takes without a default (unknown names raise listing the valid ones)."""
    required, _ = signature_inputs(get_adv_estimator(name), SIGNATURE_INPUTS)
    declared = ADV_ESTIMATORS.info(name)["needs"]
    return declared + tuple(n for n in required if n not in declared)


def adv_estimator_optional_inputs(name: str) -> tuple[str, ...]:
    """The `SIGNATURE_INPUTS` estimator ``name`` takes with a default and did not declare: passed when the batch
    has them (as verl passes ``index`` whenever the batch has group ids)."""
    _, optional = signature_inputs(get_adv_estimator(name), SIGNATURE_INPUTS)
    return tuple(n for n in optional if n not in adv_estimator_needs(name))


def adv_estimator_options(name: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of ``values`` (e.g. the ``algorithm`` section's scalars) that estimator ``name`` names as
    keyword parameters: what a caller passes besides the needed inputs."""
    return {key: values[key] for key in keyword_parameters(get_adv_estimator(name)) if key in values}


def _require(name: str, **arrays) -> None:
    for key, value in arrays.items():
        if value is None:
            raise ValueError(f"advantage estimator {name!r} needs `{key}`")


def _outcome_scores(token_level_rewards: Array) -> Array:
    return jnp.sum(token_level_rewards, axis=-1)


def _check_shapes(name: str, token_level_rewards: Array, response_mask: Array, index: Array | None = None) -> None:
    if token_level_rewards.ndim != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"{name}: token_level_rewards {token_level_rewards.shape} and response_mask {response_mask.shape}"
            " must both be [batch, response_length]"
        )
    if index is not None and jnp.shape(index) != (token_level_rewards.shape[0],):
        raise ValueError(f"{name}: index must be [batch]={token_level_rewards.shape[0]}, got {jnp.shape(index)}")


@register_adv_estimator("gae", needs=("values",))
def compute_gae_advantage_return(
    token_level_rewards: Array,
    response_mask: Array,
    *,
    values: Array | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_: object,
) -> tuple[Array, Array]:
    """Generalized Advantage Estimation (HybridFlow/PPO eq.2–3; Schulman et al. 2016).

    δ_t = r_t + γ V_{t+1} − V_t,  A_t = δ_t + γλ A_{t+1},  returns R_t = A_t + V_t, then A is whitened over
    the valid tokens. Masked positions are skipped: V_{t+1} and A_{t+1} carry over the last valid ones,
    so a response with holes (e.g. tool-output tokens) is treated as if the holes were absent.
    """
    _require("gae", values=values)
    _check_shapes("gae", token_level_rewards, response_mask)
    mask = response_mask.astype(token_level_rewards.dtype)
    values = values.astype(token_level_rewards.dtype)

    def step(carry, xs):
        next_value, last_gae = carry
        r_t, v_t, m_t = xs
        delta = r_t + gamma * next_value - v_t
        gae = delta + gamma * lam * last_gae
        next_value = v_t * m_t + (1.0 - m_t) * next_value
        last_gae = gae * m_t + (1.0 - m_t) * last_gae
        return (next_value, last_gae), last_gae

    zeros = jnp.zeros(token_level_rewards.shape[0], token_level_rewards.dtype)
    xs = (token_level_rewards.T, values.T, mask.T)
    _, adv_rev = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    advantages = adv_rev.T
    returns = advantages + values
    return masked_whiten(advantages, mask), returns


@register_adv_estimator("grpo", needs=("index",))
def compute_grpo_outcome_advantage(
    token_level_rewards: Array,
    response_mask: Array,
    *,
    index: Array | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **_: object,
) -> tuple[Array, Array]:
    """GRPO group-normalised outcome advantage (DeepSeekMath; DESIGN eq.4).

    Â_i = (R_i − mean(R_group)) / (std(R_group) + ε) broadcast to every valid token, std unbiased (n−1).
    A group of one gets mean 0 / std 1 (its advantage is its raw score). ``norm_adv_by_std_in_grpo=False``
    drops the division (Dr.GRPO, Liu et al. 2025).
    """
    _require("grpo", index=index)
    _check_shapes("grpo", token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards)
    gid = group_ids(index)
    single = group_count(gid) == 1
    mean = jnp.where(single, 0.0, group_mean(scores, gid))
    std = jnp.where(single, 1.0, group_std(scores, gid))
    adv = scores - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = adv[:, None] * response_mask.astype(scores.dtype)
    return adv, adv


@register_adv_estimator("grpo_passk", needs=("index",))
def compute_grpo_passk_outcome_advantage(
    token_level_rewards: Array,
    response_mask: Array,
    *,
    index: Array | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
    **_: object,
) -> tuple[Array, Array]:
    """Pass@k advantage (Chen et al. 2025, arXiv 2503.19595): only the best sample of each group gets
    r_max − r_second_max (optionally / (std + ε)); every other sample gets 0. Ties go to the first sample.
    Groups of one are an error (checked when ``index`` is concrete)."""
    _require("grpo_passk", index=index)
    _check_shapes("grpo_passk", token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards)
    n = scores.shape[0]
    gid = group_ids(index)
    same = gid[:, None] == gid[None, :]
    pos = jnp.arange(n)
    # i is the group's best if no other member beats it (earlier members win ties).
    beats_i = same & ((scores[None, :] > scores[:, None]) | ((scores[None, :] == scores[:, None]) & (pos[None, :] < pos[:, None])))
    is_best = ~jnp.any(beats_i, axis=1)
    second = jnp.max(jnp.where(same & (pos[None, :] != pos[:, None]), scores[None, :], -jnp.inf), axis=1)
    adv = jnp.where(is_best, scores - second, 0.0)
    if norm_adv_by_std_in_grpo:
        adv = adv / (group_std(scores, gid) + epsilon)
    if not isinstance(index, jax.core.Tracer) and bool(jnp.any(group_count(gid) < 2)):
        raise ValueError("grpo_passk needs at least 2 samples per group (rollout.n >= 2)")
    adv = adv[:, None] * response_mask.astype(scores.dtype)
    return adv, adv


@register_adv_estimator("rloo", needs=("index",))
def compute_rloo_outcome_advantage(
    token_level_rewards: Array, response_mask: Array, *, index: Array | None = None, **_: object
) -> tuple[Array, Array]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv 2402.14740).

    Â_i = R_i − (1/(n−1)) Σ_{j≠i} R_j = n/(n−1)·(R_i − mean(R_group)); a singleton keeps its raw score.
    """
    _require("rloo", index=index)
    _check_shapes("rloo", token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards)
    gid = group_ids(index)
    n = group_count(gid).astype(scores.dtype)
    factor = n / jnp.maximum(n - 1.0, 1.0)
    adv = jnp.where(n > 1, scores * factor - group_mean(scores, gid) * factor, scores)
    adv = adv[:, None] * response_mask.astype(scores.dtype)
    return adv, adv


@register_adv_estimator("opo", needs=("index",))
def compute_opo_outcome_advantage(
    token_level_rewards: Array, response_mask: Array, *, index: Array | None = None, **_: object
) -> tuple[Array, Array]:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv 2505.23585).

    b = Σ_j |y_j| R_j / Σ_j |y_j| over the group (length-weighted mean), Â_i = R_i − b; singleton b = 0.
    """
    _require("opo", index=index)
    _check_shapes("opo", token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards)
    lengths = jnp.sum(response_mask.astype(scores.dtype), axis=-1)
    gid = group_ids(index)
    baseline = jnp.where(group_count(gid) > 1, group_mean(scores, gid, weights=lengths), 0.0)
    adv = (scores - baseline)[:, None] * response_mask.astype(scores.dtype)
    return adv, adv


@register_adv_estimator("reinforce_plus_plus")
def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: Array, response_mask: Array, *, gamma: float = 1.0, **_: object
) -> tuple[Array, Array]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): discounted return G_t = r_t + γ G_{t+1} (reset at masked
    positions), advantages = batch-whitened G over valid tokens."""
    _check_shapes("reinforce_plus_plus", token_level_rewards, response_mask)
    mask = response_mask.astype(token_level_rewards.dtype)

    def step(running, xs):
        r_t, m_t = xs
        running = r_t + gamma * running
        return running * m_t, running

    zeros = jnp.zeros(token_level_rewards.shape[0], token_level_rewards.dtype)
    _, ret_rev = jax.lax.scan(step, zeros, (token_level_rewards.T, mask.T), reverse=True)
    returns = ret_rev.T
    advantages = masked_whiten(returns, mask) * mask
    return advantages, returns


@register_adv_estimator("reinforce_plus_plus_baseline", needs=("index",))
def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: Array, response_mask: Array, *, index: Array | None = None, **_: object
) -> tuple[Array, Array]:
    """REINFORCE++-baseline (arXiv 2501.03262 §3): subtract the group mean score (0 for a singleton), broadcast
    to tokens, then whiten over all valid tokens of the batch."""
    _require("reinforce_plus_plus_baseline", index=index)
    _check_shapes("reinforce_plus_plus_baseline", token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards)
    gid = group_ids(index)
    mean = jnp.where(group_count(gid) > 1, group_mean(scores, gid), 0.0)
    mask = response_mask.astype(scores.dtype)
    adv = (scores - mean)[:, None] * mask
    adv = masked_whiten(adv, mask) * mask
    return adv, adv


@register_adv_estimator("remax", needs=("reward_baselines",))
def compute_remax_outcome_advantage(
    token_level_rewards: Array, response_mask: Array, *, reward_baselines: Array | None = None, **_: object
) -> tuple[Array, Array]:
    """ReMax (Li et al. 2023, arXiv 2310.10505): G_t = Σ_{s≥t} r_s (undiscounted, masked), Â_t = G_t − b with b
    the reward of the greedy response to the same prompt (``reward_baselines: [B]``)."""
    _require("remax", reward_baselines=reward_baselines)
    _check_shapes("remax", token_level_rewards, response_mask)
    mask = response_mask.astype(token_level_rewards.dtype)
    returns = jnp.flip(jnp.cumsum(jnp.flip(token_level_rewards * mask, -1), -1), -1)
    advantages = returns - reward_baselines.astype(returns.dtype)[:, None] * mask
    return advantages, returns


@register_adv_estimator("gpg", needs=("index",))
def compute_gpg_outcome_advantage(
    token_level_rewards: Array,
    response_mask: Array,
    *,
    index: Array | None = None,
    f_norm: float = 1.0,
    **_: object,
) -> tuple[Array, Array]:
    """Group Policy Gradient (Chu et al. 2025, arXiv 2504.02546, eq.7): Â_i = α (R_i − mean(R_group)) / F_norm
    with α = B / max(#{R ≠ 0}, 1) correcting for groups that carry no signal; singleton mean 0."""
    _require("gpg", index=index)
    _check_shapes("gpg", token_level_rewards, response_mask, index)
    scores = _outcome_scores(token_level_rewards)
    gid = group_ids(index)
    alpha = scores.shape[0] / jnp.maximum(jnp.count_nonzero(scores), 1).astype(scores.dtype)
    mean = jnp.where(group_count(gid) > 1, group_mean(scores, gid), 0.0)
    adv = (alpha * (scores - mean) / f_norm)[:, None] * response_mask.astype(scores.dtype)
    return adv, adv
