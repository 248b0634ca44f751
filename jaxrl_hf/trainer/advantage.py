"""Reward shaping and advantage estimation on a ``Batch`` (the driver's ``compute_advantage`` stage).

Pure in effect: each function returns new columns; the math is ``jaxrl_hf.algos`` (verl-parity tested).

* ``kl_in_reward``: r_t = score_t − β·KL(π_old‖π_ref)_t (InstructGPT; HybridFlow PPO), β from the fixed or
  adaptive controller (Ziegler et al. 2019), which is updated with the batch KL.
* ``compute_advantage``: the configured estimator (GAE eq.2–3, GRPO eq.4–6, RLOO, REINFORCE++, ReMax ...), called
  with the inputs its registration declares (``needs=``), so a user-registered estimator runs the same way.
* ``safe_rlhf_advantage``: Safe-RLHF's Lagrangian combination A = (A_r − λ·A_c) / (1 + λ).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl_hf.algos import (adv_estimator_needs, adv_estimator_options, apply_kl_penalty, get_adv_estimator,
                            init_kl_controller, update_kl_controller)
from jaxrl_hf.algos.advantages import adv_estimator_optional_inputs
from jaxrl_hf.algos.declarations import keyword_parameters
from jaxrl_hf.user_modules import call_registered
from jaxrl_hf.config.schema import AlgorithmConfig, KLControlConfig
from jaxrl_hf.controller import Batch


@dataclasses.dataclass
class KLController:
    """The KL coefficient β of KL-in-reward, JSON-checkpointable (value stored as a Python float)."""

    value: float
    kind: str
    target_kl: float
    horizon: float

    @classmethod
    def from_config(cls, cfg: KLControlConfig) -> "KLController":
        return cls(float(np.float32(cfg.kl_coef)), cfg.type, cfg.target_kl, cfg.horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon) (adaptive); fixed: unchanged."""
        state = init_kl_controller(self.value, kind=self.kind, target_kl=self.target_kl, horizon=self.horizon)
        self.value = float(update_kl_controller(state, current_kl, n_steps).value)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key in ("value", "kind", "target_kl", "horizon"):
            setattr(self, key, state[key])


def kl_in_reward(batch: Batch, kl_ctrl: KLController, kl_penalty: str) -> tuple[Batch, dict[str, float]]:
    """``token_level_rewards`` = scores − β·KL on valid tokens; updates the controller with the batch KL."""
    mask = batch["response_mask"]
    rewards, current_kl = apply_kl_penalty(
        jnp.asarray(batch["token_level_scores"]), jnp.asarray(batch["old_log_probs"]),
        jnp.asarray(batch["ref_log_prob"]), jnp.asarray(mask), kl_ctrl.value, kl_penalty,
    )
    metrics = {"actor/reward_kl_penalty": float(current_kl), "actor/reward_kl_penalty_coeff": kl_ctrl.value}
    kl_ctrl.update(float(current_kl), n_steps=len(batch))
    return Batch.from_dict({"token_level_rewards": np.asarray(rewards, np.float32)}), metrics


#: Batch column each estimator input is read from, where it is not the input's own name (``values``: the
#: ``values_key`` column; ``index``: the dense renumbering of ``uid``).
INPUT_COLUMNS = {"index": "uid"}


def estimator_inputs(batch: Batch, name: str, values_key: str = "values") -> dict[str, Any]:
    """The inputs estimator ``name`` needs (declared with ``needs=`` or named without a default in its signature),
    read from ``batch``, and those its signature names with a default that the batch has; a missing needed column
    raises naming the estimator and the column."""
    inputs: dict[str, Any] = {}
    optional = adv_estimator_optional_inputs(name)
    for need in adv_estimator_needs(name) + optional:
        column = values_key if need == "values" else INPUT_COLUMNS.get(need, need)
        if column not in batch and need in optional:
            continue
        if column not in batch:
            raise ValueError(f"advantage estimator {name!r} needs batch column {column!r} (its `{need}` input); "
                             f"the batch has {sorted(batch.keys())}")
        value = batch[column]
        if need == "index":
            inputs[need] = jnp.asarray(dense_uid(np.asarray(value)))
        elif isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
            inputs[need] = jnp.asarray(value, jnp.float32 if value.dtype.kind == "f" else value.dtype)
        else:
            inputs[need] = value
    return inputs


def compute_advantage(batch: Batch, cfg: AlgorithmConfig, rewards_key: str = "token_level_rewards",
                      values_key: str = "values") -> Batch:
    """``advantages``/``returns`` [B, R] from ``batch[rewards_key]`` with ``cfg.adv_estimator``.

    The estimator gets what it declared (`estimator_inputs`: group estimators ``uid`` as the group index, GAE
    ``batch[values_key]``, ReMax ``reward_baselines``) and the ``algorithm`` values its signature names.
    """
    estimator = get_adv_estimator(cfg.adv_estimator)
    mask = jnp.asarray(batch["response_mask"], jnp.float32)
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    scalars = {k: v for k, v in fields.items() if not dataclasses.is_dataclass(v)}  # not kl_ctrl, filter_groups ...
    options = adv_estimator_options(cfg.adv_estimator, scalars)
    if "config" in keyword_parameters(estimator):  # as verl passes its algorithm config
        options["config"] = cfg
    inputs = estimator_inputs(batch, cfg.adv_estimator, values_key)
    adv, ret = call_registered("advantage estimator", cfg.adv_estimator, estimator,
                               jnp.asarray(batch[rewards_key], jnp.float32), mask, **inputs, **options)
    return Batch.from_dict({"advantages": np.asarray(adv, np.float32), "returns": np.asarray(ret, np.float32)})


def dense_uid(uid: np.ndarray) -> np.ndarray:
    """Group ids renumbered 0..G-1 in order of first appearance (stable across batches of equal layout)."""
    _, first, inverse = np.unique(uid, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))
    return order[inverse].astype(np.int32)


def safe_rlhf_advantage(reward_adv: np.ndarray, cost_adv: np.ndarray, lagrange: float) -> np.ndarray:
    """Safe-RLHF (Dai et al. 2023, eq.10 with the 1/(1+λ) rescaling): A = (A_r − λ·A_c) / (1 + λ)."""
    return ((reward_adv - lagrange * cost_adv) / (1.0 + lagrange)).astype(np.float32)


def update_lagrange(lagrange: float, mean_cost: float, cost_limit: float, lr: float, lambda_max: float) -> float:
    """Projected gradient ascent on λ for the constraint E[cost] ≤ limit: λ ← clip(λ + lr·(J_c − d), 0, λ_max)."""
    return float(min(max(lagrange + lr * (mean_cost - cost_limit), 0.0), lambda_max))


__all__ = ["KLController", "compute_advantage", "dense_uid", "estimator_inputs", "kl_in_reward",
           "safe_rlhf_advantage", "update_lagrange"]
