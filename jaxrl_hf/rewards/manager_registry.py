"""Reward managers by name (``reward_model.reward_manager``): ``naive`` and ``dapo`` (`managers`), ``prm``
(`prm_manager`, which imports JAX: loaded when chosen, so that a run without it, and the scorer pool, stay light)."""

from __future__ import annotations

from typing import Any

from jaxrl_hf.rewards.managers import DAPORewardManager, NaiveRewardManager

REWARD_MANAGERS = ("naive", "dapo", "prm")


def make_reward_manager(name: str, **kwargs: Any) -> NaiveRewardManager:
    """The reward manager called ``name``, constructed with ``kwargs``; an unknown name lists the valid ones."""
    if name == "naive":
        return NaiveRewardManager(**kwargs)
    if name == "dapo":
        return DAPORewardManager(**kwargs)
    if name == "prm":
        from jaxrl_hf.rewards.prm_manager import PRMRewardManager

        return PRMRewardManager(**kwargs)
    raise ValueError(f"unknown reward manager {name!r}; valid names: {sorted(REWARD_MANAGERS)}")
