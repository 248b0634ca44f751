"""Typed role configs: the workers run on the schema's dataclasses, every default lives in the schema, and
each config concept has exactly one class.

Workers are built in this process (``Worker._instantiate``, no Ray) on a tiny random model; the trainer's
path (``RoleBuilder`` handing the ``RunConfig`` to Ray worker groups) runs in test_trainer_e2e.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

import jax
import pytest

import jaxrl_hf
from jaxrl_hf.config import load_config
from jaxrl_hf.config.schema import (ActorConfig, CostModelConfig, CriticConfig, OptimConfig, OverlongBufferConfig,
                                    RewardModelConfig, RunConfig, TinyModelConfig)
from jaxrl_hf.controller.worker import WorkerContext
from jaxrl_hf.workers import ActorRolloutRefWorker, CostModelWorker, CriticWorker, RewardModelWorker
from jaxrl_hf.workers.common import WorkerConfigError, tiny_decoder_config, worker_run_config
from jaxrl_hf.workers.losses import ActorLossConfig, CriticLossConfig, actor_loss_config, critic_loss_config

TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_layers": 1, "num_heads": 4,
        "num_kv_heads": 2, "max_position_embeddings": 64}


def mapping(**sections) -> dict:
    """A plain nested config for a tiny random model on all of this process's devices."""
    config = {"model": {"path": "tiny-random", "tiny": dict(TINY)},
              "rollout": {"n": 2, "response_length": 4},
              "placement": {"devices_per_process": jax.device_count(), "train": {"dp": jax.device_count()}}}
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    return config


def instantiate(cls, *args):
    return cls._instantiate(WorkerContext("test", "local", 0, 1), args, {})


