"""``actor.strategy`` / ``critic.strategy`` through the real workers in this process (8 fake CPU devices, tiny
random Llama): an fsdp actor (train pp=1, tp=4, dp=2 -> ``fsdp_tp``; generate tp_g=2 with the 3D-HybridEngine)
holds 1/8 of every large param and Adam moment per device, generates what the megatron actor generates, and
trains like it; a critic follows ``critic.strategy``."""

from __future__ import annotations

import copy
import gc

import jax
import numpy as np
import pytest

from _models_helpers import TINY_WORKER_MODEL, random_prompts, tiny_worker_config
from jaxrl_hf.controller import Batch
from jaxrl_hf.controller.worker import WorkerContext
from jaxrl_hf.trainer.metrics import is_wall_clock_metric
from jaxrl_hf.workers import ActorRolloutRefWorker, CriticWorker
from jaxrl_hf.workers.common import WorkerConfigError

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")

P, R, PROMPTS, N = 6, 8, 4, 2
BASE = tiny_worker_config(
    lr=5e-3, n=N, response_length=R, seed=7, actor={"shuffle": True},
    critic={"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 1},
    placement={"num_processes": 1, "devices_per_process": 8, "train": {"pp": 1, "tp": 4, "dp": 2},
               "generate": {"pp": 1, "tp": 2}})


def make(cls, args, generate=BASE["placement"]["generate"], train=None, **strategies):
    config = copy.deepcopy(BASE)
    config["placement"]["generate"] = generate
    if train is not None:
        config["placement"]["train"] = train
    for section, name in strategies.items():
        config[section]["strategy"] = name
    worker = cls._instantiate(WorkerContext("w", "local", 0, 1), (config, *args), {})
    worker.init_model()
    return worker


def per_device_shares(tree):
    """{leaf bytes / bytes one device holds} over the leaves of at least 1 KiB."""
    return {leaf.nbytes // max(s.data.nbytes for s in leaf.addressable_shards)
            for leaf in jax.tree.leaves(tree) if leaf.nbytes >= 1024}


def prompt_batch(seed=0, **meta):
    prompts, mask = random_prompts(seed, PROMPTS, P, TINY_WORKER_MODEL["vocab_size"])
    return Batch.from_dict({"prompts": prompts, "prompt_mask": mask}, meta_info=meta)


@pytest.fixture(scope="module")
def actors():
    megatron = make(ActorRolloutRefWorker, ("actor_rollout",))
    fsdp = make(ActorRolloutRefWorker, ("actor_rollout",), actor="fsdp")
    yield megatron, fsdp
    del megatron, fsdp
    gc.collect()


def test_fsdp_actor_shards_params_and_moments_over_all_devices(actors):
    megatron, fsdp = actors
    assert (megatron.rule_set.name, fsdp.rule_set.name) == ("megatron", "fsdp_tp")  # fsdp + placement.train.tp=4
    assert per_device_shares(megatron.state.params) == {4}  # tp only: replicated over dp=2
    assert per_device_shares(fsdp.state.params) == {8}
    assert per_device_shares(fsdp.state.opt_state) == {8}
    fsdp.layout.check_train_shardings([x.sharding for x in jax.tree.leaves(fsdp.state.params)])


def test_fsdp_actor_generates_and_trains_like_megatron(actors):
    megatron, fsdp = actors
    greedy = prompt_batch(0, greedy=True, n=1)
    before = [np.asarray(x) for x in jax.tree.leaves(fsdp.state.params)]
    shardings = [x.sharding for x in jax.tree.leaves(fsdp.state.params)]
    a, b = fsdp.generate_sequences(greedy), megatron.generate_sequences(greedy)
    np.testing.assert_array_equal(a["responses"], b["responses"])
    np.testing.assert_allclose(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5)
    for x, y in zip(before, jax.tree.leaves(fsdp.state.params)):  # the reshard round trip is exact
        np.testing.assert_array_equal(x, np.asarray(y))
    assert [x.sharding for x in jax.tree.leaves(fsdp.state.params)] == shardings

    gen = megatron.generate_sequences(prompt_batch(1))
    batch = gen.union(megatron.compute_log_prob(gen))
    np.testing.assert_allclose(fsdp.compute_log_prob(gen)["old_log_probs"], batch["old_log_probs"], atol=1e-5)
    adv = np.where(np.arange(len(batch))[:, None] % 2 == 0, 1.0, -1.0) * gen["response_mask"]
    batch = batch.union(Batch.from_dict({"advantages": adv.astype(np.float32)}))
    metrics = []
    for worker in (megatron, fsdp):
        worker.set_step(1)
        m = worker.update_actor(batch).meta_info["metrics"]
        metrics.append({k: v for k, v in m.items() if not is_wall_clock_metric(k)})
    assert metrics[0].keys() == metrics[1].keys()
    for key in metrics[0]:
        np.testing.assert_allclose(metrics[1][key], metrics[0][key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert per_device_shares(fsdp.state.params) == {8}  # the update keeps the layout
    for x, y in zip(jax.tree.leaves(megatron.state.params), jax.tree.leaves(fsdp.state.params)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), atol=1e-4)


def test_fsdp_actor_gathers_for_each_rollout_without_placement_generate():
    """Without ``placement.generate`` an fsdp actor still gets a generation layout (d_g = 1): each rollout gathers
    the params over dp and frees them after, so the engine never holds a second copy."""
    plain = make(ActorRolloutRefWorker, ("actor_rollout",), generate={})
    assert plain.layout is None  # megatron on equal layouts: no reshard, as before
    fsdp = make(ActorRolloutRefWorker, ("actor_rollout",), generate={}, actor="fsdp")
    assert fsdp.layout is not None and fsdp.layout.gen.dg == 1 and fsdp.engine.params is None
    assert dict(fsdp.layout.mesh.shape) == {"pp_g": 1, "tp_g": 4, "dg": 1, "dp": 2}
    greedy = prompt_batch(4, greedy=True, n=1)
    np.testing.assert_array_equal(fsdp.generate_sequences(greedy)["responses"],
                                  plain.generate_sequences(greedy)["responses"])
    assert fsdp.engine.params is None and per_device_shares(fsdp.state.params) == {8}


def test_pure_fsdp_actor_generates_on_a_merged_pipeline_layout():
    """``actor.strategy=fsdp`` on ``tp=1`` (the ``fsdp`` rule set: layers over pp, embed over dp), training
    (pp=2, tp=1, dp=4) -> generating with pp_g=1 (d_g=2): the chunked reshard gathers over micro-DP x DP, greedy
    tokens equal a megatron actor's generating on its training layout, the round trip is bit-identical and no
    generation-layout array outlives the rollout."""
    train = {"pp": 2, "tp": 1, "dp": 4}
    plain = make(ActorRolloutRefWorker, ("actor_rollout",), generate={}, train=train)
    fsdp = make(ActorRolloutRefWorker, ("actor_rollout",), generate={"pp": 1, "tp": 1}, train=train, actor="fsdp")
    assert plain.layout is None and fsdp.rule_set.name == "fsdp"
    assert fsdp.layout.gen.dg == 2 and dict(fsdp.layout.mesh.shape) == {"pp_g": 1, "tp_g": 1, "dg": 2, "dp": 4}
    assert fsdp.layout.engine.chunked is not None
    assert per_device_shares(fsdp.state.params) == {8}
    before = [np.asarray(x) for x in jax.tree.leaves(fsdp.state.params)]
    greedy = prompt_batch(5, greedy=True, n=1)
    a, b = fsdp.generate_sequences(greedy), plain.generate_sequences(greedy)
    np.testing.assert_array_equal(a["responses"], b["responses"])
    np.testing.assert_allclose(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5)
    assert a["response_mask"].sum() > PROMPTS
    for x, y in zip(before, jax.tree.leaves(fsdp.state.params)):
        np.testing.assert_array_equal(x, np.asarray(y))
    gc.collect()
    assert not [x for x in jax.live_arrays()
                if getattr(x.sharding, "mesh", None) == fsdp.layout.mesh and not x.is_deleted()]


def test_critic_follows_critic_strategy():
    critic = make(CriticWorker, (), critic="fsdp2", actor="megatron")
    assert critic.rule_set.name == "fsdp_tp"
    assert per_device_shares(critic.state.params) == {8} == per_device_shares(critic.state.opt_state)


def test_bad_strategy_names_the_key():
    config = copy.deepcopy(BASE)
    config["actor"]["strategy"] = "zero3"
    with pytest.raises(WorkerConfigError, match=r"actor.strategy='zero3': unknown sharding rule set .*'fsdp_tp'"):
        ActorRolloutRefWorker._instantiate(WorkerContext("actor", "local", 0, 1), (config, "actor_rollout"), {})
