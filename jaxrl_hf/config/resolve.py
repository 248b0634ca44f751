"""Fill the defaults that depend on other keys (``rollout.response_length`` <- ``data.max_response_length`` ...)."""

from __future__ import annotations

import dataclasses

from jaxrl_hf.config.cluster import resolve_cluster
from jaxrl_hf.config.schema import ModelConfig, OptimConfig, RunConfig
from jaxrl_hf.config.schema_trainer import DEFAULT_TOTAL_STEPS


def critic_enabled(config: RunConfig) -> bool:
    """Whether the run has a critic: ``critic.enable`` if set, else exactly when the estimator needs ``values``
    (GAE; an unknown estimator name is left to validation)."""
    from jaxrl_hf.algos.advantages import ADV_ESTIMATORS, adv_estimator_needs

    if config.critic.enable is not None:
        return config.critic.enable
    name = config.algorithm.adv_estimator
    return name in ADV_ESTIMATORS and "values" in adv_estimator_needs(name)


def model_with_remat(model: ModelConfig) -> ModelConfig:
    """verl's ``enable_gradient_checkpointing=true`` is ``remat=full`` unless ``remat`` already names a policy."""
    if model.enable_gradient_checkpointing and model.remat == "none":
        return dataclasses.replace(model, remat="full")
    return model


def optim_with_schedule(optim: OptimConfig, total_steps: int | None) -> OptimConfig:
    """``total_steps`` (default: the run's) and verl's warm-up ratio: ``warmup_steps = int(ratio · total_steps)``
    when ``warmup_steps`` is 0 (verl's ``lr_warmup_steps < 0``: the ratio decides). A run length still unknown
    (``trainer.total_epochs``: counted when the data is read, `jaxrl_hf.config.run_length`) leaves both as they are."""
    total = optim.total_steps or total_steps
    if total is None:
        return optim
    warmup = optim.warmup_steps or int(optim.lr_warmup_steps_ratio * total)
    return dataclasses.replace(optim, total_steps=total, warmup_steps=warmup)


def _first_set(value: object, default: object) -> object:
    """``value`` unless unset (``None``: ``default``). Not ``or``: a 0 or ``False`` must reach validation."""
    return default if value is None else value


def resolve_defaults(config: RunConfig) -> RunConfig:
    """A copy of ``config`` with every ``None``-means-derived field filled in."""
    config = resolve_cluster(config)  # a shallow copy: sections below are replaced, never mutated
    if config.trainer.total_steps is None and config.trainer.total_epochs is None:
        config.trainer = dataclasses.replace(config.trainer, total_steps=DEFAULT_TOTAL_STEPS)
    data, trainer = config.data, config.trainer
    config.rollout = dataclasses.replace(
        config.rollout,
        max_prompt_length=config.rollout.max_prompt_length or data.max_prompt_length,
        response_length=config.rollout.response_length or data.max_response_length,
    )
    if config.rollout.multi_turn.enable and config.rollout.loop in ("single_turn", "single_turn_agent"):
        config.rollout = dataclasses.replace(config.rollout, loop="multi_turn")  # verl: multi_turn.enable selects it
    config.rollout.val = dataclasses.replace(
        config.rollout.val, response_length=config.rollout.val.response_length or config.rollout.response_length)
    config.data = dataclasses.replace(data, gen_batch_size=data.gen_batch_size or data.train_batch_size,
                                      val_max_prompt_length=data.val_max_prompt_length or data.max_prompt_length)
    config.actor = dataclasses.replace(config.actor, optim=optim_with_schedule(config.actor.optim, trainer.total_steps))
    config.actor = dataclasses.replace(
        config.actor,
        log_prob_micro_batch_size_per_device=config.actor.log_prob_micro_batch_size_per_device
        or config.actor.ppo_micro_batch_size_per_device,
    )
    if trainer.max_staleness > 0:  # asynchronous: a rollout group of its own, TIS against the stale sampler
        config.placement = dataclasses.replace(
            config.placement, rollout=dataclasses.replace(config.placement.rollout, colocate=False))
        if config.actor.rollout_correction.level is None:
            config.actor = dataclasses.replace(config.actor, rollout_correction=dataclasses.replace(
                config.actor.rollout_correction, level="token"))
    actor = config.actor
    for section in ("rollout", "ref"):  # verl: the log-prob passes follow the actor's dynamic batch size
        value = getattr(config, section)
        setattr(config, section, dataclasses.replace(
            value, log_prob_use_dynamic_bsz=_first_set(value.log_prob_use_dynamic_bsz, actor.use_dynamic_bsz),
            log_prob_max_token_len_per_gpu=value.log_prob_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu))
    critic_budget = config.critic.ppo_max_token_len_per_gpu or actor.ppo_max_token_len_per_gpu
    config.critic = dataclasses.replace(
        config.critic,
        enable=critic_enabled(config),
        use_dynamic_bsz=_first_set(config.critic.use_dynamic_bsz, actor.use_dynamic_bsz),
        ppo_max_token_len_per_gpu=critic_budget,
        forward_max_token_len_per_gpu=config.critic.forward_max_token_len_per_gpu or critic_budget,
        ppo_mini_batch_size=config.critic.ppo_mini_batch_size or actor.ppo_mini_batch_size,
        ppo_micro_batch_size_per_device=config.critic.ppo_micro_batch_size_per_device or actor.ppo_micro_batch_size_per_device,
        ppo_epochs=config.critic.ppo_epochs or actor.ppo_epochs,
        ulysses_sequence_parallel_size=_first_set(config.critic.ulysses_sequence_parallel_size,
                                                 actor.ulysses_sequence_parallel_size),
        optim=optim_with_schedule(config.critic.optim, trainer.total_steps),
    )
    config.ref = dataclasses.replace(config.ref, ulysses_sequence_parallel_size=_first_set(
        config.ref.ulysses_sequence_parallel_size, actor.ulysses_sequence_parallel_size))
    config.model = model_with_remat(config.model)
    if config.critic.model is not None:
        config.critic = dataclasses.replace(config.critic, model=model_with_remat(config.critic.model))
    name = trainer.experiment_name or config.algo
    config.trainer = dataclasses.replace(
        trainer, experiment_name=name, run_dir=trainer.run_dir or f"runs/{name}"
    )
    return config
