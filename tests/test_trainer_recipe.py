"""The trainer's side of the DAPO recipe and verl's step semantics, run in this process with the real workers
(no Ray) on the smoke preset's tiny random model:

* the lr schedule counts training steps (verl steps its scheduler once per update_actor / update_critic call),
  with several optimizer updates per step; the ptx update shares its step's lr;
* ``trainer.critic_warmup = k`` skips the actor on steps 1..k−1 (verl's ``critic_warmup <= global_steps``), and
  the ptx update with it;
* ``algorithm.filter_groups.metric``: ``score`` is the raw scorer output, ``seq_reward`` the summed
  ``token_level_scores``, ``seq_final_reward`` the summed ``token_level_rewards`` (KL penalty included);
* ``algorithm.overlong_filter`` masks truncated samples out of the actor's loss (DAPO §3.4);
* ReMax's greedy baseline is scored like the sampled responses (reward model included);
* a rollout re-feeds an engine whose sleep discarded its weights (vLLM's sleep level 2).

One actor worker (the DAPO smoke config: 8 samples per prompt over dp=8, mini-batches of one prompt, so 4
optimizer updates per step, warm-up 2) serves every test; each test's trainer config differs from it only in
keys the driver reads.
"""

from __future__ import annotations

import glob
import os
import re

import jax
import numpy as np
import pytest

from jaxrl_hf.config import load_config
from jaxrl_hf.controller import Batch
from jaxrl_hf.controller.protocols import registered_methods
from jaxrl_hf.controller.worker import WorkerContext
from jaxrl_hf.trainer.algorithms import critic_free_update, dapo_step, ptx_update, remax_step
from jaxrl_hf.trainer.data import load_tokenizer
from jaxrl_hf.trainer.dynamic_sampling import informative_mask
from jaxrl_hf.trainer.run import RLTrainer
from jaxrl_hf.trainer.scoring import RewardFunction
from jaxrl_hf.trainer.step import Roles, StepContext
from jaxrl_hf.workers import ActorRolloutRefWorker, CriticWorker, RewardModelWorker

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 8  # samples per prompt = dp devices: a mini-batch of one prompt is one row per device
BASE = [f"rollout.n={N}", f"placement.devices_per_process={N}", f"placement.train.dp={N}",
        "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size_per_device=1", "actor.optim.warmup_steps=2",
        "critic.optim.warmup_steps=2", "trainer.val_before_train=false"]
