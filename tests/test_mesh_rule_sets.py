"""Named sharding rule sets (mesh/rule_sets.py) through the one resolver (mesh/rules.py).

* ``megatron`` reproduces the layout the training, generation and rollout code used before rule sets existed,
  PartitionSpec by PartitionSpec (tiny and 7B-shaped abstract models, every 8-device transition);
* ``fsdp`` / ``fsdp_tp`` shard every large param and its Adam moments over ``dp`` (per-device bytes ~ 1/dp);
* the real jitted train step gives the same loss and grad norm under megatron, fsdp and fsdp_tp, and the fsdp
  step's compiled HLO gathers params and reduce-scatters grads;
* the 3D-HybridEngine reshard from an fsdp_tp training layout gives the right values;
* ``actor.strategy`` / ``critic.strategy`` select the rule set (``fsdp``/``fsdp2`` aliases, the tp and
  sequence-parallel variants), bad names and undeclared mesh axes are errors naming the key; the sequence-parallel
  variants put the sequence on ``sp`` outside attention and the heads inside it.
"""

from __future__ import annotations

import functools
import pickle

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from _models_helpers import random_params, tiny_config
from jaxrl_hf.config import ConfigError, load_config
from jaxrl_hf.config.build import build_dataclass
from jaxrl_hf.config.schema import ActorConfig, OptimConfig, RunConfig
from jaxrl_hf.mesh.device_mesh import build_hybrid_meshes, build_train_mesh, flat_device_ids
from jaxrl_hf.mesh.hlo_collectives import summarize
from jaxrl_hf.mesh.hybrid_engine import HybridEngine, delete_tree, shard_bytes_per_device
from jaxrl_hf.mesh.rule_sets import (FSDP, FSDP_SP, FSDP_TP, FSDP_TP_SP, MEGATRON, SP, RuleSet, get_rule_set,
                                     register_rule_set)
from jaxrl_hf.mesh.rules import logical_to_shardings, logical_to_spec, logical_to_specs, train_activation_rules
from jaxrl_hf.mesh.synthetic import LlamaShape, llama_logical_axes, llama_param_shapes, llama_shape, param_bytes
from jaxrl_hf.mesh.topology import GenParallel, TrainParallel, all_configs, parse_config, training_sp_groups
from jaxrl_hf.models import DecoderConfig, init_params, param_logical_axes, param_shardings
from jaxrl_hf.workers.common import WorkerConfigError, lm_param_shardings, train_rule_set
from jaxrl_hf.workers.losses import (ACTOR_SUMMED_METRICS, actor_loss, actor_loss_config, lm_log_prob_fn,
                                     response_denominator)
from jaxrl_hf.workers.optim import make_optimizer
from jaxrl_hf.workers.train_step import init_train_state, make_train_step, train_state_shardings

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")

SHAPE_7B = LlamaShape(vocab=32000, embed=4096, mlp=11008, heads=32, kv_heads=32, head_dim=128, layers=32,
                      tied_embeddings=False)
CONFIG_7B = DecoderConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, head_dim=128)


def reference_train_rules(gen: GenParallel | None, pp: str = "pp", tp: str = "tp"):
    """The param rules as the code wrote them before rule sets (a function building tuples), kept verbatim as the
    reference the declared ``megatron`` data must reproduce."""
    if gen is None or gen.pp_stride == 1 or gen.tp == 1:
        order = ("pp", "tp")
    elif gen.tp_stride == 1 or gen.pp == 1:
        order = ("tp", "pp")
    else:
        order = None
    names = {"pp": pp, "tp": tp}
    one_dim = (("embed", tuple(names[o] for o in order)),) if order else ()
    return ((("layers", pp), ("vocab", tp), ("heads", tp), ("kv_heads", tp), ("mlp", tp))
            + one_dim + (("embed", pp), ("embed", tp), ("head_dim", None)))


def reference_activation_rules(batch, tp):
    """Today's activation rules, plus the names inside attention (the same layout there without sp)."""
    return (("batch", batch), ("length", None), ("embed", None), ("heads", tp), ("kv_heads", tp),
            ("head_dim", None), ("mlp", tp), ("vocab", tp), ("layers", None),
            ("attn_length", None), ("attn_heads", tp), ("attn_kv_heads", tp))


