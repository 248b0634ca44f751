"""The run configuration as nested dataclasses, with verl's key names.

The field defaults ARE the embedded default run (``python launch/train.py --algo dapo`` with nothing else):
SmolLM2-135M-Instruct on synthetic arithmetic prompts with a GSM8K validation subset, sized for a small
CPU-only host. ``configs/<algo>.yaml`` and presets overlay it; command-line ``a.b=c`` overrides come last.

Sections (verl's names): ``data``, ``model`` (verl's ``actor_rollout_ref.model``), ``actor``, ``rollout``,
``ref``, ``critic``, ``reward_model``, ``cost_model``, ``custom_reward_function``, ``algorithm``,
``trainer``, ``placement``. verl nests actor/rollout/ref under ``actor_rollout_ref``; here they are top-level
sections (the contract with the workers), and ``actor_rollout_ref.X.key=v`` overrides are accepted as
aliases of ``X.key=v`` (see ``jaxrl_hf.config.loader``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from jaxrl_hf.config.schema_actor import (ActorConfig, CriticConfig, OptimConfig, PolicyLossConfig, RefConfig,
                                          RolloutCorrectionConfig, RouterReplayConfig)
from jaxrl_hf.config.schema_algorithm import AlgorithmConfig, FilterGroupsConfig, KLControlConfig, SafeRLHFConfig
from jaxrl_hf.config.schema_data import ArithmeticDataConfig, DataConfig
from jaxrl_hf.config.schema_memory import GpuMemoryConfig
from jaxrl_hf.config.schema_model import ModelConfig, TinyModelConfig
from jaxrl_hf.config.schema_placement import GenerateParallelSizes, ParallelSizes, PlacementConfig, PoolConfig
from jaxrl_hf.config.schema_rewards import (CostModelConfig, CustomRewardFunctionConfig, OverlongBufferConfig,
                                            RewardModelConfig, ScoringModelConfig)
from jaxrl_hf.config.schema_rollout import RolloutConfig, RolloutValConfig
from jaxrl_hf.config.schema_trainer import TrainerConfig

__all__ = [  # the sections live in schema_<topic>.py; this module is the one place to import them from
    "ActorConfig", "AlgorithmConfig", "ArithmeticDataConfig", "CostModelConfig", "CriticConfig",
    "CustomRewardFunctionConfig", "DataConfig", "FilterGroupsConfig", "GenerateParallelSizes", "GpuMemoryConfig",
    "KLControlConfig", "ModelConfig", "OptimConfig", "OverlongBufferConfig", "ParallelSizes", "PlacementConfig",
    "PolicyLossConfig", "PoolConfig", "RefConfig", "RewardModelConfig", "RolloutConfig", "RolloutCorrectionConfig",
    "RolloutValConfig", "RouterReplayConfig", "RunConfig", "SafeRLHFConfig", "ScoringModelConfig", "TinyModelConfig",
    "TrainerConfig", "ALGOS",
]


ALGOS: tuple[str, ...] = ("dapo", "grpo", "ppo", "remax", "rloo", "reinforce_pp", "gspo", "safe_rlhf")
"""The ``--algo`` names: each has ``configs/<algo>.yaml`` and a step in ``jaxrl_hf.trainer.ALGORITHMS`` (tested)."""


@dataclass
class RunConfig:
    """Everything a run needs; ``algo`` names the control flow in ``jaxrl_hf.trainer.algorithms``."""

    algo: Literal[ALGOS] = "dapo"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    imports: list[str] = field(default_factory=list)
    """Python files (``.py`` paths) or module names imported in the driver before the config is validated and in
    every worker process before its workers start, for what they register (``launch/train.py --import``)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (``config.yaml``, ``metrics.jsonl``); the workers receive the dataclass itself."""
        return dataclasses.asdict(self)
