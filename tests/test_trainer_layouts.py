"""The training layout is a rule set chosen by config, not a second code path.

* Equivalence, on one given batch: a batch generated once (its old log-probs and ±1 advantages fixed) is trained by
  actor workers in this process on 8 host devices under ``strategy=megatron`` dp8, ``strategy=fsdp`` dp8 (ZeRO-3:
  params, grads and Adam moments sharded over dp), fsdp over dp4 x tp2 (``fsdp_tp``), fsdp over dp8 with Ulysses
  sp2 (``fsdp_sp``: each pair of devices holds the same rows, each half of every sequence) and fsdp dp8 with packed
  sequences in token-budget micro-batches (``use_remove_padding`` + ``use_dynamic_bsz``). One mini-batch, two
  epochs: the second epoch is off-policy, so the loss, KL and clip fraction are non-trivial. The inputs are the
  same, so the layouts can differ only by float32 reduction order; that holds on any CPU or GPU (a comparison of
  whole runs would sample other tokens as soon as one logit rounds differently).
* Wiring, once: the fsdp dp2 x sp2 layout written with verl's keys through ``launch/train.py``'s trainer and Ray.
"""

from __future__ import annotations

import copy
import gc
import json

import jax
import numpy as np
import pytest

from _models_helpers import TINY_WORKER_MODEL, local_actor, random_prompts, tiny_worker_config
from jaxrl_hf.controller import Batch
from jaxrl_hf.trainer.metrics import is_wall_clock_metric

pytestmark = [pytest.mark.slow, pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                                                   "XLA_FLAGS=--xla_force_host_platform_device_count=8")]

P, R, PROMPTS, N = 6, 8, 4, 2
BASE = tiny_worker_config(lr=5e-3, n=N, response_length=R, seed=7,
                          actor={"ppo_mini_batch_size": PROMPTS, "ppo_epochs": 2},
                          placement={"num_processes": 1, "devices_per_process": 8,
                                     "train": {"pp": 1, "tp": 1, "dp": 8}})
LAYOUTS = {
    "megatron_dp8": {"actor": {"strategy": "megatron"}},
    "fsdp_dp8": {"actor": {"strategy": "fsdp"}},
    # 2 rows a device where 4 data-parallel groups share the 8 rows: every layout trains the mini-batch in one
    # micro-step, since ppo_kl and pg_clipfrac are averaged per micro-step, as verl averages them
    "fsdp_dp4_tp2": {"actor": {"strategy": "fsdp", "ppo_micro_batch_size_per_device": 2},
                     "placement": {"train": {"pp": 1, "tp": 2, "dp": 4}}},
    "fsdp_dp8_sp2": {"actor": {"strategy": "fsdp", "ulysses_sequence_parallel_size": 2,
                               "ppo_micro_batch_size_per_device": 2}},
    "fsdp_dp8_packed": {"actor": {"strategy": "fsdp", "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 32},
                        "model": {"use_remove_padding": True}},
}
# Tolerances from the dtype and the reduction sizes: float32 (eps 6e-8) sums over at most 8·14 tokens and
# 2·32·64 products per matmul entry reorder to a relative ~n·eps ≲ 1e-4 in the loss and the gradient norm;
# a clip fraction is a count, so another rounding may move one token across the clip boundary: 1 / valid tokens.
REL = 1e-4
COMPARED = ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy")


def layout_config(name: str) -> dict:
    config = copy.deepcopy(BASE)
    for section, values in LAYOUTS[name].items():
        for key, value in values.items():
            config[section][key] = value if not isinstance(value, dict) else {**config[section].get(key, {}), **value}
    return config


@pytest.fixture(scope="module")
def given_batch():
    """One rollout of the megatron layout, with its old log-probs and ±1 advantages: every layout trains on it."""
    worker = local_actor(layout_config("megatron_dp8"))
    prompts, mask = random_prompts(0, PROMPTS, P, TINY_WORKER_MODEL["vocab_size"])
    gen = worker.generate_sequences(Batch.from_dict({"prompts": prompts, "prompt_mask": mask}))
    batch = gen.union(worker.compute_log_prob(gen))
    adv = np.where(np.arange(len(batch))[:, None] % 2 == 0, 1.0, -1.0) * gen["response_mask"]
    del worker
    gc.collect()
    return batch.union(Batch.from_dict({"advantages": adv.astype(np.float32)}))


def test_layouts_train_the_same_given_batch_alike(given_batch):
    metrics = {}
    for name in LAYOUTS:
        worker = local_actor(layout_config(name))
        out = worker.update_actor(given_batch).meta_info["metrics"]
        metrics[name] = {k: v for k, v in out.items() if not is_wall_clock_metric(k)}
        del worker
        gc.collect()
    reference = metrics["megatron_dp8"]
    assert reference["actor/grad_norm"] > 0 and reference["actor/pg_loss"] != 0 and reference["actor/ppo_kl"] != 0
    assert reference["actor/pg_clipfrac"] > 0  # the second epoch clips some tokens
    one_token = 1.0 / float(np.asarray(given_batch["response_mask"]).sum())
    for name, got in metrics.items():
        for key in COMPARED:
            assert got[key] == pytest.approx(reference[key], rel=REL, abs=1e-7), (name, key)
        assert abs(got["actor/pg_clipfrac"] - reference["actor/pg_clipfrac"]) <= one_token + 1e-7, name
    assert 0 <= metrics["fsdp_dp8_packed"]["actor/padding_ratio"] < 1


def test_a_sequence_parallel_layout_in_verls_keys_runs_through_the_trainer(tmp_path):
    from jaxrl_hf.trainer import run

    overrides = [f"trainer.run_dir={tmp_path}", "placement.devices_per_process=4", "placement.train.dp=4",
                 "actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                 "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_device=1", "trainer.total_steps=1",
                 "trainer.val_before_train=false", "trainer.save_freq=0"]
    assert run("grpo", preset="smoke", overrides=overrides) == 0
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record["step"] == 1 and np.isfinite(record["actor/grad_norm"]) and record["actor/grad_norm"] > 0
