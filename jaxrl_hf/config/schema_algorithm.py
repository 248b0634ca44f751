"""The ``algorithm`` section: advantage estimator, KL control, dynamic sampling, Safe-RLHF."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: float = 10000.0


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: keep groups whose ``metric`` varies; refill up to ``max_num_gen_batches``."""

    enable: bool = False
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    """verl's per-sample columns: ``acc`` and ``score`` as the scoring function returned them (``score`` without
    the overlong penalty or reward-model score), ``seq_reward`` = Σ ``token_level_scores``, ``seq_final_reward``
    = Σ ``token_level_rewards`` (after the KL penalty with ``use_kl_in_reward``)."""
    max_num_gen_batches: int = 4
    """Generation rounds per step before giving up with an error (<= 0: unlimited)."""


@dataclass
class SafeRLHFConfig:
    """Safe-RLHF (Dai et al. 2023) Lagrangian: advantage = A_reward − λ·A_cost, λ ≥ 0 learned."""

    cost_limit: float = 0.0
    lambda_init: float = 1.0
    lambda_lr: float = 0.05
    lambda_max: float = 10.0


@dataclass
class AlgorithmConfig:
    """Advantage estimation and reward shaping (verl ``algorithm``)."""

    adv_estimator: str = "grpo"
    """A name in ``jaxrl_hf.algos.ADV_ESTIMATORS`` (``gae``, ``grpo``, ``rloo``, ... or an ``imports`` one)."""
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_filter: bool = False
    """DAPO's overlong filtering (§3.4): samples cut off by the length limit (no stop token) are masked out of
    the actor's loss, so a truncated answer is neither rewarded nor punished. Any algorithm; no verl key."""
    safe_rlhf: SafeRLHFConfig = field(default_factory=SafeRLHFConfig)

    def get(self, key: str, default: Any = None) -> Any:
        """``config.get(key, default)``, as on verl's algorithm config (what an estimator written for verl calls)."""
        return getattr(self, key, default)
