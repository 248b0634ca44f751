"""The actor worker's three programs, lowered and compiled ahead of time on abstract arrays.

Every argument is a ``jax.ShapeDtypeStruct`` carrying its ``NamedSharding``: nothing is initialised or
allocated, so a 70B plan compiles on a laptop. The programs are the worker's own (one code path):

* ``update_actor``: `jaxrl_hf.workers.actor_programs.build_actor_update`'s step (the actor loss, micro-batch
  gradient accumulation by ``lax.scan``, clipping + AdamW) on one mini-batch of ``num_micro`` micro-batches
  shaped as the worker forms them (padded rows, token budget and/or packed: `jaxrl_hf.memory_plan.micro_batches`),
  the train state laid out by the actor's rule set (``actor.strategy``), donated as in the worker. With
  ``model.lora_rank > 0`` the state holds only the LoRA adapters and the frozen base is the step's ``frozen``
  argument, as in the worker (`jaxrl_hf.workers.lora_policy`).
* ``log_prob``: `jaxrl_hf.workers.actor_programs.log_probs_program` on one log-prob micro-batch (the
  ``rollout.log_prob_*`` pass), with the packed or padded forward the worker picks.
* ``generate``: one decode step of the native engine (`jaxrl_hf.rollout.jax_engine.decode_step`) on the
  generation layout (`jaxrl_hf.workers.generation_layout`; the training mesh when the layouts are equal), with a
  KV cache of ``max_prompt_length + response_length`` slots for the decode batch (`decode_batch`), the cache
  donated as the engine's while-loop carry is. Prefill is not planned.

Shapes are the padded ones the worker runs: ``T = rollout.max_prompt_length + rollout.response_length``, left-padded
to a multiple of the Ulysses size ``actor.ulysses_sequence_parallel_size`` (the ``sp`` mesh axis) in training.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from jaxrl_hf import mesh as meshlib
from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.memory_plan.micro_batches import PassShapes, pass_shapes, update_micro_count
from jaxrl_hf.mesh.rules import logical_to_spec
from jaxrl_hf.models import DecoderConfig, init_kv_cache, make_module, param_logical_axes, param_shapes
from jaxrl_hf.models.llama import KV_CACHE_LOGICAL_AXES
from jaxrl_hf.rollout.jax_engine import decode_step
from jaxrl_hf.workers.actor_programs import LOG_PROB_INPUTS, build_actor_update, log_probs_program
from jaxrl_hf.workers.common import (check_sequence_parallel_heads, lm_param_shardings, rows_sharding,
                                     train_parallel, train_rule_set)
from jaxrl_hf.workers.generation_layout import GenerationLayout, generation_parallel, jax_generation_placement
from jaxrl_hf.workers.lora_policy import LoraPolicy
from jaxrl_hf.workers.losses import lm_log_prob_fn
from jaxrl_hf.workers.minibatch import MiniBatchPlan
from jaxrl_hf.workers.packed_forward import packed_log_prob_fn
from jaxrl_hf.workers.token_batches import MicroBatching, actor_micro_batching, has_response_tokens



def abstract(shapes: Any, shardings: Any) -> Any:
    """``jax.ShapeDtypeStruct`` tree of ``shapes`` carrying ``shardings`` leaf by leaf."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def tree_bytes_per_device(tree: Any) -> int:
    """Largest per-device byte count of an abstract tree (leaves carry shardings)."""
    leaves = jax.tree.leaves(tree)
    return meshlib.shard_bytes_per_device([x.sharding for x in leaves], leaves)


