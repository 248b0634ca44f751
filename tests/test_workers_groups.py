"""The workers through real Ray worker groups (1 process x 2 fake CPU devices, dp=2), checked against
independent references (transformers on the exported / saved weights)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from _models_helpers import random_prompts
from jaxrl_hf.controller import Batch, ResourcePool, WorkerGroup, WorkerMethodError, colocate
from jaxrl_hf.workers import ActorRolloutRefWorker, CostModelWorker, CriticWorker, RewardModelWorker


P, R, PROMPTS, N = 6, 8, 4, 2
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
CONFIG = {
    "model": {"path": "tiny-random", "tiny": dict(TINY, max_position_embeddings=128), "seed": 0},
    "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 1, "ppo_epochs": 2, "shuffle": True,
              "loss_agg_mode": "token-mean", "policy_loss": {"loss_mode": "vanilla"}, "clip_ratio": 0.2,
              "clip_ratio_high": 0.28, "entropy_coeff": 0.0, "use_kl_loss": True, "kl_loss_coef": 0.01,
              "kl_loss_type": "low_var_kl", "grad_clip": 1.0, "rollout_correction": {"level": "token", "threshold": 2.0},
              "optim": {"lr": 5e-3, "weight_decay": 0.0, "warmup_steps": 0}},
    "critic": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_device": 2, "ppo_epochs": 1, "cliprange_value": 10.0,
               "loss_agg_mode": "token-mean", "grad_clip": 1.0, "optim": {"lr": 1e-2, "weight_decay": 0.0}},
    "rollout": {"name": "jax", "n": N, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "response_length": R, "seed": 7,
                "val": {"n": 1, "greedy": True}},
    "reward_model": {"path": "tiny-random", "seed": 3},
    "cost_model": {"path": "tiny-random", "seed": 4},
    "placement": {"num_processes": 1, "devices_per_process": 2, "train": {"pp": 1, "tp": 1, "dp": 2}},
    "trainer": {"export_hf_dtype": "float32"},  # the export is compared with our float32 log-probs at 1e-4
}


@pytest.fixture(scope="module")
def roles(ray_cluster):
    pool = ResourcePool("workers_test", num_processes=1, devices_per_process=2)
    groups = colocate(pool, actor=(ActorRolloutRefWorker, (CONFIG, "actor_rollout_ref")), critic=(CriticWorker, (CONFIG,)),
                      reward=(RewardModelWorker, (CONFIG, "reward")), cost=(CostModelWorker, (CONFIG,)))
    for group in (groups.actor, groups.critic, groups.reward, groups.cost):
        group.init_model()
    groups.pool = pool
    yield groups
    pool.shutdown()


def prompt_batch(seed=0):
    prompts, mask = random_prompts(seed, PROMPTS, P, TINY["vocab_size"])
    return Batch.from_dict({"prompts": prompts, "prompt_mask": mask,
                            "data_source": np.array([f"src{i}" for i in range(PROMPTS)], dtype=object),
                            "ground_truth": np.array([str(i) for i in range(PROMPTS)], dtype=object)})


def hf_log_probs(model_dir, batch):
    """Per-token log-probs of the responses from transformers' LlamaForCausalLM on the exported weights."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    out = np.zeros(batch["responses"].shape, np.float64)
    for i in range(len(batch)):
        ids = batch["input_ids"][i][batch["attention_mask"][i].astype(bool)]
        with torch.no_grad():
            logits = model(torch.tensor(ids[None], dtype=torch.long)).logits[0].double()
        logp = torch.log_softmax(logits, -1).numpy()
        plen = int(batch["prompt_mask"][i].sum())
        for t in range(int(batch["response_mask"][i].sum())):
            out[i, t] = logp[plen - 1 + t, ids[plen + t]]
    return out


