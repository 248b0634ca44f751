"""verl's ``trainer.total_epochs``: the run length is epochs × full batches of the training rows (after filtering)
unless ``trainer.total_steps`` (verl's ``total_training_steps``) is given; the lr schedules follow."""

from __future__ import annotations

import io

import pytest

from jaxrl_hf.config import ConfigError, load_config
from jaxrl_hf.config.dry_run import dry_run
from jaxrl_hf.config.schema_trainer import DEFAULT_TOTAL_STEPS
from jaxrl_hf.trainer.run import RLTrainer

EPOCHS = ["trainer.total_training_steps=null", "trainer.total_epochs=2",  # the preset's total_steps unset
          "actor.optim.lr_warmup_steps_ratio=0.25", "critic.optim.lr_warmup_steps_ratio=0.5"]


def started(config) -> RLTrainer:
    """A trainer that has read its data (what a run does first), no workers."""
    trainer = RLTrainer(config)
    trainer._setup_data()
    return trainer


def test_total_epochs_sets_the_run_length_from_the_training_rows():
    config = load_config("ppo", "smoke", EPOCHS)
    assert config.trainer.total_steps is None and config.actor.optim.total_steps is None  # unknown before the data
    trainer = started(config)
    per_epoch = len(trainer.loader)
    assert per_epoch == 64 // 4  # the smoke preset: 64 arithmetic rows (none filtered), batches of 4
    t, actor, critic = trainer.config.trainer, trainer.config.actor.optim, trainer.config.critic.optim
    assert t.total_steps == 2 * per_epoch
    assert (actor.total_steps, actor.warmup_steps) == (32, 8)  # int(0.25 · 32)
    assert (critic.total_steps, critic.warmup_steps) == (32, 16)


def test_filtered_rows_do_not_count():
    config = load_config("grpo", "smoke", [*EPOCHS, "data.max_prompt_length=52", "data.train_batch_size=2",
                                           "actor.ppo_mini_batch_size=2"])
    trainer = started(config)
    rows = len(trainer.loader.rows)
    assert rows < 64 and trainer.config.trainer.total_steps == 2 * (rows // 2)


def test_an_explicit_step_count_wins_over_total_epochs():
    config = load_config("grpo", "smoke", ["trainer.total_epochs=3"])  # the preset's total_steps: 2
    assert started(config).config.trainer.total_steps == 2
    config = load_config("grpo", "smoke", ["trainer.total_epochs=3", "trainer.total_training_steps=5"])
    trainer = started(config)
    assert trainer.config.trainer.total_steps == 5 and trainer.config.actor.optim.total_steps == 5


def test_neither_given_is_the_default_length():
    config = load_config("grpo", overrides=["model.path=tiny-random"])
    assert config.trainer.total_steps == config.actor.optim.total_steps == DEFAULT_TOTAL_STEPS


def test_the_dry_run_says_how_the_length_is_computed():
    out = io.StringIO()
    assert dry_run("grpo", "smoke", EPOCHS, out=out) == 0
    assert "# run length: total_steps = total_epochs × steps per epoch, computed at start" in out.getvalue()
    out = io.StringIO()
    assert dry_run("grpo", "smoke", ["trainer.total_epochs=3"], out=out) == 0
    assert "# run length: total_steps = 2 (trainer.total_epochs is not used" in out.getvalue()


def test_bad_epoch_counts_name_the_key():
    with pytest.raises(ConfigError, match="trainer.total_epochs"):
        load_config("grpo", "smoke", ["trainer.total_steps=null", "trainer.total_epochs=0"])
    config = load_config("grpo", "smoke", [*EPOCHS, "data.train_size=4", "data.max_prompt_length=52"])
    with pytest.raises(ConfigError, match=r"'trainer.total_epochs'=2: an epoch of [0-3] training rows"):
        started(config)