def abstract_models():
    """(name, logical axes, shapes) of the tiny and 7B-shaped synthetic models and the 7B decoder of models/."""
    yield "tiny", llama_logical_axes(llama_shape("tiny")), llama_param_shapes(llama_shape("tiny"), jnp.float32)
    yield "7b", llama_logical_axes(SHAPE_7B), llama_param_shapes(SHAPE_7B)
    shapes = jax.eval_shape(functools.partial(init_params, CONFIG_7B, 0))
    yield "7b-decoder", param_logical_axes(CONFIG_7B), shapes


def assert_same_specs(a, b):
    la = jax.tree.leaves(a, is_leaf=lambda x: isinstance(x, P))
    lb = jax.tree.leaves(b, is_leaf=lambda x: isinstance(x, P))
    assert len(la) == len(lb) and la, (len(la), len(lb))
    for x, y in zip(la, lb):
        assert x == y, (x, y)


# ------------------------------------------------------------------------------------------ megatron = today
def test_megatron_rules_are_todays_rules():
    for gen in [None, *all_configs(8), parse_config("4-4-1->2-2")]:
        assert MEGATRON.for_transition(gen).params == reference_train_rules(gen)
        assert MEGATRON.for_transition(gen).on_generation_mesh().params == reference_train_rules(gen, "pp_g", "tp_g")
    assert MEGATRON.activations == reference_activation_rules("dp", "tp")
    assert MEGATRON.on_generation_mesh(("dg_pp", "dg_tp")).activations == \
        reference_activation_rules(("dg_pp", "dg_tp", "dp"), "tp_g")


@needs8
@pytest.mark.parametrize("gen", all_configs(8), ids=lambda g: f"{g.train.label()}->{g.pp}-{g.tp}")
def test_megatron_reproduces_todays_shardings_leaf_by_leaf(gen):
    meshes = build_hybrid_meshes(gen)
    for _, axes, shapes in abstract_models():
        for rules, mesh, derived in ((reference_train_rules(gen), meshes.train, MEGATRON.for_transition(gen).params),
                                     (reference_train_rules(gen, "pp_g", "tp_g"), meshes.generation,
                                      MEGATRON.for_transition(gen).on_generation_mesh().params)):
            assert_same_specs(logical_to_specs(axes, derived, shapes=shapes, mesh=mesh),
                              logical_to_specs(axes, rules, shapes=shapes, mesh=mesh))
    engine = HybridEngine(gen, llama_logical_axes(llama_shape("tiny")),
                          llama_param_shapes(llama_shape("tiny"), jnp.float32))
    expected = logical_to_specs(llama_logical_axes(llama_shape("tiny")), reference_train_rules(gen),
                                shapes=llama_param_shapes(llama_shape("tiny")), mesh=meshes.train)
    assert_same_specs(jax.tree.map(lambda s: s.spec, engine.train_shardings), expected)


@needs8
def test_model_param_shardings_equal_flax_resolution():
    """models.param_shardings (the rollout engine's placement) now goes through the mesh/ resolver; for the
    activation rules it is handed it gives what flax's ``logical_to_mesh_axes`` gave."""
    config = tiny_config(vocab_size=96)
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("dp", "tp"))
    ours = param_shardings(config, mesh, train_activation_rules())
    flax_specs = jax.tree.map(lambda spec: nn.logical_to_mesh_axes(tuple(spec), train_activation_rules()),
                              param_logical_axes(config), is_leaf=lambda x: isinstance(x, P))
    assert_same_specs(jax.tree.map(lambda s: s.spec, ours), flax_specs)
    for names in (("batch", "length", "heads", "head_dim"), ("layers", "batch", "length", "kv_heads", "head_dim")):
        assert logical_to_spec(names, train_activation_rules()) == nn.logical_to_mesh_axes(names,
                                                                                            train_activation_rules())


# ------------------------------------------------------------------------------------------ fsdp memory
@needs8
@pytest.mark.parametrize("rule_set,train", [(FSDP, TrainParallel(1, 1, 8)), (FSDP_TP, TrainParallel(1, 2, 4)),
                                            (FSDP_TP, TrainParallel(2, 2, 2))], ids=["fsdp-1-1-8", "fsdp_tp-1-2-4",
                                                                                     "fsdp_tp-2-2-2"])
