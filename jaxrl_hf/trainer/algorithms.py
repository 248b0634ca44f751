"""Each algorithm's RL step as a short function over worker-group calls (HybridFlow §2.4: the single
controller holds the control flow; PPO is ~8 lines).

Every function takes a ``StepContext`` (``t``) and returns the trained ``Batch``; the stages are named
after the worker methods they call (``t.generate`` = ``actor.generate_sequences``, ``t.values`` =
``critic.compute_values`` ...). ``ALGORITHMS[name]`` maps ``--algo`` to its step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxrl_hf.controller import Batch
from jaxrl_hf.trainer.advantage import compute_advantage, safe_rlhf_advantage, update_lagrange
from jaxrl_hf.trainer.dynamic_sampling import collect_informative_groups
from jaxrl_hf.trainer.step import StepContext, merge_metrics


def ppo_step(t: StepContext) -> Batch:
    """PPO with a critic and GAE; KL to the reference in the reward (InstructGPT / HybridFlow Fig.4)."""
    batch = t.generate_and_score()            # actor.generate_sequences -> reward
    batch = t.values(batch)                   # critic.compute_values
    batch = t.old_log_prob(batch)             # actor.compute_log_prob
    batch = t.ref_log_prob(batch)             # ref.compute_ref_log_prob
    batch = t.advantages(batch)               # r - beta*KL, then GAE
    t.update_critic(batch)                    # critic.update_critic
    t.update_actor(batch)                     # actor.update_actor (after critic warm-up)
    return batch


def critic_free_update(t: StepContext, batch: Batch) -> Batch:
    """The tail every critic-free algorithm shares: actor.compute_log_prob -> ref.compute_ref_log_prob ->
    compute_advantage (group / batch / greedy baseline) -> actor.update_actor."""
    batch = t.advantages(t.ref_log_prob(t.old_log_prob(batch)))
    t.update_actor(batch)
    return batch


def group_baseline_step(t: StepContext) -> Batch:
    """GRPO, RLOO, REINFORCE++, GSPO: no critic; the baseline comes from the prompt's group / the batch."""
    batch = t.generate_and_score()
    return critic_free_update(t, batch)


def dapo_step(t: StepContext) -> Batch:
    """DAPO: like GRPO, but with dynamic sampling — refill with new prompt batches until
    ``data.train_batch_size`` groups have mixed outcomes (clip-higher, token-mean and overlong shaping are
    the actor's and reward manager's config; overlong filtering is ``algorithm.overlong_filter``)."""
    fg = t.config.algorithm.filter_groups
    if fg.enable:
        batch, metrics = collect_informative_groups(
            lambda round_: dapo_generation_round(t, round_), t.config.data.train_batch_size, t.config.rollout.n,
            fg.metric, fg.max_num_gen_batches)
        t.metrics.update(metrics)
    else:
        batch = t.generate_and_score()
    return critic_free_update(t, batch)


def dapo_generation_round(t: StepContext, round_: int) -> Batch:
    """One round of dynamic sampling: generate and score; filtering on ``seq_final_reward`` also needs the
    final rewards, so (as verl's DAPO trainer) the KL penalty's log-probs are taken per round, rows unmoved."""
    batch = t.generate_and_score(round_)
    if t.config.algorithm.filter_groups.metric == "seq_final_reward":
        if t.config.algorithm.use_kl_in_reward:
            batch = t.ref_log_prob(t.old_log_prob(batch, balance=False))
        batch = t.rewards(batch)
    return batch


