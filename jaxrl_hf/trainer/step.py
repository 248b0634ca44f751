"""``StepContext``: the stages an algorithm's step is written in, each one worker-group call (or a driver
computation) timed under its verl stage name and merged into the step's ``Batch``.

The algorithms in ``jaxrl_hf.trainer.algorithms`` read as the paper's control flow; this module holds the
plumbing: seeds, meta_info, timing, metric collection, critic warm-up, KL in the reward, the lr schedule step
of each update call and overlong filtering.

A stage whose output column is already in the batch (``old_log_probs``, ``ref_log_prob``,
``token_level_rewards``: DAPO's dynamic sampling takes them per generation round when it filters on the final
rewards) keeps it rather than computing it again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.controller import Batch
from jaxrl_hf.trainer.balance import balance_permutation
from jaxrl_hf.trainer.advantage import KLController, compute_advantage, kl_in_reward
from jaxrl_hf.trainer.metrics import StageTimer
from jaxrl_hf.trainer.overlong_filter import overlong_filtered
from jaxrl_hf.trainer.scoring import RewardFunction
from jaxrl_hf.workers.optim import LR_SCHEDULE_STEP

UID_STRIDE_STEP = 1_000_000
UID_STRIDE_ROUND = 10_000


@dataclasses.dataclass
class Roles:
    """Worker groups of a run (``None`` where the algorithm has no such role)."""

    actor: Any
    """ActorRolloutRefWorker group: generate_sequences, compute_log_prob, compute_ref_log_prob, update_actor."""
    critic: Any = None
    cost_critic: Any = None
    reward_model: Any = None
    cost_model: Any = None
    rollout: Any = None
    """RolloutWorker group of a split placement (``placement.rollout.colocate=false``), else None."""
    actor_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The actor's ``init_model`` summary: parameter count, layers, attention width, peak FLOP/s (for MFU)."""
    critic_info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The critic's, likewise (for ``perf/mfu/critic``); empty without a critic."""


def generation_seed(base: int, step: int, round_: int) -> int:
    """Sampling seed of generation round ``round_`` of ``step``: a pure function, so a resumed run
    samples exactly what an uninterrupted run samples."""
    return int((base * 1_000_003 + step * 7919 + round_ * 104_729 + 17) % (2**31 - 1))


def seeded_prompts(prompts: Batch, rollout_seed: int, step: int, round_: int, **sampling: Any) -> Batch:
    """``prompts`` with the meta_info of generation round ``round_`` of ``step``: its seed (`generation_seed`),
    the step, and any sampling overrides."""
    return Batch(prompts.arrays, prompts.objects, {**prompts.meta_info, "global_step": step,
                                                   "seed": generation_seed(rollout_seed, step, round_), **sampling})


def merge_metrics(into: dict[str, float], result: Any) -> None:
    """Add a worker result's ``meta_info['metrics']`` (a dict, or per-rank dicts averaged)."""
    metrics = getattr(result, "meta_info", {}).get("metrics") if result is not None else None
    if not metrics:
        return
    if isinstance(metrics, (list, tuple)):
        keys = sorted(set().union(*(m.keys() for m in metrics)))
        metrics = {k: float(np.mean([m[k] for m in metrics if k in m])) for k in keys}
    into.update({k: float(v) for k, v in metrics.items()})