def test_actor_rollout_ref_end_to_end(roles, tmp_path):
    actor = roles.actor
    gen = actor.generate_sequences(prompt_batch())
    # contract: keys, shapes, samples of a prompt adjacent, input columns repeated, uid per prompt
    for key in ("prompts", "prompt_mask", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
                "rollout_log_probs", "uid", "data_source", "ground_truth"):
        assert key in gen, key
    assert len(gen) == PROMPTS * N and gen["responses"].shape == (PROMPTS * N, R)
    assert gen["input_ids"].shape == (PROMPTS * N, P + R)
    np.testing.assert_array_equal(gen["prompts"], np.repeat(prompt_batch()["prompts"], N, axis=0))
    assert list(gen["uid"]) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert list(gen["data_source"]) == ["src0", "src0", "src1", "src1", "src2", "src2", "src3", "src3"]
    assert gen.meta_info["num_generated_tokens"] == int(gen["response_mask"].sum()) > 0
    assert not np.array_equal(gen["responses"][0], gen["responses"][1])  # two different samples

    # the trainer's log-probs of the sampled tokens equal the sampler's (same params, f32) and transformers'
    lp = actor.compute_log_prob(gen)
    mask = gen["response_mask"].astype(bool)
    np.testing.assert_allclose(lp["old_log_probs"][mask], gen["rollout_log_probs"][mask], atol=2e-5)
    ref = actor.compute_ref_log_prob(gen)
    np.testing.assert_allclose(ref["ref_log_prob"], lp["old_log_probs"], atol=1e-6)
    assert (lp["entropys"][mask] > 0).all()
    actor.export_hf(str(tmp_path / "initial"))
    np.testing.assert_allclose(lp["old_log_probs"], hf_log_probs(str(tmp_path / "initial"), gen), atol=1e-4)

    # one update: +1 advantage on the first sample of each pair, -1 on the second (a GRPO-like signal)
    batch = gen.union(lp).union(ref)
    adv = np.where(np.arange(len(batch))[:, None] % 2 == 0, 1.0, -1.0) * gen["response_mask"]
    batch = batch.union(Batch.from_dict({"advantages": adv.astype(np.float32)}))
    actor.save_checkpoint(str(tmp_path / "ckpt"))
    metrics = actor.update_actor(batch).meta_info["metrics"]
    for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy",
                "actor/grad_norm", "actor/lr", "actor/kl_loss"):
        assert np.isfinite(metrics[key]), key
    assert metrics["actor/num_updates"] == 2 * 2  # 2 epochs x (8 sequences / (2 prompts x n=2))
    new_lp = actor.compute_log_prob(batch)["old_log_probs"]
    delta = (new_lp - lp["old_log_probs"]) * gen["response_mask"]
    assert np.abs(delta).max() > 1e-3, "the update did not change the policy"
    assert float((adv * delta).sum()) > 0, "the surrogate objective A·Δlog π did not improve"
    # the reference stays frozen
    np.testing.assert_allclose(actor.compute_ref_log_prob(batch)["ref_log_prob"], ref["ref_log_prob"], atol=1e-6)

    # checkpoint round trip restores the pre-update policy exactly; seeded generation is deterministic
    step = actor.load_checkpoint(str(tmp_path / "ckpt"))
    assert step == [0]
    np.testing.assert_array_equal(actor.compute_log_prob(batch)["old_log_probs"], lp["old_log_probs"])
    seeded = Batch.from_dict(prompt_batch().to_dict(), meta_info={"seed": 11})
    a, b = actor.generate_sequences(seeded), actor.generate_sequences(seeded)
    np.testing.assert_array_equal(a["responses"], b["responses"])
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "initial"]  # no temp leftovers
    assert json.load(open(tmp_path / "ckpt" / "worker.json"))["role"] == "actor_rollout_ref"

    # validation sampling (rollout.val: n=1, greedy) and bad input errors naming the problem
    val = actor.generate_sequences(Batch.from_dict(prompt_batch().to_dict(), meta_info={"validate": True}))
    assert len(val) == PROMPTS
    with pytest.raises(WorkerMethodError, match="update_actor: Batch lacks .*advantages"):
        actor.update_actor(gen.union(lp).union(ref))