def remax_step(t: StepContext) -> Batch:
    """ReMax: one extra greedy rollout per prompt; its reward is the baseline b(x) (Li et al. 2023, eq.5)."""
    prompts = t.next_prompts(0)
    batch = t.score(t.generate(prompts))
    with t.timer("gen_max"):
        greedy = t.roles.actor.generate_sequences(Batch(prompts.arrays, prompts.objects,
                                                        {"greedy": True, "n": 1, "global_step": t.step, "seed": 0}))
    greedy_score = t.score(greedy, baseline=True)["seq_score"]  # rule + reward model, as the samples
    baseline = np.repeat(np.asarray(greedy_score, np.float32), len(batch) // len(prompts))
    batch = batch.union(Batch.from_dict({"reward_baselines": baseline}))
    t.metrics["critic/reward_baseline/mean"] = float(baseline.mean())
    return critic_free_update(t, batch)


def safe_rlhf_step(t: StepContext) -> Batch:
    """Safe-RLHF (Dai et al. 2023): reward and cost critics, A = (A_r − λ·A_c)/(1+λ), λ by dual ascent on
    E[cost] ≤ cost_limit, plus the pre-training (ptx) loss."""
    batch = t.generate_and_score()                                  # + cost_model.compute_rm_score
    batch = t.values(batch)                                         # reward critic
    batch = t.values(batch, t.roles.cost_critic, key="cost_values")  # cost critic
    batch = t.ref_log_prob(t.old_log_prob(batch))
    batch = t.advantages(batch)                                     # reward: r - beta*KL, GAE
    batch = combine_cost_advantage(t, batch)                        # cost GAE, Lagrangian mix
    t.update_critic(batch)
    t.update_critic(cost_view(batch), t.roles.cost_critic, prefix="cost_critic")
    t.update_actor(batch)
    ptx_update(t)
    return batch


def combine_cost_advantage(t: StepContext, batch: Batch) -> Batch:
    """Cost advantages by GAE on the cost critic, then the Lagrangian combination; updates λ."""
    sr = t.config.algorithm.safe_rlhf
    cost_view_batch = Batch.from_dict({"token_level_rewards": batch["token_level_costs"],
                                       "response_mask": batch["response_mask"], "values": batch["cost_values"]})
    cost = compute_advantage(cost_view_batch, t.config.algorithm)
    lagrange = float(t.state.setdefault("lagrange", sr.lambda_init))
    advantages = safe_rlhf_advantage(batch["advantages"], cost["advantages"], lagrange)
    mean_cost = float(np.asarray(batch["token_level_costs"]).sum(-1).mean())
    t.state["lagrange"] = update_lagrange(lagrange, mean_cost, sr.cost_limit, sr.lambda_lr, sr.lambda_max)
    t.metrics.update({"safe_rlhf/lambda": lagrange, "safe_rlhf/cost/mean": mean_cost,
                      "safe_rlhf/reward_advantages/mean": float(np.asarray(batch["advantages"])[batch["response_mask"] > 0].mean())})
    out = Batch(dict(batch.arrays), dict(batch.objects), dict(batch.meta_info))
    out.arrays["advantages"] = advantages
    out.arrays["cost_returns"] = cost["returns"]
    return out


def cost_view(batch: Batch) -> Batch:
    """The batch as the cost critic sees it: ``values``/``returns`` = the cost ones."""
    out = Batch(dict(batch.arrays), dict(batch.objects), dict(batch.meta_info))
    out.arrays["values"] = batch["cost_values"]
    out.arrays["returns"] = batch["cost_returns"]
    return out


def ptx_update(t: StepContext) -> None:
    """Pre-training loss as an actor update: with ``old_log_probs`` = the current log-probs the PPO ratio is 1
    inside the clip range, so advantages ≡ ptx_coef make the update's gradient exactly −ptx_coef·∇ log p(text)
    (the InstructGPT/Safe-RLHF ptx term), taken as separate optimizer steps after the RL update, at the lr of
    this step's RL update (same schedule step), and not at all while the actor is warming up."""
    if t.config.actor.ptx_coef <= 0 or t.ptx_batch is None or not t.actor_updates():
        return
    ptx = t.ptx_batch(t.step)
    with t.timer("ptx"):
        lp = t.roles.actor.compute_log_prob(ptx)
        mask = np.asarray(ptx["response_mask"], np.float32)
        coef = np.float32(t.config.actor.ptx_coef)
        ptx = ptx.union(Batch.from_dict({"old_log_probs": np.asarray(lp["old_log_probs"], np.float32),
                                         "advantages": mask * coef, "returns": mask * coef}))
        out = t.roles.actor.update_actor(Batch(ptx.arrays, ptx.objects, {**ptx.meta_info, **t.actor_update_meta()}))
    update: dict[str, float] = {}
    merge_metrics(update, out)
    t.metrics["actor/ptx_nll"] = float(-(np.asarray(lp["old_log_probs"]) * mask).sum() / max(mask.sum(), 1.0))
    t.metrics["actor/ptx_lr"] = update["actor/lr"]


ALGORITHMS: dict[str, Callable[[StepContext], Batch]] = {
    "ppo": ppo_step,
    "grpo": group_baseline_step,
    "rloo": group_baseline_step,
    "reinforce_pp": group_baseline_step,
    "gspo": group_baseline_step,
    "dapo": dapo_step,
    "remax": remax_step,
    "safe_rlhf": safe_rlhf_step,
}
