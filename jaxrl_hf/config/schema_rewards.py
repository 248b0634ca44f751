"""The reward sections of the run configuration (verl's names): ``reward_model`` (the rule-based reward manager
plus an optional learned reward model), ``cost_model`` (Safe-RLHF) and ``custom_reward_function``.

Part of the schema in ``jaxrl_hf.config.schema`` (which composes ``RunConfig`` from them); kept apart only to
keep each file small. Import them from either module: it is one class each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment (eq.13): ``len`` = L_cache tokens before ``max_response_length``."""

    enable: bool = False
    len: int = 16
    penalty_factor: float = 1.0
    log: bool = True


@dataclass
class ScoringModelConfig:
    """A learned value-head scorer of finished sequences (``RewardModelWorker`` / ``CostModelWorker``); ``seed``
    initialises a ``tiny-random`` one, ``micro_batch_size_per_device`` rows go through each scoring pass."""

    enable: bool = False
    path: Optional[str] = None
    """Reward/cost-model directory (``launch/train_rm.py`` output, or a transformers ``Llama``/``Qwen2``
    ``ForSequenceClassification`` with ``num_labels=1``) or ``tiny-random`` (shape: ``model.tiny``)."""
    seed: int = 0
    micro_batch_size_per_device: int = 8
    dtype: Optional[Literal["float32", "bfloat16"]] = None
    """Default: ``model.dtype``."""


@dataclass
class PRMConfig:
    """The process reward model of ``reward_model.reward_manager=prm`` (`jaxrl_hf.rewards.prm_manager`)."""

    path: Optional[str] = None
    """PRM directory written by ``launch/train_prm.py``."""
    aggregation: Literal["min", "last", "per_step"] = "min"
    """How per-step probabilities become the reward: the worst step (``min``) or the last step (``last``) on the
    last response token, or each step's score on the response token that ends the step (``per_step``: for
    token-level estimators such as ``gae``/``reinforce_plus_plus``; single-turn rollouts only)."""
    weight: float = 1.0
    """Multiplier of the PRM score(s) added to the rule score."""


@dataclass
class RewardModelConfig(ScoringModelConfig):
    """Rule-based reward manager (always) plus an optional learned reward model (``enable``)."""

    reward_manager: Literal["naive", "dapo", "prm"] = "naive"
    scorer: Literal["auto", "math_verify"] = "auto"
    """The rule scorer (unless ``custom_reward_function.path`` is set): ``auto`` picks it by ``data_source``
    (verl's ``default_compute_score``); ``math_verify``: Hugging Face's Math-Verify for every row (sympy
    equivalence; ``pip install 'jaxrl_hf[math]'``), bounded by ``timeout_s`` like every scorer."""
    prm: PRMConfig = field(default_factory=PRMConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    num_workers: int = 0
    """Processes scoring responses on the driver (0 = in the driver process)."""
    timeout_s: float = 10.0
    num_examine: int = 0
    """Print this many scored responses per data source for each scored batch (response, ground truth, score)."""
    rule_weight: float = 1.0
    """Weight of the rule score when a reward model is enabled too (0 = reward model only)."""


@dataclass
class CostModelConfig(ScoringModelConfig):
    """Safe-RLHF cost model (a value-head model scoring harmfulness; higher = worse)."""


@dataclass
class CustomRewardFunctionConfig:
    """A user scoring function ``fn(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)``."""

    path: Optional[str] = None
    name: str = "compute_score"
    reward_kwargs: dict[str, Any] = field(default_factory=dict)
