"""`plan_memory`: the per-device memory of a run's actor programs before renting a GPU (MaxText's
``train_compile.py``, for RL): verl's keys in, a compiled plan out.

Backend: the plan compiles with whatever XLA backend JAX has; this package ships none but XLA:CPU with
``--xla_force_host_platform_device_count=N`` simulated devices (no jax CUDA plugin is installed, so XLA:GPU
deviceless compilation is not reachable). How CPU numbers relate to a GPU's: sharding, SPMD partitioning, buffer
assignment and liveness are XLA-generic, so param, optimizer, argument and output bytes are exact and the
collectives are those the partitioner inserts (XLA:CPU forms no reduce-scatter: a gradient reduced into its
shards shows as an all-reduce whose result only the shard keeps, and bf16 collectives run in f32); temp bytes
can differ, since XLA:GPU fuses differently and ``model.attn_implementation=auto`` takes cuDNN's fused attention
there where the plan compiles the blockwise one (both O(T) memory; `plan_attention`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxrl_hf import mesh as meshlib
from jaxrl_hf.config import load_config
from jaxrl_hf.config.build import ConfigError, coerce
from jaxrl_hf.config.memory_budget import DEFAULT_VLLM_GPU_SHARE, memory_budget
from jaxrl_hf.config.run_length import with_total_steps
from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.config.schema_trainer import DEFAULT_TOTAL_STEPS
from jaxrl_hf.memory_plan import programs as P
from jaxrl_hf.memory_plan.cost_model import cost_model_inputs, predict
from jaxrl_hf.memory_plan.report import collective_counts, memory_stats
from jaxrl_hf.memory_plan.verl_keys import PlanKeys, classify_keys
from jaxrl_hf.models.attention import cudnn_usable
from jaxrl_hf.models.known_configs import known_decoder_config
from jaxrl_hf.workers.common import WorkerConfigError, train_parallel, train_rule_set
from jaxrl_hf.workers.generation_layout import generation_parallel, jax_generation_placement

# The plan's defaults, applied before the user's keys, are verl's (the keys plan verl commands as written):
# the FSDP strategy, computing in bf16 over float32 params; and, where the algorithm YAMLs size theirs for a small
# CPU host, a generation batch of data.train_batch_size prompts and one sequence per device per micro-batch.
PLAN_DEFAULTS = ("actor.strategy=fsdp", "model.dtype=bfloat16", "data.gen_batch_size=null",
                 "actor.ppo_micro_batch_size_per_device=1",
                 # scoring changes no program; off, so a planned response shorter than the recipe's buffer is valid
                 "reward_model.overlong_buffer.enable=false")
DEFAULT_DEVICE_MEMORY = 80 * 2 ** 30


def parse_bytes(text: str) -> int:
    """``"80GiB"``, ``"80GB"``, ``"1.5TiB"``, ``"85899345920"`` -> bytes; ``ValueError`` naming the text."""
    units = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12, "kib": 2 ** 10,
             "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}
    s = str(text).strip().lower().replace(" ", "")
    number = s.rstrip("kmgtib")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = None
    if value is None or unit not in units or value <= 0:
        raise ValueError(f"--device-memory {text!r}: expected a positive size such as 80GiB, 80GB or 85899345920")
    return int(value * units[unit])


def _cluster_overrides(keys: PlanKeys, devices: int) -> list[str]:
    """``trainer.nnodes`` × ``trainer.n_gpus_per_node`` must be ``devices`` when given; else one node of them."""
    nnodes, per_node = (keys.raw_value(k) for k in ("trainer.nnodes", "trainer.n_gpus_per_node"))
    if nnodes is None and per_node is None:
        return ["trainer.nnodes=1", f"trainer.n_gpus_per_node={devices}"]
    try:
        product = int(nnodes or 1) * int(per_node or 1)
    except ValueError:
        raise ValueError(f"trainer.nnodes={nnodes!r} / trainer.n_gpus_per_node={per_node!r}: not integers") from None
    if product != devices:
        raise ValueError(f"trainer.nnodes × trainer.n_gpus_per_node = {nnodes or 1} × {per_node or 1} = {product}, "
                         f"but --devices is {devices}")
    return []


def _check_generation_layout(config: RunConfig) -> None:
    """Raise `WorkerConfigError` when the worker would reject ``placement.generate`` over ``placement.train``."""
    t = config.placement.train
    train = train_parallel(config.placement, sp=config.actor.ulysses_sequence_parallel_size,
                           devices=t.pp * t.tp * t.dp)
    generation_parallel(jax_generation_placement(config.placement, config.rollout.name), train,
                        rule_set=train_rule_set(config, "actor", train))


def _runnable_layout(keys: PlanKeys) -> list[tuple[str, str]]:
    """The overrides, each with why, that turn a verl layout this framework rejects into the nearest one it runs
    (applied only after the loader or the worker rejected the layout as given; none when no such fix applies):

    * a rollout TP (``placement.generate.tp``, verl's ``rollout.tensor_model_parallel_size``) that does not divide
      ``placement.train.tp`` with the native engine (vLLM's TP is free of it: `jaxrl_hf.rollout.vllm_tp`): the
      3D-HybridEngine generates
      with ``tp_g | tp``, so the training tp is raised to it (ZeRO-3's ``fsdp`` resolves to ``fsdp_tp``: params still
      over every device) and each Ulysses size divided by the same factor, so a sequence still spans ``tp·sp``
      devices (the attention heads split over ``tp·sp``);
    * packed rows (``model.use_remove_padding``) with Ulysses ``sp > 1``, not supported together yet: packing off;
      with ``actor.use_dynamic_bsz`` the micro-batches keep their token budget as padded rows (the same tokens per
      device for full-length rows)."""
    def number(key: str, default: str) -> int | None:
        try:
            return int(keys.raw_value(key) or default)
        except ValueError:
            return None

    out: list[tuple[str, str]] = []
    sp = {k: number(k, "1") for k in ("actor.ulysses_sequence_parallel_size", "ref.ulysses_sequence_parallel_size")
          if keys.raw_value(k) is not None}
    g, t = number("placement.generate.tp", "0"), number("placement.train.tp", "1")
    vllm = (keys.raw_value("rollout.name") or "").strip("'\"") == "vllm"  # vLLM's TP is free of the training tp
    if g and t and t % g and g % t == 0 and not vllm:
        factor = g // t
        if any(v is None or v % factor for v in sp.values() if v != 1):
            return []
        out.append((f"placement.train.tp={g}", f"{g} (was {t}: the generation tp must divide the training tp)"))
        for key, v in sp.items():
            if v > 1:
                sp[key] = v // factor
                out.append((f"{key}={v // factor}", f"{v // factor} (was {v}: tp·sp devices per sequence kept)"))
    packing = keys.raw_value("model.use_remove_padding")
    if packing is not None and coerce(packing, bool, "model.use_remove_padding") and any(v > 1 for v in sp.values()):
        out.append(("model.use_remove_padding=false", "false (packed rows with Ulysses sp are not supported yet: "
                                                      "planned as padded rows of the same token budget)"))
    return out


def load_plan_config(args: Sequence[str], devices: int, algo: str = "dapo") -> tuple[RunConfig, PlanKeys]:
    """The run config the worker would get from verl's ``args`` on ``devices`` devices, and the sorted keys. Only
    when the loader or the worker rejects the layout as given is it changed (`_runnable_layout`, noted among the
    mapped keys), so a layout the framework accepts is planned as written."""
    keys = classify_keys(list(args))
    overrides = [*PLAN_DEFAULTS, *_cluster_overrides(keys, devices), *keys.overrides]
    try:
        try:
            # the planned model is --model, so never the laptop sizing of the embedded default model
            config = load_config(algo, overrides=overrides, check_model=False, laptop=False)
            _check_generation_layout(config)
            return _with_some_length(config), keys
        except (ConfigError, WorkerConfigError):
            fixes = _runnable_layout(keys)
            if not fixes:
                raise
        config = load_config(algo, overrides=overrides + [text for text, _ in fixes], check_model=False, laptop=False)
        _check_generation_layout(config)
    except ConfigError as err:
        raise ValueError(str(err)) from None
    keys.mapped += [(text.split("=")[0], why) for text, why in fixes]
    return _with_some_length(config), keys


def _with_some_length(config: RunConfig) -> RunConfig:
    """A run length counted in epochs is only known once the data is read (`jaxrl_hf.config.run_length`); the
    plan's programs do not depend on it, but the optimizer is built with a complete lr schedule. A plan is of
    accelerators, where ``model.dtype=auto`` computes in bfloat16 (`jaxrl_hf.workers.peak_flops`)."""
    if config.model.dtype == "auto":
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype="bfloat16"))
    if config.trainer.total_steps is not None:
        return config
    return with_total_steps(config, DEFAULT_TOTAL_STEPS)


def plan_attention(config: RunConfig, keys: PlanKeys) -> str:
    """``model.attn_implementation`` as the plan compiles it: as given, except ``cudnn`` where this backend has no
    cuDNN (XLA:CPU), planned as ``blockwise`` (both keep O(T) attention memory; noted among the mapped keys).
    ``auto`` resolves as in a worker on this backend (blockwise above 1024 tokens on CPU, where a GPU worker would
    take cuDNN)."""
    name = config.model.attn_implementation
    if name == "cudnn" and cudnn_usable(config.model.dtype) is not None:
        keys.mapped.append(("model.attn_implementation", "blockwise (cudnn is not available on this backend)"))
        return "blockwise"
    return name


def plan_devices(devices: int) -> list[jax.Device]:
    """The first ``devices`` devices in rank order; too few raises saying how to get more."""
    have = meshlib.ordered_devices()
    if len(have) < devices:
        raise ValueError(f"the plan needs {devices} devices but JAX has {len(have)}: set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={devices} before jax is imported "
                         "(launch/plan_memory.py does this from --devices)")
    return have[:devices]


def _ref_bytes(layout: P.ActorLayout) -> int:
    """The frozen reference copy (model.dtype, training layout: `jaxrl_hf.workers.common.reference_params`)."""
    dt = jax.numpy.dtype(layout.model.dtype)
    shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dt if jax.numpy.issubdtype(s.dtype, np.floating)
                                                         else s.dtype), layout.shapes)
    return P.tree_bytes_per_device(P.abstract(shapes, layout.shardings))


@dataclasses.dataclass(frozen=True)
class Resident:
    """State held during a program besides its arguments: the Adam moments and the reference copy."""

    optimizer: int
    ref: int

    def during(self, program: str) -> int:
        return (0 if program == "update_actor" else self.optimizer) + self.ref


def usable_fraction(config: RunConfig) -> tuple[float, str]:
    """The share of each device the actor's JAX programs may use: the project's GPU memory budget
    (`jaxrl_hf.config.memory_budget`, from the config alone: ``placement.memory``, and vLLM's share when
    ``rollout.name=vllm``); 1 with the uncapped platform allocator."""
    budget = memory_budget(config, environ={})
    return (1.0 if budget.jax_fraction is None else budget.jax_fraction), budget.describe()


def decode_batch(config: RunConfig, replicas: int, budget_bytes: float, resident: int,
                 compile_at: Callable[[int], P.CompiledProgram]) -> tuple[P.CompiledProgram, str]:
    """The generate program at the decode batch per replica it is planned for, and what bounded it. The native
    engine generates all its rows in one program; a continuous-batching engine (vLLM) runs as many as its budget
    holds, in waves. The plan takes the smaller: all rows per replica (``data.gen_batch_size·rollout.n``), capped
    by ``rollout.max_num_seqs`` and by the largest batch whose compiled decode step fits ``budget_bytes`` beside
    the resident state. That batch is searched on the compiled programs themselves (the cap first, then the
    interval halved: at most about log2(cap) compiles), since XLA's buffers are not affine in the batch."""
    rows = config.data.gen_batch_size * config.rollout.n
    batch, why = math.ceil(rows / replicas), "all rollout rows (data.gen_batch_size·rollout.n per replica)"
    if config.rollout.max_num_seqs and config.rollout.max_num_seqs < batch:
        batch, why = config.rollout.max_num_seqs, "rollout.max_num_seqs"
    compiled: dict[int, P.CompiledProgram] = {}

    def fits(b: int) -> bool:
        if b not in compiled:
            compiled[b] = compile_at(b)
        return memory_stats(compiled[b].compiled)["peak_bytes_per_device"] + resident <= budget_bytes

    if fits(batch):
        return compiled[batch], why
    if batch == 1 or not fits(1):
        return compiled[1], "memory: not even 1 sequence per replica fits"
    lo, hi = 1, batch  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return compiled[lo], f"memory: {lo} sequence(s) per replica fit ({len(compiled)} decode steps compiled)"


def plan_memory(model: str, devices: int, args: Sequence[str] = (), device_memory_bytes: int = DEFAULT_DEVICE_MEMORY,
                algo: str = "dapo") -> dict[str, Any]:
    """Compile the actor's ``update_actor``, ``log_prob`` and ``generate`` for ``model`` (a name in
    `jaxrl_hf.models.known_configs.KNOWN_HF_CONFIGS` or a ``config.json``) on ``devices`` devices under verl's
    ``args``; returns the JSON-able report (`jaxrl_hf.memory_plan.report` defines its byte counts)."""
    config, keys = load_plan_config(args, devices, algo)
    decoder = known_decoder_config(model, dtype=config.model.dtype, remat=config.model.remat,
                                   attn_implementation=plan_attention(config, keys))
    layout = P.ActorLayout.build(config, decoder, plan_devices(devices))
    update = P.update_actor_program(layout)
    ref = _ref_bytes(layout) if (config.actor.use_kl_loss or config.algorithm.use_kl_in_reward) else 0
    resident = Resident(0 if config.actor.offload_optimizer else update.optimizer_bytes,
                        0 if keys.offload_ref_params else ref)
    log_prob = P.log_prob_program(layout)
    fraction, budget_note = usable_fraction(config)
    usable = int(fraction * device_memory_bytes)
    if config.rollout.name == "vllm":
        return _vllm_plan(model, config, keys, decoder, layout, update, log_prob, resident, device_memory_bytes,
                          usable, budget_note)
    setup = P.generation_setup(layout)
    rollout_budget = usable
    if config.rollout.name == "vllm":
        rollout_budget = (config.rollout.gpu_memory_utilization or DEFAULT_VLLM_GPU_SHARE) * device_memory_bytes
    generate, why = decode_batch(config, setup.replicas, rollout_budget, resident.during("generate"),
                                 lambda b: P.generate_program(layout, setup, b))
    batch = generate.shapes["decode_batch_per_replica"]
    generate.shapes["decode_batch_limited_by"] = why
    rows = config.data.gen_batch_size * config.rollout.n
    generate.shapes["rows_per_replica"] = math.ceil(rows / setup.replicas)
    generate.shapes["waves"] = math.ceil(rows / (batch * setup.replicas))
    gen = layout.gen
    inputs = cost_model_inputs(decoder, layout.train.pp, layout.train.tp, layout.train.dp,
                               gen.pp if gen else layout.train.pp, gen.tp if gen else layout.train.tp,
                               "dp" in layout.rule_set.param_mesh_axes(), config.actor.ppo_micro_batch_size_per_device,
                               config.actor.log_prob_micro_batch_size_per_device, batch, *layout.seq_lengths)
    sequences = {"update_actor": config.actor.ppo_mini_batch_size * config.rollout.n,
                 "log_prob": log_prob.shapes["rows"], "generate": batch}
    out_programs = {p.name: _program_report(p, resident.during(p.name), predict(p.name, decoder, inputs,
                                                                                sequences[p.name]))
                    for p in (update, log_prob, generate)}
    return {
        **_report_head(model, config, keys, decoder, layout, device_memory_bytes, usable, budget_note, setup.label),
        "programs": out_programs,
        "fits": all(p["total_bytes_per_device"] <= usable for p in out_programs.values()),
    }


def _program_report(program: P.CompiledProgram, held: int, cost_model: dict[str, Any] | None) -> dict[str, Any]:
    stats = memory_stats(program.compiled)
    collectives, float_collectives = collective_counts(program.compiled)
    return {**stats, "param_bytes_per_device": program.param_bytes, "optimizer_bytes_per_device":
            program.optimizer_bytes, "resident_bytes_per_device": held,
            "total_bytes_per_device": stats["peak_bytes_per_device"] + held, "collectives": collectives,
            "float_collectives": float_collectives, "shapes": program.shapes, "compile_s": round(program.compile_s, 2),
            "cost_model": cost_model}


def _vllm_plan(model: str, config: RunConfig, keys: PlanKeys, decoder: Any, layout: P.ActorLayout,
               update: P.CompiledProgram, log_prob: P.CompiledProgram, resident: "Resident", device_memory: int,
               usable: int, budget_note: str) -> dict[str, Any]:
    """``rollout.name=vllm``: the JAX programs, the shard-wise weight sync, vLLM's section and the phases of a
    colocated GPU (`jaxrl_hf.memory_plan.vllm_rollout`); ``fits`` = every phase fits."""
    from jaxrl_hf.config.validate import rollout_tensor_parallel
    from jaxrl_hf.memory_plan import vllm_rollout as V

    tp = rollout_tensor_parallel(config)
    params = update.param_bytes
    sync = V.weight_sync_program(layout, tp, config.rollout.dtype or decoder.dtype)
    # during the sync JAX holds its params (the synced leaf counted again: an over-count of one leaf's shard)
    held = {"update_actor": resident.during("update_actor"), "log_prob": resident.during("log_prob"),
            "weight_sync": params + resident.during("weight_sync")}
    programs = {p.name: _program_report(p, held[p.name], None) for p in (update, log_prob, sync)}
    share = config.rollout.gpu_memory_utilization or DEFAULT_VLLM_GPU_SHARE
    vllm = V.vllm_memory(layout, tp, share, device_memory)
    time_shared = config.placement.memory.allocator == "platform"
    cap = int((1.0 - config.placement.memory.margin) * device_memory) if time_shared else usable
    phases = V.phases(programs, vllm, params + resident.during("generate"), device_memory, time_shared, cap)
    return {
        **_report_head(model, config, keys, decoder, layout, device_memory, cap, budget_note,
                       f"vLLM tp={tp} x {vllm.replicas} replicas"),
        "programs": programs, "vllm": vllm.report(),
        "time_sharing": {"allocator": config.placement.memory.allocator, "time_shared": time_shared,
                         "jax_cap_bytes": cap},
        "phases": phases, "fits": all(row["fits"] for row in phases.values()) and vllm.kv_tokens >= vllm.max_model_len,
    }


def _report_head(model: str, config: RunConfig, keys: PlanKeys, decoder: Any, layout: P.ActorLayout,
                 device_memory: int, usable: int, budget_note: str, generate: str) -> dict[str, Any]:
    return {
        "model": model, "num_params": decoder.num_params(), "devices": len(layout.devices),
        "device_memory_bytes": int(device_memory), "usable_bytes_per_device": usable,
        "memory_budget": budget_note, "backend": jax.default_backend(),
        "layout": {"train": layout.train.label(), "rule_set": layout.rule_set.name, "generate": generate,
                   "dtype": decoder.dtype, "param_dtype": decoder.param_dtype, "remat": decoder.remat},
        "offload": {"optimizer": bool(config.actor.offload_optimizer), "params": keys.offload_params,
                    "ref_params": keys.offload_ref_params},
        "keys": {"applied": keys.applied, "mapped": keys.mapped, "ignored": keys.ignored,
                 "not_modelled": keys.not_modelled},
    }