PARITY_SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2 == 0)
'''

pytestmark = pytest.mark.skipif(jax.device_count() != N, reason=f"needs {N} (host) devices")


def smoke_config(algo: str, *overrides: str, tmp=None):
    run_dir = [f"trainer.run_dir={tmp}"] if tmp is not None else []
    return load_config(algo, preset="smoke", overrides=[*BASE, *run_dir, *overrides])


def in_process(worker_cls, config, *args):
    worker = worker_cls._instantiate(WorkerContext("local", "local", 0, 1), (config, *args), {})
    worker.init_model()
    return worker


class InProcess:
    """A worker where the trainer expects a worker group: its registered methods, called in this process."""

    def __init__(self, worker):
        self.worker = worker
        self.method_names = sorted(registered_methods(type(worker)))

    def __getattr__(self, name):
        if name not in self.method_names:
            raise AttributeError(name)
        return getattr(self.worker, name)


@pytest.fixture(scope="module")
def actor():
    return in_process(ActorRolloutRefWorker, smoke_config("dapo"), "actor_rollout_ref")


def trainer(config, **workers) -> RLTrainer:
    """An `RLTrainer` over ``config``'s data and rewards whose roles are the given in-process workers."""
    tr = RLTrainer(config)
    tr._setup_data()
    tr.reward_fn = RewardFunction(config, tr.tokenizer)
    tr.roles = Roles(**{name: InProcess(w) for name, w in workers.items()})
    return tr


def context(tr: RLTrainer, step: int) -> StepContext:
    """The trainer's step ``step`` as `RLTrainer.train_step` starts it (workers told the step)."""
    tr.global_step = step
    for group in (tr.roles.actor, tr.roles.critic):
        if group is not None:
            group.set_step(step)
    return StepContext(tr.config, tr.roles, tr.reward_fn, step, tr.next_prompts, tr.kl_ctrl, state=tr.algo_state,
                       ptx_batch=tr.ptx_batch if tr.ptx is not None else None)


# ------------------------------------------------------------------------------------------ lr schedule
def test_warmup_counts_training_steps_not_optimizer_updates(actor, tmp_path):
    """4 updates per step, warm-up 2: verl's lr is 0, lr/2, lr at steps 1, 2, 3 (it was lr from step 1 on)."""
    tr = trainer(smoke_config("dapo", tmp=tmp_path), actor=actor)
    lr = tr.config.actor.optim.lr
    records = []
    for step in (1, 2, 3):
        tr.global_step = step
        records.append(tr.train_step())
    assert [r["actor/num_updates"] for r in records] == [4.0] * 3
    np.testing.assert_allclose([r["actor/lr"] for r in records], [0.0, lr / 2, lr], rtol=1e-6)


def test_critic_warmup_skips_the_actor_on_steps_before_it_and_the_ptx_update_too(actor, tmp_path):
    """verl updates the actor when ``critic_warmup <= global_steps``: k = 2 skips step 1 only. The actor's
    schedule starts at its first update (lr 0 at step 2); the ptx update runs only with the actor, at its lr."""
    tr = trainer(smoke_config("dapo", "trainer.critic_warmup=2", "actor.ptx_coef=0.5", tmp=tmp_path), actor=actor)
    lr = tr.config.actor.optim.lr
    seen = []
    for step in (1, 2, 3):
        t = context(tr, step)
        critic_free_update(t, t.generate_and_score())
        updates = int(actor.state.step)
        ptx_update(t)
        seen.append((t.metrics.get("actor/lr"), t.metrics.get("actor/ptx_lr"), int(actor.state.step) - updates))
    assert seen[0] == (None, None, 0)  # warming up: neither the RL nor the ptx update ran
    (lr2, ptx2, ptx_updates2), (lr3, ptx3, _) = seen[1:]
    assert ptx_updates2 == 4
    np.testing.assert_allclose([lr2, ptx2, lr3, ptx3], [0.0, 0.0, lr / 2, lr / 2], rtol=1e-6)


def test_critic_lr_counts_training_steps(actor, tmp_path):
    config = smoke_config("ppo", "critic.ppo_mini_batch_size=1", "critic.ppo_micro_batch_size_per_device=1",
                          tmp=tmp_path)
    critic = in_process(CriticWorker, config)
    tr = trainer(config, actor=actor, critic=critic)
    gen = actor.generate_sequences(tr.next_prompts(0))
    values = critic.compute_values(gen)["values"]
    rng = np.random.default_rng(0)
    batch = gen.union(Batch.from_dict({"values": values, "returns": rng.normal(size=values.shape).astype(np.float32)}))
    lrs = []
    for step in (1, 2, 3):
        t = context(tr, step)
        t.update_critic(batch)
        assert t.metrics["critic/num_updates"] == 4.0
        lrs.append(t.metrics["critic/lr"])
    lr = config.critic.optim.lr
    np.testing.assert_allclose(lrs, [0.0, lr / 2, lr], rtol=1e-6)


# ------------------------------------------------------------------------------------------ dynamic sampling
def test_filter_group_metrics_are_verls_columns():
    """Three groups of two: which groups each metric keeps (a group is kept when its metric varies)."""
    uid = np.array([0, 0, 1, 1, 2, 2]).astype(object)
    scores = np.zeros((6, 3), np.float32)
    scores[:, -1] = [1.0, 0.5, 0.0, 1.0, 0.0, 0.0]  # row 1: a correct answer with an overlong penalty of -0.5
    rewards = scores.copy()
    rewards[5, 1] = -0.01  # a KL penalty makes group 2's final rewards differ
    batch = Batch.from_dict({"uid": uid, "acc": np.array([1, 1, 0, 1, 0, 0], np.float32),
                             "score": np.array([1, 1, 0, 1, 0, 0], np.float32),  # the scorer's own output
                             "token_level_scores": scores, "token_level_rewards": rewards})
    kept = {metric: sorted(set(uid[informative_mask(batch, metric)])) for metric in
            ("acc", "score", "seq_reward", "seq_final_reward")}
    assert kept == {"acc": [1], "score": [1], "seq_reward": [0, 1], "seq_final_reward": [0, 1, 2]}


def test_score_column_is_the_raw_scorer_output(tmp_path):
    """DAPO's reward manager adds the overlong penalty to the reward, not to ``score`` (verl's extra info)."""
    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY_SCORER)
    config = smoke_config("dapo", f"custom_reward_function.path={scorer}", "reward_model.overlong_buffer.len=8")
    tokenizer = load_tokenizer(config.model.path)
    ids = np.array(tokenizer.encode("a b c d e f g h i j k l m n o p q r s t")[:16], np.int32)
    mask = np.zeros((4, 16), np.int32)
    for i, length in enumerate([3, 4, 12, 16]):
        mask[i, :length] = 1
    batch = Batch.from_dict({"responses": np.tile(ids, (4, 1)) * mask, "response_mask": mask,
                             "data_source": np.array(["arithmetic"] * 4, object),
                             "ground_truth": np.array(["0"] * 4, object)})
    out = RewardFunction(config, tokenizer)(batch)
    raw = [float(len(tokenizer.decode(ids[:n].tolist(), skip_special_tokens=True)) % 2 == 0) for n in (3, 4, 12, 16)]
    penalty = np.minimum(0.0, (16 - 8 - np.array([3, 4, 12, 16])) / 8)  # eq.13, L_max 16, L_cache 8
    np.testing.assert_array_equal(out["score"], raw)
    np.testing.assert_allclose(out["seq_score"], np.array(raw) + penalty, rtol=1e-6)
    assert penalty[2:].min() < 0  # the rows whose two columns differ


def test_seq_final_reward_filters_on_rewards_with_the_kl_penalty(actor, tmp_path):
    """With KL in the reward, rewards exist before the filter only if the log-probs are taken per generation
    round (verl's DAPO trainer does so); the kept groups' final rewards vary and equal scores − β·KL."""
    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY_SCORER)
    config = smoke_config("dapo", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
                          "algorithm.filter_groups.max_num_gen_batches=12", "data.gen_batch_size=2",
                          "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.5",
                          f"custom_reward_function.path={scorer}", "reward_model.overlong_buffer.enable=false",
                          tmp=tmp_path)
    tr = trainer(config, actor=actor)
    t = context(tr, 1)
    batch = dapo_step(t)
    assert len(batch) == config.data.train_batch_size * N and "actor/reward_kl_penalty" in t.metrics
    mask = batch["response_mask"].astype(np.float64)
    kl = (batch["old_log_probs"].astype(np.float64) - batch["ref_log_prob"]) * mask
    np.testing.assert_allclose(batch["token_level_rewards"], batch["token_level_scores"] - 0.5 * kl, atol=1e-6)
    final = batch["token_level_rewards"].sum(-1)
    for uid in set(batch["uid"]):
        assert np.std(final[batch["uid"] == uid]) > 0


# ------------------------------------------------------------------------------------------ overlong filtering
def end_rows_early(batch: Batch, rows, at, eos: int, pad: int) -> Batch:
    """``batch`` with response ``rows[k]`` ending in a stop token at position ``at[k]`` (what a rollout that
    stopped there returns: pad after it, masks and positions to match)."""
    arrays = {k: np.array(v) for k, v in batch.arrays.items()}
    width = arrays["responses"].shape[1]
    prompt = arrays["input_ids"].shape[1] - width
    for i, j in zip(rows, at):
        arrays["responses"][i, j], arrays["responses"][i, j + 1:] = eos, pad
        arrays["response_mask"][i, j + 1:] = 0
        arrays["attention_mask"][i, prompt + j + 1:] = 0
    arrays["input_ids"][:, prompt:] = arrays["responses"]
    arrays["position_ids"] = np.maximum(np.cumsum(arrays["attention_mask"], axis=1) - 1, 0).astype(np.int32)
    return Batch(arrays, dict(batch.objects), dict(batch.meta_info))


def test_overlong_filter_masks_truncated_samples_out_of_the_actor_loss(actor, tmp_path):
    """Two prompts' samples stop early, the others run to the length limit. At step 1 (lr 0, so the policy is
    the same for all 4 mini-batches) the update's entropy is the token mean of the rollout entropies over
    the untruncated samples of each mini-batch, averaged over the mini-batches."""
    tr = trainer(smoke_config("dapo", "algorithm.overlong_filter=true", tmp=tmp_path), actor=actor)
    t = context(tr, 1)
    batch = t.generate_and_score()
    eos = batch.meta_info["eos_token_ids"][0]
    width = batch["responses"].shape[1]
    stopped = np.arange(2 * N)
    batch = end_rows_early(batch, stopped, (stopped * 5) % (width - 1), eos, actor.model.pad_token_id)
    out = critic_free_update(t, batch)
    truncated = ~np.isin(out["responses"], list(actor.engine.eos_token_ids)).any(-1)
    assert truncated.sum() == 2 * N and t.metrics["overlong_filter/num_masked"] == 2 * N
    kept = out["response_mask"] * ~truncated[:, None]
    ent = out["entropys"].astype(np.float64) * kept
    per_minibatch = [ent[k:k + N].sum() / max(kept[k:k + N].sum(), 1e-8) for k in range(0, len(out), N)]
    np.testing.assert_allclose(t.metrics["actor/entropy"], np.mean(per_minibatch), rtol=1e-4)
    assert out["response_mask"][truncated].sum() == 2 * N * width  # only the loss drops them, not the batch


# ------------------------------------------------------------------------------------------ ReMax
def test_remax_greedy_baseline_includes_the_reward_model(actor, tmp_path):
    config = smoke_config("remax", "reward_model.enable=true", "reward_model.path=tiny-random", tmp=tmp_path)
    rm = in_process(RewardModelWorker, config, "reward")
    tr = trainer(config, actor=actor, reward_model=rm)
    batch = remax_step(context(tr, 1))  # step 1: lr 0, so the policy that made the baseline is still the actor's
    first = [int(np.flatnonzero(batch["uid"] == u)[0]) for u in sorted(set(batch["uid"]))]
    prompts = batch.take(first).select(["prompts", "prompt_mask", "data_source", "ground_truth"], [])
    greedy = actor.generate_sequences(Batch(prompts.arrays, prompts.objects, {"greedy": True, "n": 1}))
    rm_scores = rm.compute_rm_score(greedy)["rm_scores"]
    rule = RewardFunction(config, tr.tokenizer)(greedy)["seq_score"]  # rule score x reward_model.rule_weight
    assert np.abs(rm_scores.sum(-1)).min() > 0
    np.testing.assert_allclose(batch["reward_baselines"][first], rule + rm_scores.sum(-1), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ configs
def test_configs_name_only_test_files_that_exist():
    named = set()
    for path in glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True):
        named.update(re.findall(r"tests/[\w/]+\.py", open(path).read()))
    missing = sorted(p for p in named if not os.path.isfile(os.path.join(REPO, p)))
    assert not missing, f"configs name test files that do not exist: {missing}"


def test_default_dapo_config_makes_several_updates_per_step():
    """The embedded default (``--algo dapo``) splits each step's batch into several mini-batches, so all but the
    first update see a ratio π/π_old ≠ 1 and clip-higher can act (one update per step: pg_clipfrac ≡ 0)."""
    from jaxrl_hf.workers.minibatch import MiniBatchPlan

    config = load_config("dapo")
    actor, n = config.actor, config.rollout.n
    processes = config.placement.num_processes or 1
    plan = MiniBatchPlan.build(config.data.train_batch_size * n // processes,
                               mini_batch_prompts=actor.ppo_mini_batch_size, samples_per_prompt=n,
                               micro_per_device=actor.ppo_micro_batch_size_per_device,
                               dp_devices=processes * config.placement.devices_per_process,
                               dp_processes=processes, epochs=actor.ppo_epochs)
    assert plan.num_minibatches * plan.epochs > 1, (plan, "optimizer updates per step")
    assert actor.clip_ratio_high > actor.clip_ratio_low


def test_a_rollout_after_discarded_weights_resyncs_them_first(actor, monkeypatch):
    """An engine whose sleep dropped its weights (vLLM's level 2, GPU only: `VllmRolloutEngine.weights_discarded`)
    is fed the actor's current params before the rollout; one that kept them is not fed again."""
    engine, fed = actor.engine, []

    def set_params(params):
        fed.append(params)
        engine.weights_discarded = False

    monkeypatch.setattr(engine, "set_params", set_params)
    with actor._engine_for_rollout():
        pass
    assert fed == []
    engine.weights_discarded = True
    with actor._engine_for_rollout() as used:
        assert used is engine and not engine.weights_discarded
    assert len(fed) == 1 and fed[0] is actor.policy_params()
