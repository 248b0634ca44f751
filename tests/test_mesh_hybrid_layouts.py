"""The 3D-HybridEngine from every training layout (``megatron``, ``fsdp``, ``fsdp_tp``) on 8 CPU devices, and its
chunked low-peak schedule (`jaxrl_hf.mesh.chunked_reshard`):

* containment: every device's generation shard contains its training shard, under the rule sets' axis orders;
* bytes each device receives, read from the compiled programs, equal the layout's formula
  ``M/(p_g·t_g) − S_train`` (``S_train = M/(p·t)`` megatron, ``M/(p·t·d)`` fsdp/fsdp_tp) exactly, for the chunked
  and the one-shot reshard; the all-gathers stay inside the devices sharing a generation shard;
* values: generation shards are the reference's slices, chunked == one-shot bit for bit, the round trip is exact
  and the way back has no collective;
* peak parameter bytes per device during either direction stay within 10% of the generation shard (compiled
  memory analysis, and the live arrays after every program), against 1.3-1.7x for the one-shot reshard.
"""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

from jaxrl_hf.mesh.chunked_reshard import plan_leaves
from jaxrl_hf.mesh.hybrid_engine import HybridEngine, delete_tree, shard_bytes_per_device
from jaxrl_hf.mesh.synthetic import llama_logical_axes, llama_param_shapes, llama_shape, param_bytes
from jaxrl_hf.mesh.topology import generation_rank_grid, parse_config
from jaxrl_hf.mesh.transition_report import analyze_transition, live_bytes_per_device

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")

SHAPE = llama_shape("tiny")  # 8 stacked layers
AXES = llama_logical_axes(SHAPE)
SHAPES = llama_param_shapes(SHAPE, np.float32)
M = param_bytes(SHAPES)
CASES = [("megatron", "2-2-2->1-1"), ("megatron", "1-8-1->1-4"),
         ("fsdp", "1-1-8->1-1"), ("fsdp", "2-1-4->1-1"), ("fsdp", "2-1-4->2-1"), ("fsdp", "4-1-2->2-1"),
         ("fsdp_tp", "1-2-4->1-1"), ("fsdp_tp", "1-2-4->1-2"), ("fsdp_tp", "2-2-2->1-2"), ("fsdp_tp", "1-4-2->1-2")]


@pytest.fixture(scope="module")
def reference():
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), SHAPES)


def formula_bytes(rule_set, gen):
    """Bytes received per device: generation shard minus training shard (module docstring)."""
    p, t, d = gen.train.pp, gen.train.tp, gen.train.dp
    train_shard = M / (p * t) if rule_set == "megatron" else M / (p * t * d)
    return M / (gen.pp * gen.tp) - train_shard


def shard_sharing_groups(gen):
    """Device groups holding the same generation shard: micro-DP x DP (ranks = device ids here)."""
    grid = generation_rank_grid(gen)
    return [set(row) for row in grid.reshape(gen.pp * gen.tp, -1).tolist()]


def place(tree, shardings):
    return jax.tree.map(jax.device_put, tree, shardings)


def contains(outer, inner, n):
    return all(o.indices(k)[0] <= i.indices(k)[0] and i.indices(k)[1] <= o.indices(k)[1]
               for o, i, k in zip(outer, inner, n))


def assert_generation_values(gen_params, reference):
    for ref, arr in zip(jax.tree.leaves(reference), jax.tree.leaves(gen_params)):
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index])


@pytest.mark.parametrize("rule_set, label", CASES, ids=[f"{r}:{c}" for r, c in CASES])
def test_bytes_equal_the_layout_formula_and_values_match(rule_set, label, reference):
    gen = parse_config(label)
    chunked = HybridEngine(gen, AXES, SHAPES, rule_set=rule_set)
    one_shot = HybridEngine(gen, AXES, SHAPES, rule_set=rule_set, layers_per_group=None)
    assert chunked.chunked is not None and one_shot.chunked is None

    # containment under the rule sets' axis orders
    for s, tr, gs in zip(jax.tree.leaves(SHAPES), jax.tree.leaves(chunked.train_shardings),
                         jax.tree.leaves(chunked.gen_shardings)):
        t_idx, g_idx = tr.devices_indices_map(s.shape), gs.devices_indices_map(s.shape)
        assert all(contains(g_idx[d], t_idx[d], s.shape) for d in t_idx), (rule_set, label, tr.spec, gs.spec)
    train_shard = shard_bytes_per_device(chunked.train_shardings, SHAPES)
    assert train_shard * gen.train.num_devices == M * (gen.train.dp if rule_set == "megatron" else 1)

    # compiled traffic: all-gathers only, inside the groups sharing a generation shard, bytes = formula
    sharing = shard_sharing_groups(gen)
    for engine in (chunked, one_shot):
        analysis = analyze_transition(engine, SHAPES)
        assert set(analysis.received_bytes.values()) == {formula_bytes(rule_set, gen)}
        assert analysis.collective_kinds == {"all-gather"}
        assert all(any(set(g) <= s for s in sharing) for g in analysis.device_groups())
        assert analyze_transition(engine, SHAPES, engine.training_phases()).collective_kinds == set()

    # values: chunked == one-shot == the reference's slices; the round trip is bit-identical
    a = chunked.to_generation(place(reference, chunked.train_shardings))
    b = one_shot.to_generation(place(reference, one_shot.train_shardings))
    assert_generation_values(a, reference)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.sharding == y.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    delete_tree(b)
    back = chunked.to_training(a)
    assert all(x.is_deleted() for x in jax.tree.leaves(a))
    for ref, arr, sh in zip(jax.tree.leaves(reference), jax.tree.leaves(back),
                            jax.tree.leaves(chunked.train_shardings)):
        assert arr.sharding == sh
        np.testing.assert_array_equal(np.asarray(arr), ref)
    delete_tree(back)


