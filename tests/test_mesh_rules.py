"""Logical-axis rules -> PartitionSpec / NamedSharding trees (params, optimizer state, activations)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl_hf.mesh.device_mesh import build_hybrid_meshes
from jaxrl_hf.mesh.rule_sets import get_rule_set
from jaxrl_hf.mesh.hybrid_engine import shard_bytes_per_device
from jaxrl_hf.mesh.rules import (generation_activation_rules, generation_param_rules, logical_to_shardings,
                                 logical_to_spec, logical_to_specs, optimizer_state_shardings, train_activation_rules,
                                 train_param_rules)
from jaxrl_hf.mesh.synthetic import llama_logical_axes, llama_param_shapes, llama_shape, param_bytes
from jaxrl_hf.mesh.topology import all_configs, parse_config

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")


def test_llama_specs_megatron_layout():
    specs = logical_to_specs(llama_logical_axes(llama_shape("tiny")), train_param_rules())
    m = specs["model"]
    assert m["embed_tokens"]["embedding"] == P("tp", "pp")          # vocab over tp, embed fills pp
    assert m["layers"]["self_attn"]["q_proj"]["kernel"] == P("pp", None, "tp", None)
    assert m["layers"]["self_attn"]["o_proj"]["kernel"] == P("pp", "tp", None, None)
    assert m["layers"]["mlp"]["down_proj"]["kernel"] == P("pp", "tp", None)
    assert m["layers"]["input_layernorm"]["scale"] == P("pp", "tp")  # embed falls back to tp
    assert m["norm"]["scale"] == P(("pp", "tp"))
    assert specs["lm_head"]["kernel"] == P("pp", "tp")
    gen_specs = logical_to_specs(llama_logical_axes(llama_shape("tiny")), generation_param_rules())
    assert gen_specs["model"]["layers"]["mlp"]["up_proj"]["kernel"] == P("pp_g", None, "tp_g")


def test_one_dim_order_follows_the_transition():
    assert logical_to_spec(("embed",), train_param_rules(parse_config("2-2-2->1-2"))) == P(("tp", "pp"))
    assert logical_to_spec(("embed",), generation_param_rules(parse_config("2-2-2->1-2"))) == P(("tp_g", "pp_g"))
    assert logical_to_spec(("embed",), train_param_rules(parse_config("2-4-1->2-2"))) == P(("pp", "tp"))


@needs8
@pytest.mark.parametrize("gen", all_configs(8), ids=lambda g: f"{g.train.label()}->{g.pp}-{g.tp}")
def test_every_param_split_over_all_model_parallel_devices(gen):
    """Training shard = M/(p·t), generation shard = M/(p_g·t_g), FSDP shard = M/N on every device."""
    shape = llama_shape("tiny")
    axes, shapes = llama_logical_axes(shape), llama_param_shapes(shape, jnp.float32)
    meshes = build_hybrid_meshes(gen)
    M = param_bytes(shapes)
    train = logical_to_shardings(axes, meshes.train, train_param_rules(gen), shapes=shapes)
    gens = logical_to_shardings(axes, meshes.generation, generation_param_rules(gen), shapes=shapes)
    fsdp = logical_to_shardings(axes, meshes.train, get_rule_set("fsdp_tp").for_transition(gen).params, shapes=shapes)
    assert shard_bytes_per_device(train, shapes) * gen.train.model_parallel == M
    assert shard_bytes_per_device(gens, shapes) * gen.pp * gen.tp == M
    assert shard_bytes_per_device(fsdp, shapes) * gen.train.num_devices == M


def test_indivisible_dimension_names_the_param():
    shape = llama_shape("tiny")
    axes = llama_logical_axes(shape)
    shapes = llama_param_shapes(shape)
    shapes["model"]["layers"]["self_attn"]["k_proj"]["kernel"] = jax.ShapeDtypeStruct((8, 64, 3, 8), jnp.float32)

    class FakeMesh:  # only .shape is read by logical_to_specs
        shape = {"pp": 1, "tp": 4, "dp": 2}

    with pytest.raises(ValueError, match=r"model/layers/self_attn/k_proj/kernel: dimension 2 \(logical "
                                         r"'kv_heads', size 3\) is not divisible"):
        logical_to_specs(axes, train_param_rules(), shapes=shapes, mesh=FakeMesh())


def test_unknown_names_and_rank_mismatch_are_errors():
    with pytest.raises(ValueError, match=r"logical axis names \['experts'\] have no rule"):
        logical_to_spec(("experts", "embed"), train_param_rules(), name="moe/w")
    with pytest.raises(ValueError, match="have 2 entries but the array has shape"):
        logical_to_spec(("vocab", "embed"), train_param_rules(), shape=(4, 4, 4), axis_sizes={"pp": 1})
    with pytest.raises(ValueError, match="not in the mesh"):
        logical_to_spec(("vocab",), train_param_rules(), shape=(8,), axis_sizes={"x": 2})


@needs8
def test_optimizer_state_follows_params():
    gen = parse_config("2-2-2->1-2")
    shape = llama_shape("tiny")
    axes, shapes = llama_logical_axes(shape), llama_param_shapes(shape, jnp.float32)
    meshes = build_hybrid_meshes(gen)
    shardings = logical_to_shardings(axes, meshes.train, train_param_rules(gen), shapes=shapes)
    tx = optax.adamw(1e-3)
    state = jax.eval_shape(tx.init, shapes)
    state_sh = optimizer_state_shardings(state, shapes, shardings, meshes.train)
    adam = state_sh[0]
    assert adam.mu["model"]["layers"]["mlp"]["gate_proj"]["kernel"] == \
        shardings["model"]["layers"]["mlp"]["gate_proj"]["kernel"]
    assert adam.nu["lm_head"]["kernel"].spec == P("pp", "tp")
    assert adam.count.spec == P()
    # the shardings place a real optimizer state
    params = jax.tree.map(lambda s, sh: jax.device_put(jnp.zeros(s.shape, s.dtype), sh), shapes, shardings)
    placed = jax.jit(tx.init, out_shardings=state_sh)(params)
    assert placed[0].mu["model"]["norm"]["scale"].sharding == shardings["model"]["norm"]["scale"]
    with pytest.raises(ValueError, match="matches no parameter"):
        optimizer_state_shardings({"odd": jax.ShapeDtypeStruct((3, 5), jnp.float32)}, shapes, shardings,
                                  meshes.train)


@needs8
def test_activation_rules_work_with_flax_resolution():
    gen = parse_config("2-4-1->1-2")
    meshes = build_hybrid_meshes(gen)
    spec = nn.logical_to_mesh_axes(("batch", "length", "heads", "head_dim"),
                                   generation_activation_rules(meshes.dg_axes))
    assert spec == P(("dg_pp", "dg_tp", "dp"), None, "tp_g", None)
    x = jax.device_put(np.zeros((8, 3, 4, 2), np.float32), NamedSharding(meshes.generation, spec))
    assert x.addressable_shards[0].data.shape == (2, 3, 2, 2)  # batch over dg (4) x dp (1); heads over tp_g (2)
    assert nn.logical_to_mesh_axes(("batch", "length", "embed"), train_activation_rules()) == P("dp", None, None)
