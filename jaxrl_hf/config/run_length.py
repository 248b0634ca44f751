"""The run length: ``trainer.total_steps``, or verl's ``trainer.total_epochs`` × steps per epoch.

verl computes ``total_training_steps = len(train_dataloader) × total_epochs`` unless
``trainer.total_training_steps`` is given; its dataloader drops a short last batch. Here the same rule, once the
training rows are known (after overlong prompts are filtered): `with_run_length` at the start of a run. Before
that (``--dry-run``, which reads no data) `run_length_note` says how it will be computed.
"""

from __future__ import annotations

import dataclasses

from jaxrl_hf.config.build import ConfigError
from jaxrl_hf.config.resolve import optim_with_schedule
from jaxrl_hf.config.schema import RunConfig


def rows_per_step(config: RunConfig) -> int:
    """Prompts the loader hands out per generation round: ``data.gen_batch_size`` under DAPO's dynamic sampling
    (verl's dataloader batch there), else ``data.train_batch_size``."""
    if config.algo == "dapo" and config.algorithm.filter_groups.enable:
        return config.data.gen_batch_size or config.data.train_batch_size
    return config.data.train_batch_size


def steps_per_epoch(config: RunConfig, train_rows: int) -> int:
    """Full batches in one pass over ``train_rows`` rows (``rows // rows_per_step``, a short last batch dropped)."""
    return train_rows // rows_per_step(config)


def with_run_length(config: RunConfig, train_rows: int) -> RunConfig:
    """``config`` with ``trainer.total_steps`` decided (an explicit value is kept, as verl's
    ``total_training_steps``; else ``total_epochs × steps_per_epoch``) and the actor's and critic's lr schedules
    that follow it (``optim.total_steps`` and the warm-up ratio, unless set explicitly)."""
    trainer = config.trainer
    if trainer.total_steps is not None:
        return config
    per_epoch = steps_per_epoch(config, train_rows)
    if per_epoch < 1:
        raise ConfigError(f"config key 'trainer.total_epochs'={trainer.total_epochs}: an epoch of {train_rows} "
                          f"training rows (after filtering) has no full batch of {rows_per_step(config)} rows "
                          "(data.train_batch_size); set trainer.total_steps or use more data")
    return with_total_steps(config, int(trainer.total_epochs) * per_epoch)


def with_total_steps(config: RunConfig, total: int) -> RunConfig:
    """``config`` with ``trainer.total_steps = total`` and the lr schedules that follow it. Also what a tool
    that reads no data (``launch/plan_memory.py``: optimizer state does not depend on the run length) assumes."""
    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, total_steps=total))
    config.actor = dataclasses.replace(config.actor, optim=optim_with_schedule(config.actor.optim, total))
    config.critic = dataclasses.replace(config.critic, optim=optim_with_schedule(config.critic.optim, total))
    return config


def run_length_note(config: RunConfig) -> str:
    """How long the run is, for the dry run: the step count, or the epoch rule still to be computed."""
    t = config.trainer
    if t.total_steps is not None:
        given = " (trainer.total_epochs is not used: trainer.total_steps wins, as in verl)" if t.total_epochs else ""
        return f"total_steps = {t.total_steps}{given}"
    return (f"total_steps = total_epochs × steps per epoch, computed at start ({t.total_epochs} × (training rows "
            f"after filtering // {rows_per_step(config)}))")
