"""Rewards: rule scorers, reward managers and the Bradley-Terry reward-model loss.

``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` dispatches on the data
source like verl's ``default_compute_score``; ``NaiveRewardManager`` / ``DAPORewardManager`` turn a batch
of responses into token-level scores, optionally on a process pool. Importing this package does not
import JAX (pool workers stay light); ``bt_loss`` imports it on first use.
"""

from jaxrl_hf.rewards.dispatch import (
    ScoreFnSpec,
    as_score_dict,
    compute_score,
    compute_score_details,
    default_compute_score,
    known_data_sources,
    load_custom_score_fn,
)
from jaxrl_hf.rewards.manager_registry import REWARD_MANAGERS, make_reward_manager
from jaxrl_hf.rewards.managers import DAPORewardManager, NaiveRewardManager, OverlongBufferConfig, RewardOutput
from jaxrl_hf.rewards.timeouts import ScoreTimeout, time_limit


def __getattr__(name: str):
    if name == "bt_loss":
        from jaxrl_hf.rewards.bradley_terry import bt_loss

        return bt_loss
    raise AttributeError(f"module 'jaxrl_hf.rewards' has no attribute {name!r}")


__all__ = [
    "REWARD_MANAGERS",
    "DAPORewardManager",
    "NaiveRewardManager",
    "OverlongBufferConfig",
    "RewardOutput",
    "ScoreFnSpec",
    "ScoreTimeout",
    "as_score_dict",
    "bt_loss",
    "compute_score",
    "compute_score_details",
    "default_compute_score",
    "known_data_sources",
    "load_custom_score_fn",
    "make_reward_manager",
    "time_limit",
]