class StepContext:
    """One RL step's stages over the run's worker groups."""

    def __init__(self, config: RunConfig, roles: Roles, reward_fn: RewardFunction, step: int,
                 next_prompts: Callable[[int], Batch], kl_ctrl: KLController, state: dict[str, Any] | None = None,
                 ptx_batch: Callable[[int], Batch] | None = None, async_rollout: Any = None) -> None:
        self.config, self.roles, self.reward_fn, self.step = config, roles, reward_fn, step
        self.next_prompts = next_prompts
        self.kl_ctrl = kl_ctrl
        self.state = state if state is not None else {}
        """Algorithm state carried across steps and checkpointed (e.g. Safe-RLHF's λ); JSON values."""
        self.ptx_batch = ptx_batch
        self.async_rollout = async_rollout
        """`jaxrl_hf.trainer.async_rollout.AsyncRollout` with a split rollout group: generation goes there."""
        self.timer = StageTimer()
        self.metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ generation and rewards
    def generate(self, prompts: Batch, round_: int = 0, **sampling: Any) -> Batch:
        """``actor.generate_sequences`` with this step's seed (``sampling`` overrides e.g. greedy=True, n=1)."""
        prompts = seeded_prompts(prompts, self.config.rollout.seed, self.step, round_, **sampling)
        with self.timer("gen"):
            if self.async_rollout is not None:
                return self.async_rollout.generate(prompts, self.metrics)
            return self.roles.actor.generate_sequences(prompts)

    def score(self, batch: Batch, *, baseline: bool = False) -> Batch:
        """Rule reward (driver) + reward-model / cost-model scores (workers) -> ``token_level_scores`` etc.
        ``baseline=True`` (ReMax's greedy rollout): the reward alone, as the samples get it (reward model
        included), without the cost model and without logging its reward metrics."""
        if self.roles.reward_model is not None:
            with self.timer("rm"):
                batch = batch.union(self.roles.reward_model.compute_rm_score(batch).select(["rm_scores"], []))
        if self.roles.cost_model is not None and not baseline:
            with self.timer("cost"):
                cost = self.roles.cost_model.compute_rm_score(batch)
            batch = batch.union(Batch.from_dict({"token_level_costs": np.asarray(cost["cost_scores"], np.float32)}))
        with self.timer("reward"):
            scored = self.reward_fn(batch)
        if not baseline:
            for key, value in scored.meta_info.get("reward_metrics", {}).items():
                self.metrics[key] = self.metrics.get(key, 0.0) + value if key.endswith("_count") else value
        return batch.union(Batch(scored.arrays, scored.objects, {}))

    def generate_and_score(self, round_: int = 0) -> Batch:
        """Next prompts -> ``generate_sequences`` -> rewards (one generation round). With a split rollout group
        the first round may have been generated ahead (``trainer.max_staleness``)."""
        if self.async_rollout is not None and round_ == 0:
            with self.timer("gen"):
                out = self.async_rollout.first_round(self.step, self.metrics)
            return self.score(out)
        return self.score(self.generate(self.next_prompts(round_), round_))

    # ------------------------------------------------------------------ log-probs and values
    def balance(self, batch: Batch) -> Batch:
        """Reorder rows so each dp rank's contiguous chunk has about the same token count (once per step)."""
        dp = self.config.placement.train.dp
        if not self.config.trainer.balance_batch or dp <= 1 or batch.meta_info.get("balanced"):
            return batch
        perm, metrics = balance_permutation(batch["attention_mask"], dp)
        self.metrics.update(metrics)
        out = batch.take(perm)
        out.meta_info["balanced"] = True
        return out

    def old_log_prob(self, batch: Batch, *, balance: bool = True) -> Batch:
        """``actor.compute_log_prob`` -> ``old_log_probs`` (+ ``entropys``); with
        ``actor.rollout_correction.bypass_mode`` the sampler's ``rollout_log_probs`` instead (no pass); no pass
        and no column when the update is on-policy (`update_is_on_policy`).
        ``balance=False`` keeps the row order (a generation round, whose groups must stay adjacent)."""
        batch = self.balance(batch) if balance else batch
        if "old_log_probs" in batch:
            return batch
        if self.config.actor.rollout_correction.bypass_mode:
            if "rollout_log_probs" not in batch:
                raise KeyError("actor.rollout_correction.bypass_mode needs the rollout's 'rollout_log_probs'; "
                               f"columns: {batch.keys()}")
            return batch.union(Batch.from_dict({"old_log_probs": np.asarray(batch["rollout_log_probs"], np.float32)}))
        if self.update_is_on_policy(batch):
            return batch  # π_old = stop_gradient(π_θ) inside the update: one pass less
        with self.timer("old_log_prob"):
            out = self.roles.actor.compute_log_prob(batch)
        return batch.union(out.select([k for k in ("old_log_probs", "entropys", "routed_experts") if k in out], []))

    def update_is_on_policy(self, batch: Batch) -> bool:
        """Whether ``batch``'s actor update is a single optimizer step at the policy that sampled it and
        nothing reads π_old before it (``actor.skip_old_log_prob_when_on_policy``)."""
        actor, c = self.config.actor, self.config
        return (actor.skip_old_log_prob_when_on_policy and actor.ppo_epochs == 1
                and len(batch) == actor.ppo_mini_batch_size * c.rollout.n
                and not c.algorithm.use_kl_in_reward and actor.rollout_correction.level is None
                and self.async_rollout is None)

    def needs_ref(self) -> bool:
        """Reference log-probs are needed for KL in the reward or as a loss."""
        return self.config.algorithm.use_kl_in_reward or self.config.actor.use_kl_loss

    def ref_log_prob(self, batch: Batch) -> Batch:
        """``ref.compute_ref_log_prob`` -> ``ref_log_prob`` (skipped when no KL term is used)."""
        if not self.needs_ref() or "ref_log_prob" in batch:
            return batch
        with self.timer("ref"):
            out = self.roles.actor.compute_ref_log_prob(batch)
        return batch.union(out.select(["ref_log_prob"], []))

    def values(self, batch: Batch, critic: Any = None, key: str = "values") -> Batch:
        """``critic.compute_values`` -> ``batch[key]``."""
        batch = self.balance(batch)
        with self.timer("values" if key == "values" else f"values_{key}"):
            out = (critic or self.roles.critic).compute_values(batch)
        return batch.union(Batch.from_dict({key: np.asarray(out["values"], np.float32)}))

    # ------------------------------------------------------------------ advantages
    def rewards(self, batch: Batch) -> Batch:
        """``token_level_rewards``: scores, minus β·KL when ``algorithm.use_kl_in_reward``."""
        if "token_level_rewards" in batch:
            return batch
        if self.config.algorithm.use_kl_in_reward:
            shaped, kl_metrics = kl_in_reward(batch, self.kl_ctrl, self.config.algorithm.kl_penalty)
            self.metrics.update(kl_metrics)
            return batch.union(shaped)
        return batch.union(Batch.from_dict({"token_level_rewards": np.asarray(batch["token_level_scores"], np.float32)}))

    def advantages(self, batch: Batch) -> Batch:
        """Rewards (with KL) then the configured estimator -> ``advantages``, ``returns``."""
        with self.timer("adv"):
            batch = self.rewards(batch)
            return batch.union(compute_advantage(batch, self.config.algorithm))

    # ------------------------------------------------------------------ updates
    def actor_updates(self) -> bool:
        """Whether the actor learns at this step: verl's ``trainer.critic_warmup <= global_steps``, so
        ``critic_warmup = k`` leaves steps 1..k−1 to the critic alone."""
        return self.config.trainer.critic_warmup <= self.step

    def actor_update_meta(self) -> dict[str, int]:
        """meta_info of this step's ``update_actor`` calls (the RL and the ptx update): the actor's lr schedule
        step, i.e. the steps it has learned in before this one (verl steps the scheduler once per call)."""
        return {LR_SCHEDULE_STEP: self.step - max(self.config.trainer.critic_warmup, 1)}

    def update_critic(self, batch: Batch, critic: Any = None, prefix: str = "critic") -> None:
        """``critic.update_critic`` (value loss on ``values``/``returns``) at lr schedule step ``step − 1``."""
        batch = Batch(batch.arrays, batch.objects, {**batch.meta_info, LR_SCHEDULE_STEP: self.step - 1})
        with self.timer("update_critic" if prefix == "critic" else f"update_{prefix}"):
            out = (critic or self.roles.critic).update_critic(batch)
        metrics: dict[str, float] = {}
        merge_metrics(metrics, out)
        self.metrics.update({k.replace("critic/", f"{prefix}/", 1): v for k, v in metrics.items()})

    def update_actor(self, batch: Batch) -> None:
        """``actor.update_actor`` (policy loss), skipped during the critic warm-up steps; with
        ``algorithm.overlong_filter`` the truncated samples are masked out of its loss."""
        if not self.actor_updates():
            return
        if self.config.algorithm.overlong_filter:
            batch, filter_metrics = overlong_filtered(batch)
            self.metrics.update(filter_metrics)
        batch = Batch(batch.arrays, batch.objects, {**batch.meta_info, **self.actor_update_meta()})
        with self.timer("update_actor"):
            out = self.roles.actor.update_actor(batch)
        merge_metrics(self.metrics, out)