def test_fsdp_shards_params_and_adam_moments_over_dp(rule_set, train):
    mesh = build_train_mesh(train)
    megatron_mesh_share, n = train.pp * train.tp, train.num_devices
    for name, axes, shapes in abstract_models():  # abstract: 7B bytes from shapes alone
        zero3 = logical_to_shardings(axes, mesh, rule_set.params, shapes=shapes)
        megatron = logical_to_shardings(axes, mesh, MEGATRON.params, shapes=shapes)
        m = param_bytes(shapes)
        assert shard_bytes_per_device(zero3, shapes) * n == m, name
        assert shard_bytes_per_device(megatron, shapes) * megatron_mesh_share == m, name
        for spec in jax.tree.leaves(jax.tree.map(lambda s: s.spec, zero3), is_leaf=lambda x: isinstance(x, P)):
            assert any("dp" in (e if isinstance(e, tuple) else (e,)) for e in spec), (name, spec)
    # a real decoder and its Adam moments, placed: every large leaf holds 1/N of its bytes on each device
    config = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=16, num_hidden_layers=2)
    params = random_params(config, 0)
    shardings = lm_param_shardings(config, params, mesh, rule_set=rule_set)
    placed = jax.device_put(params, shardings)
    optimizer = make_optimizer(OptimConfig(lr=1e-3), grad_clip=1.0)
    state_sh = train_state_shardings(placed, shardings, optimizer, mesh)
    state = jax.jit(lambda p: init_train_state(p, optimizer), out_shardings=state_sh)(placed)
    for label, tree in (("params", state.params), ("optimizer state", state.opt_state)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            per_device = {s.data.nbytes for s in leaf.addressable_shards}
            if leaf.nbytes >= 1024:  # norms are tiny; every matrix (and its Adam moments) is split N ways
                assert per_device == {leaf.nbytes // n}, (label, jax.tree_util.keystr(path), per_device)


# ------------------------------------------------------------------------------------------ the real train step
def _step_inputs(config, rows=8, prompt=5, response=4, micro=2, seed=0):
    rng = np.random.default_rng(seed)
    width = prompt + response
    ids = rng.integers(3, config.vocab_size, (rows, width)).astype(np.int32)
    attn = np.ones((rows, width), np.int32)
    attn[::3, :2] = 0  # left padding on some rows
    mask = np.ones((rows, response), np.int32)
    mask[1, 2:] = 0
    data = dict(input_ids=ids, attention_mask=attn,
                position_ids=np.maximum(np.cumsum(attn, axis=1) - 1, 0).astype(np.int32),
                responses=ids[:, prompt:], response_mask=mask,
                advantages=rng.normal(size=(rows, response)).astype(np.float32),
                old_log_probs=(-np.log(config.vocab_size) + rng.normal(0, 0.2, (rows, response))).astype(np.float32))
    return {k: v.reshape(micro, rows // micro, *v.shape[1:]) for k, v in data.items()}


STEP_CONFIG = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_hidden_layers=2)


def _train_step_on(rule_set: RuleSet, train: TrainParallel):
    """(state, micro-batches, jitted step) for the tiny decoder on the first 4 devices under ``rule_set``."""
    mesh = build_train_mesh(train, jax.devices()[:train.num_devices])
    params = random_params(STEP_CONFIG, 3)
    shardings = lm_param_shardings(STEP_CONFIG, params, mesh, rule_set=rule_set)
    optim = OptimConfig(lr=1e-3)
    optimizer = make_optimizer(optim, grad_clip=1.0)
    state_sh = train_state_shardings(params, shardings, optimizer, mesh)
    state = jax.jit(lambda p: init_train_state(p, optimizer), out_shardings=state_sh)(jax.device_put(params, shardings))
    cfg = actor_loss_config(ActorConfig(), temperature=1.0)
    loss_fn = functools.partial(actor_loss, log_prob_fn=lm_log_prob_fn(STEP_CONFIG, mesh, rule_set.activations), cfg=cfg)
    step = make_train_step(loss_fn, optim, optimizer=optimizer, denominator_fn=response_denominator(cfg.loss_agg_mode),
                           summed_aux=ACTOR_SUMMED_METRICS, state_shardings=state_sh, donate=False)
    rows = NamedSharding(mesh, P(None, "dp"))
    micro = {k: jax.device_put(v, rows) for k, v in _step_inputs(STEP_CONFIG).items()}
    return state, micro, step


@needs8
def test_train_step_same_loss_and_grad_norm_under_every_layout():
    results = {}
    for label, rule_set, train in (("megatron dp4", MEGATRON, TrainParallel(1, 1, 4)),
                                   ("fsdp dp4", FSDP, TrainParallel(1, 1, 4)),
                                   ("fsdp_tp dp2 x tp2", FSDP_TP, TrainParallel(1, 2, 2))):
        state, micro, step = _train_step_on(rule_set, train)
        new_state, metrics = step(state, micro)
        results[label] = (float(metrics["loss"]), float(metrics["grad_norm"]))
        assert new_state.params["model"]["layers"]["mlp"]["up_proj"]["kernel"].sharding == \
            state.params["model"]["layers"]["mlp"]["up_proj"]["kernel"].sharding  # the layout is kept
    loss, grad_norm = results["megatron dp4"]
    assert grad_norm > 0 and loss != 0
    for label, (other_loss, other_norm) in results.items():
        np.testing.assert_allclose(other_loss, loss, rtol=1e-5, err_msg=label)
        np.testing.assert_allclose(other_norm, grad_norm, rtol=1e-5, err_msg=label)


@needs8
def test_fsdp_step_gathers_params_and_reduce_scatters_grads():
    """The compiled fsdp step all-gathers every param from its dp shards (the LM head may instead be applied on its
    shard, the logits split over the vocabulary: no gather of it) and reduces the gradients over the dp group into
    shards: a reduce-scatter where XLA forms one (GPU/TPU); the CPU backend has no reduce-scatter pass and emits the
    same reduction as an all-reduce whose result is sliced into the sharded gradient buffers. Its per-device state
    (params + Adam moments) is ~1/dp of megatron's (compiled memory analysis)."""
    devices = [d.id for d in jax.devices()[:4]]
    summaries, arguments = {}, {}
    for label, rule_set in (("megatron", MEGATRON), ("fsdp", FSDP)):
        state, micro, step = _train_step_on(rule_set, TrainParallel(1, 1, 4))
        compiled = step.lower(state, micro).compile()
        summaries[label] = summarize(compiled.as_text(), devices)
        arguments[label] = compiled.memory_analysis().argument_size_in_bytes
    m = param_bytes(state.params)
    layer_bytes = param_bytes(state.params["model"]["layers"]) // STEP_CONFIG.num_hidden_layers
    fsdp, megatron = summaries["fsdp"], summaries["megatron"]

    def gathered(summary):
        return sum(op.received_bytes(0) for op in summary.ops if op.kind == "all-gather")

    head = param_bytes(state.params["lm_head"])
    assert gathered(fsdp) >= (m - head) * 3 / 4 > gathered(megatron), (gathered(fsdp), gathered(megatron), m, head)
    assert fsdp.device_groups("all-gather") >= {tuple(devices)}
    if "reduce-scatter" in fsdp.kinds:
        assert fsdp.device_groups("reduce-scatter") == {tuple(devices)}
    else:  # CPU: all-reduce of one layer's full gradients at a time inside the backward layer scan
        assert max(op.result_bytes for op in fsdp.ops if op.kind == "all-reduce") >= layer_bytes
        assert tuple(devices) in fsdp.device_groups("all-reduce")
    assert arguments["fsdp"] < arguments["megatron"] * 0.4, arguments  # 3M/4 per device vs 3M (+ the batch)


# ------------------------------------------------------------------------------------------ 3D-HybridEngine
@needs8
@pytest.mark.parametrize("label", ["1-4-2->1-2", "2-2-2->1-2", "1-2-4->1-1"])
def test_hybrid_engine_reshards_an_fsdp_layout_exactly(label):
    """From the fsdp_tp training layout (sharded over dp too) the reshard still lands every generation shard on
    the reference's values and slices the training shards back bit-identically (the byte-exact traffic per
    layout is checked in test_mesh_hybrid_layouts.py)."""
    gen = parse_config(label)
    axes, shapes = llama_logical_axes(llama_shape("tiny")), llama_param_shapes(llama_shape("tiny"), np.float32)
    engine = HybridEngine(gen, axes, shapes, rule_set="fsdp_tp")
    assert shard_bytes_per_device(engine.train_shardings, shapes) * gen.train.num_devices == param_bytes(shapes)
    megatron = HybridEngine(gen, axes, shapes)
    assert jax.tree.leaves(engine.gen_shardings) == jax.tree.leaves(megatron.gen_shardings)
    rng = np.random.default_rng(0)
    reference = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
    train = jax.tree.map(jax.device_put, reference, engine.train_shardings)
    gen_params = engine.to_generation(train)
    for ref, arr in zip(jax.tree.leaves(reference), jax.tree.leaves(gen_params)):
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), ref[shard.index])
    back = engine.to_training(gen_params)
    for ref, arr, sh in zip(jax.tree.leaves(reference), jax.tree.leaves(back), jax.tree.leaves(engine.train_shardings)):
        assert arr.sharding == sh
        np.testing.assert_array_equal(np.asarray(arr), ref)
    delete_tree(back)


# ------------------------------------------------------------------------------------------ sp, config, errors
@needs8
def test_sp_rule_sets_shard_the_sequence_outside_attention_and_the_heads_inside():
    """On the training mesh ``('pp','tp','dp','sp')`` (sp minor-most, the flat order of ``('pp','tp','dp·sp')``)
    the sequence-parallel variants put ``length`` on ``sp`` outside attention and the heads on ``(tp, sp)`` inside
    it; params over dp go over ``(dp, sp)``; generation drops sp (megatron's generation layout)."""
    train = TrainParallel(1, 2, 4, sp=2)
    mesh = build_train_mesh(train)
    assert mesh.axis_names == ("pp", "tp", "dp", "sp") and dict(mesh.shape) == {"pp": 1, "tp": 2, "dp": 2, "sp": 2}
    assert flat_device_ids(mesh) == flat_device_ids(build_train_mesh(TrainParallel(1, 2, 4)))
    # an sp group: consecutive data-parallel ranks, i.e. ranks p·t apart; the mesh's sp axis holds exactly them
    assert training_sp_groups(train) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    along_sp = np.vectorize(lambda d: d.id)(mesh.devices).reshape(-1, 2)
    assert sorted(tuple(sorted(g)) for g in along_sp.tolist()) == training_sp_groups(train)
    with pytest.raises(ValueError, match="TrainParallel.sp=3 must divide dp=4"):
        TrainParallel(1, 2, 4, sp=3)
    sizes = dict(mesh.shape)
    spec = logical_to_spec(("batch", "length", "heads", "head_dim"), SP.activations, shape=(4, 16, 4, 8),
                           axis_sizes=sizes)
    assert spec == P("dp", "sp", "tp", None)
    inside = logical_to_spec(("batch", "attn_length", "attn_heads", "head_dim"), SP.activations, shape=(4, 16, 4, 8),
                             axis_sizes=sizes)
    assert inside == P("dp", None, ("tp", "sp"), None)
    x = jax.device_put(np.zeros((4, 16, 4, 8), np.float32), NamedSharding(mesh, spec))
    assert x.addressable_shards[0].data.shape == (2, 8, 2, 8)
    assert SP.params == MEGATRON.params and "sp" in SP.mesh_axes() and "sp" not in SP.param_mesh_axes()
    assert dict(SP.on_generation_mesh().activations) == dict(MEGATRON.on_generation_mesh().activations)
    assert [a for n, a in FSDP_SP.params if n == "embed"] == [("pp", "dp", "sp"), ("dp", "sp")]  # ZeRO-3 over dp×sp
    assert dict(FSDP_TP_SP.on_generation_mesh().params) == dict(FSDP_TP.on_generation_mesh().params)
    assert dict(FSDP_SP.activations)["attn_heads"] == "sp" and dict(FSDP_SP.activations)["batch"] == "dp"


def _rule_set(config: dict, role: str, train: TrainParallel):
    """`train_rule_set` of the typed config built from ``config`` (the schema's defaults elsewhere)."""
    return train_rule_set(build_dataclass(RunConfig, config), role, train)


def test_strategy_selects_the_rule_set():
    one, two = TrainParallel(1, 1, 8), TrainParallel(1, 2, 4)
    assert _rule_set({}, "actor", one) is MEGATRON  # the schema's default
    assert _rule_set({"actor": {"strategy": "fsdp"}}, "actor", one) is FSDP
    assert _rule_set({"actor": {"strategy": "fsdp2"}}, "actor", one) is FSDP
    assert _rule_set({"actor": {"strategy": "fsdp"}}, "actor", two) is FSDP_TP  # tp > 1: fsdp + tp
    assert _rule_set({"actor": {"strategy": "fsdp_tp"}}, "ref", two) is FSDP_TP
    assert _rule_set({"actor": {"strategy": "fsdp"}, "critic": {}}, "critic", one) is MEGATRON
    assert _rule_set({"critic": {"strategy": "fsdp2"}}, "critic", one) is FSDP
    sp, tp_sp = TrainParallel(1, 1, 8, sp=2), TrainParallel(1, 2, 4, sp=4)  # Ulysses: the sequence-parallel variants
    assert _rule_set({}, "actor", sp) is SP and _rule_set({"actor": {"strategy": "fsdp2"}}, "ref", sp) is FSDP_SP
    assert _rule_set({"critic": {"strategy": "fsdp"}}, "critic", tp_sp) is FSDP_TP_SP
    assert _rule_set({"actor": {"strategy": "fsdp_sp"}}, "actor", tp_sp) is FSDP_TP_SP
    with pytest.raises(WorkerConfigError, match=r"actor.strategy='zero9': unknown sharding rule set 'zero9'; "
                                                r"valid names: \['fsdp', 'fsdp2', 'fsdp_sp', 'fsdp_tp', 'fsdp_tp_ep', "
                                                r"'fsdp_tp_sp', 'megatron', 'sp'\]"):
        _rule_set({"actor": {"strategy": "zero9"}}, "actor", one)
    with pytest.raises(WorkerConfigError, match=r"critic.strategy='sp': rule set 'sp' shards over mesh axes \['sp'\]"):
        _rule_set({"critic": {"strategy": "sp"}}, "critic", one)


def test_strategy_is_a_config_key():
    cfg = load_config("ppo", overrides=["actor_rollout_ref.actor.strategy=fsdp", "critic.strategy=fsdp_tp"])
    assert (cfg.actor.strategy, cfg.critic.strategy) == ("fsdp", "fsdp_tp")
    assert load_config("grpo").actor.strategy == MEGATRON.name
    for key in ("actor_rollout_ref.actor.strategy", "critic.strategy"):  # validated from RULE_SETS with the config
        with pytest.raises(ConfigError, match=r"'(actor|critic)\.strategy'='zero9': not a registered sharding rule "
                                              r"set; valid names: \['fsdp', 'fsdp2', 'fsdp_sp', 'fsdp_tp', "
                                              r"'fsdp_tp_ep', 'fsdp_tp_sp', 'megatron', 'sp'\]"):
            load_config("ppo", overrides=[f"{key}=zero9"])


def test_registry_and_divisibility_errors_name_the_rule_set():
    with pytest.raises(ValueError, match="sharding rule set 'megatron' is already registered"):
        register_rule_set(RuleSet("megatron", FSDP.params, FSDP.activations, "a typo must not replace megatron"))
    assert get_rule_set("megatron") is MEGATRON
    copied = pickle.loads(pickle.dumps(FSDP_TP))  # rule sets travel to worker processes with their names
    assert copied == FSDP_TP and copied.params.name == FSDP_TP.params.name == "'fsdp_tp' params"

    class FakeMesh:  # only .shape is read by logical_to_specs
        shape = {"pp": 1, "tp": 1, "dp": 8}

    shape = llama_shape("tiny")
    shapes = llama_param_shapes(shape)
    shapes["model"]["norm"]["scale"] = jax.ShapeDtypeStruct((12,), jnp.float32)
    with pytest.raises(ValueError, match=r"rule set 'fsdp' params: model/norm/scale: dimension 0 \(logical 'embed', "
                                         r"size 12\) is not divisible by any mesh axes a rule allows: "
                                         r"\('pp', 'dp'\) \(size 8\), \('dp',\) \(size 8\)"):
        logical_to_specs(llama_logical_axes(shape), FSDP.params, shapes=shapes, mesh=FakeMesh())
