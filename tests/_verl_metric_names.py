"""The metric names verl 0.9.1's PPO trainer logs for a run, built from verl's own code (the released wheel):

* ``compute_data_metrics`` / ``compute_timing_metrics`` / ``compute_throughout_metrics`` (``verl.trainer.ppo.
  metric_utils``), called on a ``DataProto`` shaped like a step's batch, with the stages verl's ``fit`` times
  (read from ``ray_trainer.py``'s ``marked_timer("...")`` calls) that a run of the given kind goes through;
* the actor update's names: the policy loss's own metrics (``compute_policy_loss_vanilla`` called on tensors), the
  names ``ppo_loss`` and the engine worker's ``update_actor`` write (read from their source), prefixed as the trainer
  prefixes them (verl's ``rename_dict``); the critic's from ``value_loss``'s source; the trainer's own
  (``training/*``, ``actor/entropy``, ``actor/reward_kl_penalty*``) from ``ray_trainer.py``.

Left out, with the reason: the device allocator's ``<role>/perf/max_memory_*`` where the backend keeps no such
counters (XLA:CPU's ``memory_stats()`` is None) and the profiler / dump stages (``start_profile``,
``stop_profile``, ``dump_rollout_generations``: timed only when those features are on).
"""

from __future__ import annotations

import importlib.util
import inspect
import re

NOT_TIMED = {"start_profile", "stop_profile", "dump_rollout_generations"}
DEVICE_ALLOCATOR = re.compile(r"perf/max_memory_\w+$")


def _literal_keys(source: str, target: str) -> set[str]:
    """The string keys ``source`` assigns as ``target["key"] = ...``."""
    return set(re.findall(rf'{target}\["([\w/]+)"\]\s*=', source))


def _source(module: str) -> str:
    """A verl module's source text, read without importing it (some import packages verl does not declare)."""
    spec = importlib.util.find_spec(module)
    with open(spec.origin, encoding="utf-8") as fh:
        return fh.read()


def _data_proto(batch: int = 4, prompt: int = 5, response: int = 6):
    import numpy as np
    import torch
    from verl import DataProto

    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([response, 3, 0, 1][:batch])  # one aborted (empty) response
    response_mask = (torch.arange(response)[None, :] < lengths[:, None]).float()
    prompt_mask = torch.ones(batch, prompt)
    tensors = {
        "prompts": torch.ones(batch, prompt, dtype=torch.long), "responses": torch.ones(batch, response, dtype=torch.long),
        "attention_mask": torch.cat([prompt_mask, response_mask], 1), "response_mask": response_mask,
        **{k: torch.randn(batch, response, generator=gen) for k in
           ("token_level_scores", "token_level_rewards", "advantages", "returns", "values")},
    }
    data = DataProto.from_single_dict(tensors)
    data.meta_info["global_token_num"] = (prompt + lengths).tolist()
    data.non_tensor_batch["uid"] = np.arange(batch, dtype=object)
    return data


def verl_metric_names(*, use_critic: bool, use_kl_loss: bool, kl_in_reward: bool, saves: bool, validates: bool,
                      separate_old_log_prob: bool = True) -> set[str]:
    """The names verl 0.9.1's ``RayPPOTrainer.fit`` logs over a run with these features (module docstring)."""
    import torch
    from verl.trainer.ppo import core_algos, metric_utils
    from verl.trainer.ppo.utils import Role
    from verl.utils.py_functional import rename_dict
    from verl.workers.config import ActorConfig
    from verl.workers.utils import losses

    data = _data_proto()
    names = set(metric_utils.compute_data_metrics(data, use_critic=use_critic))
    trainer_source = _source("verl.trainer.ppo.ray_trainer")
    stages = set(re.findall(r'marked_timer\("(\w+)"', trainer_source)) - NOT_TIMED
    stages.add(str(Role.RefPolicy) if hasattr(Role.RefPolicy, "value") else "ref")
    skip = set()
    if not use_critic:
        skip |= {"values", "update_critic"}
    if not (use_kl_loss or kl_in_reward):
        skip.add(str(Role.RefPolicy))
    if not saves:
        skip.add("save_checkpoint")
    if not validates:
        skip.add("testing")
    if not separate_old_log_prob:
        skip.add("old_log_prob")
    timing_raw = {stage: 1.0 for stage in stages - skip}
    names |= set(metric_utils.compute_timing_metrics(data, timing_raw))
    names |= set(metric_utils.compute_throughout_metrics(data, timing_raw, n_gpus=1))

    # the actor's update: the policy loss's own metrics, ppo_loss's and the engine worker's, as the trainer renames them
    log_prob = torch.randn(2, 3)
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    _, pg_metrics = core_algos.compute_policy_loss_vanilla(
        old_log_prob=log_prob, log_prob=log_prob + 0.1, advantages=torch.randn(2, 3),
        response_mask=torch.ones(2, 3), loss_agg_mode="token-mean", config=config)
    actor = set(pg_metrics) | _literal_keys(inspect.getsource(losses.ppo_loss), "metrics")
    actor |= _literal_keys(_source("verl.workers.engine_workers"), "final_metrics")
    if not use_kl_loss:
        actor -= {"kl_loss", "kl_coef"}
    actor -= {"actor/entropy_loss"}  # computed only with actor.entropy_coeff != 0 (or calculate_entropy)
    renamed = rename_dict({k: 0.0 for k in actor}, "actor/")
    renamed["perf/mfu/actor"] = renamed.pop("actor/mfu")  # as RayPPOTrainer._update_actor renames it
    names |= set(renamed)
    if use_critic:
        critic = set(re.findall(r'"(critic/\w+)":', inspect.getsource(losses.value_loss)))
        critic |= set(rename_dict({k: 0.0 for k in _literal_keys(_source("verl.workers.engine_workers"), "final_metrics")
                                   if k != "mfu"}, "critic/"))
        names |= critic | {"perf/mfu/critic"}
    names |= {"training/global_step", "training/epoch", "actor/entropy"}
    if kl_in_reward:
        names |= {"actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff"}
    import jax

    counters = jax.local_devices()[0].memory_stats() is not None
    return {n for n in names if counters or not DEVICE_ALLOCATOR.search(n)}