# ---------------------------------------------------------------------------------------- typed sections
def test_workers_hold_the_schema_dataclasses():
    config = load_config("grpo", preset="smoke", overrides=[
        f"placement.devices_per_process={jax.device_count()}", f"placement.train.dp={jax.device_count()}",
        "data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "critic.enable=true"])
    assert worker_run_config(config) == config  # a resolved RunConfig passes through unchanged
    actor = instantiate(ActorRolloutRefWorker, config, "actor_rollout")
    critic = instantiate(CriticWorker, config)
    assert isinstance(actor.config, RunConfig) and actor.config == config
    assert isinstance(actor.config.actor, ActorConfig) and isinstance(actor.config.actor.optim, OptimConfig)
    assert isinstance(critic.critic_cfg, CriticConfig) and critic.critic_cfg == config.critic


def test_a_mapping_is_built_once_through_the_schema():
    config = load_config("grpo", preset="smoke")
    assert worker_run_config(config.to_dict()) == config  # the same config as the dataclass
    worker = instantiate(ActorRolloutRefWorker, mapping(actor={"clip_ratio": "0.3"}), "actor_rollout")
    assert worker.config.actor.clip_ratio == 0.3  # coerced by the builder
    # the derived defaults are filled as in load_config
    assert worker.config.actor.log_prob_micro_batch_size_per_device == worker.config.actor.ppo_micro_batch_size_per_device
    with pytest.raises(WorkerConfigError, match=r"'actor.clip_ratoi' — actor: unknown key\(s\) \['clip_ratoi'\]"):
        instantiate(ActorRolloutRefWorker, mapping(actor={"clip_ratoi": 0.3}), "actor_rollout")
    with pytest.raises(WorkerConfigError, match="config key 'rollout.n': expected an int"):
        instantiate(ActorRolloutRefWorker, mapping(rollout={"n": "two"}), "actor_rollout")


def test_scorer_sections_are_typed():
    config = mapping(reward_model={"path": "tiny-random", "seed": 3, "micro_batch_size_per_device": 4},
                     cost_model={"path": "tiny-random", "seed": 4, "dtype": "bfloat16"})
    reward, cost = instantiate(RewardModelWorker, config, "reward"), instantiate(CostModelWorker, config)
    assert isinstance(reward.section, RewardModelConfig) and isinstance(cost.section, CostModelConfig)
    assert (reward.section.seed, reward.section.micro_batch_size_per_device, cost.section.seed) == (3, 4, 4)
    assert reward.init_model()["vocab_size"] == TINY["vocab_size"]  # shape from model.tiny
    cost.init_model()
    assert cost.model_config.dtype == "bfloat16" and reward.model_config.dtype == "float32"  # default: model.dtype
    with pytest.raises(WorkerConfigError, match="reward_model.path is not set"):
        instantiate(RewardModelWorker, mapping(), "reward").init_model()


# ---------------------------------------------------------------------------------------- defaults once
def test_loss_configs_take_every_value_from_the_sections():
    for view in (ActorLossConfig, CriticLossConfig):
        assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                   for f in dataclasses.fields(view)), f"{view.__name__} declares defaults of its own"
    loss = actor_loss_config(ActorConfig(), temperature=0.7)
    actor = ActorConfig()
    assert (loss.clip_ratio, loss.kl_loss_coef, loss.clip_ratio_c, loss.loss_mode, loss.temperature) == (
        actor.clip_ratio, actor.kl_loss_coef, actor.clip_ratio_c, actor.policy_loss.loss_mode, 0.7)
    assert critic_loss_config(CriticConfig(cliprange_value=0.25)).cliprange_value == 0.25


def test_a_changed_actor_value_reaches_the_worker_loss_and_optimizer():
    config = mapping(actor={"clip_ratio": 0.3, "kl_loss_coef": 0.05, "optim": {"lr": 3e-4}},
                     rollout={"temperature": 0.9})
    worker = instantiate(ActorRolloutRefWorker, config, "actor_rollout")
    worker.init_model()
    assert (worker.loss_cfg.clip_ratio, worker.loss_cfg.kl_loss_coef, worker.loss_cfg.temperature) == (0.3, 0.05, 0.9)
    assert worker.optim is worker.config.actor.optim and worker.optim.lr == 3e-4
    default = instantiate(ActorRolloutRefWorker, mapping(), "actor_rollout")
    default.init_model()
    assert default.loss_cfg == actor_loss_config(ActorConfig(), RunConfig().rollout.temperature)


def test_tiny_model_shape_is_one_dataclass():
    tiny = TinyModelConfig(vocab_size=96, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=32,
                           max_position_embeddings=128, pad_token_id=5, eos_token_id=7, bos_token_id=None,
                           tie_word_embeddings=True)
    decoder = tiny_decoder_config(tiny, "float32", "none")
    assert (decoder.vocab_size, decoder.head_dim, decoder.num_key_value_heads, decoder.max_position_embeddings) == (
        96, 32, 1, 128)
    assert (decoder.pad_token_id, decoder.eos_token_ids, decoder.bos_token_id, decoder.tie_word_embeddings) == (
        5, (7,), None, True)
    with pytest.raises(WorkerConfigError, match="model.tiny"):
        tiny_decoder_config(dataclasses.replace(tiny, num_kv_heads=3), "float32", "none")


# ---------------------------------------------------------------------------------------- one class per concept
def _config_classes() -> dict[str, list[str]]:
    """``{class name: [modules defining it]}`` of every dataclass named ``*Config`` in the package."""
    found: dict[str, list[str]] = {}
    for info in pkgutil.walk_packages(jaxrl_hf.__path__, "jaxrl_hf."):
        if info.name.startswith(("jaxrl_hf.mesh", "jaxrl_hf.placement")):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == info.name
                    and name.endswith("Config")):
                found.setdefault(name, []).append(info.name)
    return found


def test_one_class_per_config_concept():
    import jaxrl_hf.rewards as rewards
    import jaxrl_hf.workers.common as common
    import jaxrl_hf.workers.optim as optim

    duplicates = {name: where for name, where in _config_classes().items() if len(where) > 1}
    assert not duplicates, duplicates
    assert optim.OptimConfig is OptimConfig
    assert rewards.OverlongBufferConfig is OverlongBufferConfig
    assert rewards.DAPORewardManager(max_response_length=8, overlong_buffer=OverlongBufferConfig(
        enable=True, len=4)).overlong_buffer.len == 4
    assert not hasattr(common, "TINY_KEYS") and not hasattr(common, "get")
