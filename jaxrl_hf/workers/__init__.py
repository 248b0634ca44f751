"""The paper's model classes as controller workers (HybridFlow §2.4), and the pure training step.

* `ActorRolloutRefWorker` — actor updates, rollout with the native JAX engine, frozen reference policy.
* `CriticWorker` — value model: ``compute_values``, ``update_critic``.
* `RewardModelWorker` / `CostModelWorker` — value-head scorers: ``compute_rm_score``.
* `train_step` — jitted micro-batch accumulation with exact global denominators + AdamW (`optim`).
* `checkpoint` — atomic orbax save/restore.

Importing this package has no side effects beyond importing JAX (no devices are touched).
"""

from jaxrl_hf.workers.actor import ActorRolloutRefWorker
from jaxrl_hf.workers.critic import CriticWorker
from jaxrl_hf.workers.losses import (ActorLossConfig, CriticLossConfig, actor_loss, actor_loss_config, critic_loss,
                                     critic_loss_config)
from jaxrl_hf.workers.optim import learning_rate, make_optimizer
from jaxrl_hf.workers.reward_model import CostModelWorker, RewardModelWorker
from jaxrl_hf.workers.train_step import TrainState, init_train_state, make_train_step

__all__ = ["ActorRolloutRefWorker", "CriticWorker", "RewardModelWorker", "CostModelWorker", "ActorLossConfig",
           "CriticLossConfig", "actor_loss", "actor_loss_config", "critic_loss", "critic_loss_config",
           "learning_rate", "make_optimizer",
           "TrainState", "init_train_state", "make_train_step"]
