"""The RL trainer: per-algorithm control flows over worker groups, metrics, logging, checkpoints.

``run(algo, preset=None, overrides=())`` is the entry point behind ``python launch/train.py``;
``RLTrainer(config).fit()`` runs a loaded ``RunConfig``; ``ALGORITHMS`` maps ``--algo`` to its step function.
"""

from jaxrl_hf.trainer.algorithms import ALGORITHMS
from jaxrl_hf.trainer.run import RLTrainer, run

__all__ = ["ALGORITHMS", "RLTrainer", "run"]