def test_critic_learns_returns_and_reward_scores_last_token(roles):
    gen = roles.actor.generate_sequences(prompt_batch(1))
    values = roles.critic.compute_values(gen)["values"]
    np.testing.assert_array_equal(values, 0.0)  # zero-initialised value head
    returns = (np.linspace(-1, 1, R)[None, :] * gen["response_mask"]).astype(np.float32)
    batch = gen.union(Batch.from_dict({"values": values, "returns": returns}))
    losses = []
    for _ in range(3):
        metrics = roles.critic.update_critic(batch).meta_info["metrics"]
        losses.append(metrics["critic/vf_loss"])
        assert {"critic/vf_clipfrac", "critic/grad_norm", "critic/lr"} <= set(metrics)
    assert losses[-1] < losses[0], losses
    new_values = roles.critic.compute_values(gen)["values"]
    mask = gen["response_mask"].astype(bool)
    assert np.mean((new_values[mask] - returns[mask]) ** 2) < np.mean(returns[mask] ** 2)

    scores = roles.reward.compute_rm_score(gen)["rm_scores"]
    lengths = gen["response_mask"].sum(1)
    for i, n in enumerate(lengths):
        assert np.count_nonzero(scores[i]) <= 1 and (scores[i, n:] == 0).all()
    assert np.count_nonzero(scores) == len(gen)
    # the score is the sequence's: a row's score does not depend on the batch it is in
    single = roles.reward.compute_rm_score(gen[:1])["rm_scores"]
    np.testing.assert_allclose(single[0], scores[0], atol=1e-5)
    costs = roles.cost.compute_rm_score(gen)
    assert "cost_scores" in costs and "rm_scores" not in costs
    assert (costs["cost_scores"] != 0).sum() == len(gen) and not np.allclose(costs["cost_scores"], scores)


def _word_level_tokenizer_dir(path, vocab_size):
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(vocab_size)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(os.path.join(path, "tokenizer.json"))
    return path


def test_reward_model_from_saved_directory_matches_transformers(roles, tmp_path):
    """A reward-model directory (jaxrl_hf.rewards.save_reward_model) scored by the worker == transformers'
    LlamaForSequenceClassification on the same files, read at each sequence's last token."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from jaxrl_hf.models import init_value_params
    from jaxrl_hf.rewards.rm_io import save_reward_model
    from jaxrl_hf.config.build import build_dataclass
    from jaxrl_hf.config.schema import TinyModelConfig
    from jaxrl_hf.workers.common import tiny_decoder_config

    # no pad id in config.json: transformers then reads the last position of an unpadded row, even if a
    # sampled response token happens to equal the pad id
    tiny = build_dataclass(TinyModelConfig, CONFIG["model"]["tiny"], "model.tiny")
    config = tiny_decoder_config(tiny, "float32", "none").replace(pad_token_id=None)
    params = init_value_params(config, 5)
    rm_dir = save_reward_model(tmp_path / "rm", params, config, _word_level_tokenizer_dir(str(tmp_path), 64),
                               eos_id=2, pad_id=0)
    cfg = dict(CONFIG, reward_model={"path": str(rm_dir), "micro_batch_size_per_device": 4})
    group = WorkerGroup(roles.pool, RewardModelWorker, cfg, "reward", role="reward_saved")
    try:
        group.init_model()
        gen = roles.actor.generate_sequences(prompt_batch(2))
        scores = group.compute_rm_score(gen)["rm_scores"]
    finally:
        group.close()
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(rm_dir), torch_dtype=torch.float32).eval()
    lengths = gen["response_mask"].sum(1)
    for i in range(len(gen)):
        ids = gen["input_ids"][i][gen["attention_mask"][i].astype(bool)]
        with torch.no_grad():
            expected = float(model(torch.tensor(ids[None], dtype=torch.long)).logits[0, 0])
        np.testing.assert_allclose(scores[i, lengths[i] - 1], expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(WorkerMethodError, match="reward_model.path=.*not a reward-model directory"):
        bad = WorkerGroup(roles.pool, RewardModelWorker, dict(CONFIG, reward_model={"path": str(tmp_path)}),
                          role="reward_bad")
        try:
            bad.init_model()
        finally:
            bad.close()