@dataclasses.dataclass
class ActorLayout:
    """Meshes and param layout of the actor on the plan's devices, as the worker builds them."""

    config: RunConfig
    model: DecoderConfig
    devices: list[jax.Device]
    train: meshlib.TrainParallel
    rule_set: meshlib.RuleSet
    gen: meshlib.GenParallel | None
    mesh: jax.sharding.Mesh
    shapes: Any
    shardings: Any

    @classmethod
    def build(cls, config: RunConfig, model: DecoderConfig, devices: list[jax.Device]) -> "ActorLayout":
        """``placement.train`` (pp·tp·dp must be ``len(devices)``), ``actor.strategy`` and ``placement.generate``
        through the worker's own functions; errors name the keys."""
        train = train_parallel(config.placement, sp=config.actor.ulysses_sequence_parallel_size,
                               devices=len(devices))
        check_sequence_parallel_heads(model, train, "actor.ulysses_sequence_parallel_size")
        rule_set = train_rule_set(config, "actor", train)
        gen = generation_parallel(jax_generation_placement(config.placement, config.rollout.name), train,
                                  rule_set=rule_set)
        mesh = meshlib.build_train_mesh(train, devices)
        shapes = param_shapes(model)
        return cls(config, model, devices, train, rule_set, gen, mesh, shapes,
                   lm_param_shardings(model, shapes, mesh, gen, rule_set))

    @property
    def params(self) -> Any:
        return abstract(self.shapes, self.shardings)

    @property
    def seq_lengths(self) -> tuple[int, int]:
        """``(P, R)``: the rollout's prompt and response lengths."""
        return self.config.rollout.max_prompt_length, self.config.rollout.response_length

    @property
    def train_width(self) -> int:
        """Width of the token columns in training passes: ``P + R`` left-padded to a multiple of the Ulysses size
        (`jaxrl_hf.workers.common.pad_sequences_to`)."""
        return -(-sum(self.seq_lengths) // self.train.sp) * self.train.sp

    @property
    def dp_devices(self) -> int:
        """The ``dp`` mesh axis (rows are split over it): ``placement.train.dp / sp``."""
        return int(self.mesh.shape["dp"])


@dataclasses.dataclass
class CompiledProgram:
    """One compiled program, the shapes it was compiled for and its state bytes per device."""

    name: str
    compiled: Any
    shapes: dict[str, Any]
    param_bytes: int
    optimizer_bytes: int
    compile_s: float


def _compile(lowerable: Any, *args: Any, **kwargs: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    compiled = lowerable.lower(*args, **kwargs).compile()
    return compiled, time.perf_counter() - start


def _abstract_columns(columns: dict, lead: tuple[int, ...], devices: int, rows: int,
                      mesh: jax.sharding.Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract micro-batch columns ``lead + (D or D·r) + trailing``, rows over ``dp`` (`rows_sharding`)."""
    out = {}
    for key, (trailing, dtype, per_device) in columns.items():
        shape = (*lead, devices if per_device else devices * rows, *trailing)
        out[key] = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype),
                                        sharding=rows_sharding(mesh, len(shape), micro_axis=bool(lead)))
    return out


def _forward_fn(layout: ActorLayout, batching: MicroBatching) -> Any:
    """The pass's policy forward, as the worker picks it: packed or padded."""
    make = packed_log_prob_fn if batching.remove_padding else lm_log_prob_fn
    return make(layout.model, layout.mesh, layout.rule_set.activations)


def _shapes_report(shapes: PassShapes, batching: MicroBatching, columns: dict) -> dict[str, Any]:
    return {"rows_per_device": shapes.rows_per_device, "seq_len": shapes.width, "packed_length": shapes.packed_length,
            "by_tokens": batching.dynamic, "columns": sorted(columns)}


def update_actor_program(layout: ActorLayout) -> CompiledProgram:
    """The worker's ``update_actor`` step for one mini-batch (module docstring)."""
    config, mesh, devices = layout.config, layout.mesh, layout.dp_devices
    batching = actor_micro_batching(config)["update"]
    lora = LoraPolicy.from_config(config.model, layout.model, layout.params, layout.shardings, mesh,
                                  layout.rule_set.for_transition(layout.gen).params)
    shapes_, shardings_, frozen = layout.shapes, layout.shardings, ()
    if lora is not None:  # trained: the adapters; the base rides along as the frozen argument
        shapes_, shardings_ = jax.eval_shape(lambda: lora.init_adapters(0)), lora.adapter_shardings
        frozen = (None, layout.params)
    update = build_actor_update(config.actor, config.rollout.temperature, _forward_fn(layout, batching),
                                shapes_, shardings_, mesh, live_fn=has_response_tokens if batching.dynamic else None,
                                combine=lora.combine if lora is not None else None)
    opt_shapes = jax.eval_shape(update.optimizer.init, shapes_)
    opt_state = abstract(opt_shapes, update.state_shardings.opt_state)
    step = jax.ShapeDtypeStruct((), jnp.int32, sharding=update.state_shardings.step)
    trained = abstract(shapes_, shardings_)
    state = type(update.state_shardings)(trained, opt_state, step)
    actor = config.actor
    mini_rows = actor.ppo_mini_batch_size * config.rollout.n
    shapes = pass_shapes(batching, layout.train_width)
    by_rows = 1 if batching.dynamic else MiniBatchPlan.build(
        mini_rows, mini_batch_prompts=actor.ppo_mini_batch_size, samples_per_prompt=config.rollout.n,
        micro_per_device=shapes.rows_per_device, dp_devices=devices, dp_processes=1, where="actor").num_micro
    count = update_micro_count(batching, shapes, mini_rows, devices, by_rows)
    columns = shapes.columns(update.loss_cfg.required_keys(), layout.seq_lengths[1])
    micro = _abstract_columns(columns, (count,), devices, shapes.rows_per_device, mesh)
    compiled, seconds = _compile(update.step, state, micro, *frozen)
    report = {"num_micro": count, "micro_rows": devices * shapes.rows_per_device,
              **_shapes_report(shapes, batching, columns)}
    if lora is not None:
        report["lora"] = {"rank": lora.cfg.rank, "target_modules": list(lora.cfg.target_modules),
                          "adapter_bytes_per_device": tree_bytes_per_device(trained)}
    param_bytes = tree_bytes_per_device(layout.params) + (tree_bytes_per_device(trained) if lora is not None else 0)
    return CompiledProgram("update_actor", compiled, report, param_bytes, tree_bytes_per_device(opt_state), seconds)


def log_prob_program(layout: ActorLayout) -> CompiledProgram:
    """The worker's ``compute_log_prob`` program for one log-prob micro-batch (module docstring)."""
    config, mesh, devices = layout.config, layout.mesh, layout.dp_devices
    batching = actor_micro_batching(config)["log_prob"]
    shapes = pass_shapes(batching, layout.train_width)
    keys = (*LOG_PROB_INPUTS, "response_mask") if batching.active else LOG_PROB_INPUTS
    columns = shapes.columns(keys, layout.seq_lengths[1])
    micro = _abstract_columns(columns, (), devices, shapes.rows_per_device, mesh)
    temperature = jax.ShapeDtypeStruct((), jnp.float32)
    compiled, seconds = _compile(log_probs_program, layout.params, micro, temperature,
                                 log_prob_fn=_forward_fn(layout, batching))
    report = {"rows": devices * shapes.rows_per_device, **_shapes_report(shapes, batching, columns)}
    return CompiledProgram("log_prob", compiled, report, tree_bytes_per_device(layout.params), 0, seconds)


@dataclasses.dataclass(frozen=True)
class GenerationSetup:
    """The engine's mesh, activation rules and param shardings for one rollout."""

    mesh: jax.sharding.Mesh
    rules: Any
    param_shardings: Any
    label: str

    @property
    def replicas(self) -> int:
        """Generation replicas: the product of the mesh axes the ``batch`` logical axis is sharded over."""
        axes = logical_to_spec(("batch",), self.rules)[0]
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        return int(math.prod(self.mesh.shape[a] for a in names))


def generation_setup(layout: ActorLayout) -> GenerationSetup:
    """What the worker hands the native engine: the generation layout when ``placement.generate`` (or a
    dp-sharded rule set) asks for one, else the training mesh."""
    if layout.gen is None:
        return GenerationSetup(layout.mesh, layout.rule_set.activations, layout.shardings, layout.train.label())
    gl = GenerationLayout.build(layout.gen, param_logical_axes(layout.model), layout.shapes, layout.devices,
                                layout.rule_set)
    return GenerationSetup(gl.mesh, gl.activation_rules, gl.gen_shardings, gl.gen.label())


def kv_cache(model: DecoderConfig, setup: GenerationSetup, batch: int, cache_len: int) -> Any:
    """Abstract KV cache ``{"k","v"}: [layers, batch, kv_heads, cache_len, head_dim]`` in the compute dtype, laid
    out as the engine constrains it (the engine's cache on accelerators; on CPU devices a 16-bit cache is held as
    its uint16 bit patterns, the same bytes: ``rollout.jax_engine.cache_storage_dtype``)."""
    shapes = jax.eval_shape(lambda: init_kv_cache(model, batch, cache_len, model.dtype))
    sharding = NamedSharding(setup.mesh, logical_to_spec(KV_CACHE_LOGICAL_AXES, setup.rules))
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)


def generate_program(layout: ActorLayout, setup: GenerationSetup, batch_per_replica: int) -> CompiledProgram:
    """One decode step for ``batch_per_replica`` sequences on each generation replica (module docstring)."""
    model = layout.model
    prompt_len, response_len = layout.seq_lengths
    cache_len, batch = prompt_len + response_len, batch_per_replica * setup.replicas
    module = make_module(model, setup.mesh, setup.rules)
    rows = NamedSharding(setup.mesh, logical_to_spec(("batch",), setup.rules))
    rows2 = NamedSharding(setup.mesh, logical_to_spec(("batch", None), setup.rules))
    params = abstract(layout.shapes, setup.param_shardings)
    cache = kv_cache(model, setup, batch, cache_len)
    args = (params, cache, jax.ShapeDtypeStruct((batch, cache_len), jnp.int32, sharding=rows2),
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows), jax.ShapeDtypeStruct((batch,), jnp.int32,
                                                                                         sharding=rows),
            jax.ShapeDtypeStruct((), jnp.int32))
    program = jax.jit(functools.partial(decode_step, module=module), donate_argnums=(1,))
    compiled, seconds = _compile(program, *args)
    shapes = {"decode_batch": batch, "decode_batch_per_replica": batch_per_replica, "replicas": setup.replicas,
              "cache_len": cache_len, "layout": setup.label,
              "kv_cache_bytes_per_device": tree_bytes_per_device(cache)}
    return CompiledProgram("generate", compiled, shapes, tree_bytes_per_device(params), 0, seconds)