@pytest.mark.parametrize("rule_set, label", [("megatron", "1-4-2->1-2"), ("fsdp", "2-1-4->1-1"),
                                             ("fsdp_tp", "2-2-2->1-2")])
def test_chunked_peak_is_the_generation_shard(rule_set, label, reference):
    gen = parse_config(label)
    engine = HybridEngine(gen, AXES, SHAPES, rule_set=rule_set)
    gen_shard = shard_bytes_per_device(engine.gen_shardings, SHAPES)
    assert gen_shard == M // (gen.pp * gen.tp)

    # compiled programs: arguments + outputs + temporaries - aliased + params held beside them
    to_gen = analyze_transition(engine, SHAPES).peak_param_bytes_per_device
    to_train = analyze_transition(engine, SHAPES, engine.training_phases()).peak_param_bytes_per_device
    assert to_gen <= 1.10 * gen_shard and to_train <= 1.10 * gen_shard, (to_gen / gen_shard, to_train / gen_shard)
    one_shot = HybridEngine(gen, AXES, SHAPES, rule_set=rule_set, layers_per_group=None)
    before = analyze_transition(one_shot, SHAPES).peak_param_bytes_per_device
    assert before >= gen_shard + shard_bytes_per_device(engine.train_shardings, SHAPES)  # both layouts in full

    # live arrays after every program (before the leaf it consumed is freed)
    gc.collect()
    base = live_bytes_per_device()
    peaks = []

    def observe():
        live = live_bytes_per_device()
        peaks.append(max(live[d] - base.get(d, 0) for d in live))

    gen_params = engine.to_generation(place(reference, engine.train_shardings), observe)
    assert len(peaks) == len(engine.phases()) - sum(leaf.groups > 1 for leaf in engine.chunked.leaves)  # no allocs
    assert max(peaks) <= 1.10 * gen_shard, max(peaks) / gen_shard
    gc.collect()
    after = live_bytes_per_device()
    assert {after[d] - base.get(d, 0) for d in after} == {gen_shard}  # zero redundancy: nothing else is left
    peaks.clear()
    back = engine.to_training(gen_params, observe)
    assert max(peaks) <= 1.10 * gen_shard, max(peaks) / gen_shard
    np.testing.assert_array_equal(np.asarray(back["lm_head"]["kernel"]), reference["lm_head"]["kernel"])
    delete_tree(back)


def test_layers_per_group_option():
    gen = parse_config("1-4-2->1-2")
    rng = np.random.default_rng(3)
    ref = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), SHAPES)
    outs = []
    for layers_per_group in (1, 4):
        engine = HybridEngine(gen, AXES, SHAPES, layers_per_group=layers_per_group)
        stacked = [leaf for leaf in engine.chunked.leaves if leaf.shape[0] == SHAPE.layers and leaf.groups > 1]
        assert stacked and {leaf.groups for leaf in stacked} == {SHAPE.layers // layers_per_group}
        outs.append(engine.to_generation(place(ref, engine.train_shardings)))
    for x, y in zip(*map(jax.tree.leaves, outs)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    delete_tree(outs)
    with pytest.raises(ValueError, match=r"layers_per_group=3 does not divide the 4 layers .*valid: \[1, 2, 4\]"):
        HybridEngine(parse_config("2-2-2->1-2"), AXES, SHAPES, layers_per_group=3)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="layers_per_group=.*positive integer"):
            plan_leaves(None, None, AXES, SHAPES, bad)
