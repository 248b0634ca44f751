"""Shared pieces of the role workers: the typed config, model construction, the training mesh, batch placement.

Each worker process holds a slice of every data batch (its dp shard, from the controller's MESH_DP
protocol) and runs SPMD programs over the role's mesh ``('pp','tp','dp')`` spanning all processes'
devices (``('pp','tp','dp','sp')`` with Ulysses sequence parallelism: the ``sp`` devices of a group hold the
same rows, so the controller hands them the same shard). ``to_global`` turns the process's rows into a global
``jax.Array`` sharded on the ``dp`` axis; ``process_local_rows`` (controller) turns a result back into the
process's rows.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_hf import mesh as meshlib
from jaxrl_hf.config.build import ConfigError, build_dataclass
from jaxrl_hf.config.resolve import resolve_defaults
from jaxrl_hf.config.schema import ModelConfig, PlacementConfig, RunConfig, TinyModelConfig
from jaxrl_hf.models import DecoderConfig, init_params, param_logical_axes
from jaxrl_hf.models.attention import cudnn_usable
from jaxrl_hf.models.tokenizer import Tokenizer

TINY_RANDOM = "tiny-random"


class WorkerConfigError(ValueError):
    """A configuration value a worker cannot use; the message names the dotted key."""


def worker_run_config(config: RunConfig | Mapping[str, Any]) -> RunConfig:
    """The typed config a worker runs on: a ``RunConfig`` as given, or a plain nested mapping (scripts, tests)
    built once through the schema's builder (type-checked, unknown keys named); then the derived defaults
    (``resolve_defaults``: idempotent, so an already-resolved config comes back equal)."""
    try:
        typed = config if isinstance(config, RunConfig) else build_dataclass(RunConfig, dict(config))
        return resolve_defaults(typed)
    except ConfigError as err:
        raise WorkerConfigError(str(err)) from None


# ------------------------------------------------------------------------------------------ models
@dataclasses.dataclass
class LoadedModel:
    """A decoder config, its float32 params (host or device), tokenizer (or None) and source directory."""

    config: DecoderConfig
    params: Any
    tokenizer: Tokenizer | None
    path: str | None

    @property
    def pad_token_id(self) -> int:
        """Pad id: the config's, else the tokenizer's, else the first EOS id, else 0."""
        for candidate in (self.config.pad_token_id, self.tokenizer.pad_token_id if self.tokenizer else None):
            if candidate is not None:
                return int(candidate)
        return int(self.eos_token_ids[0]) if self.eos_token_ids else 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Stop tokens: the config's EOS ids plus the tokenizer's EOS."""
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return tuple(sorted(ids))


def tiny_decoder_config(tiny: TinyModelConfig, dtype: str, remat: str, where: str = "model.tiny",
                        attn_implementation: str = "auto") -> DecoderConfig:
    """A small random Llama (``num_experts > 0``: Qwen3-MoE) for smoke tests from ``model.tiny``."""
    moe = dict(model_type="qwen3_moe", qk_norm=True, num_experts=tiny.num_experts,
               num_experts_per_tok=tiny.num_experts_per_tok, norm_topk_prob=True,
               moe_intermediate_size=tiny.moe_intermediate_size or tiny.intermediate_size) if tiny.num_experts else {}
    try:
        return DecoderConfig(
            vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
            num_hidden_layers=tiny.num_layers, num_attention_heads=tiny.num_heads,
            num_key_value_heads=tiny.num_kv_heads, head_dim=tiny.head_dim or tiny.hidden_size // tiny.num_heads,
            max_position_embeddings=tiny.max_position_embeddings, tie_word_embeddings=tiny.tie_word_embeddings,
            bos_token_id=tiny.bos_token_id, pad_token_id=tiny.pad_token_id, eos_token_ids=(tiny.eos_token_id,),
            dtype=dtype, remat=remat, attn_implementation=attn_implementation, **moe)
    except ValueError as err:
        raise WorkerConfigError(f"{where}: {err}") from None


def check_attn_implementation(model: ModelConfig, where: str = "model") -> None:
    """``<where>.attn_implementation=cudnn`` must be runnable in this worker process (a GPU backend and a
    float16/bfloat16 ``dtype``); the error names the key. ``auto`` falls back by itself."""
    reason = cudnn_usable(model.dtype) if model.attn_implementation == "cudnn" else None
    if reason is not None:
        raise WorkerConfigError(f"{where}.attn_implementation='cudnn' is not usable here: {reason}; "
                                "use 'auto', 'blockwise' or 'eager'")


def load_model(model: ModelConfig, where: str = "model") -> LoadedModel:
    """``model.path``: ``"tiny-random"`` (random init from ``model.tiny`` and ``model.seed``), a known
    model name (``"smollm2-135m-instruct"``), an HF directory, a ``.gguf`` file or a locally cached hub id."""
    check_attn_implementation(model, where)
    if model.path == TINY_RANDOM:
        config = tiny_decoder_config(model.tiny, model.dtype, model.remat, where=f"{where}.tiny",
                                     attn_implementation=model.attn_implementation)
        config = dataclasses.replace(config, scan_layers=model.scan_layers)
        return LoadedModel(config, init_params(config, model.seed), None, None)
    from jaxrl_hf.models import load_pretrained

    try:
        lm = load_pretrained(model.path, dtype=model.dtype, remat=model.remat,
                             attn_implementation=model.attn_implementation)
    except (ValueError, FileNotFoundError) as err:
        raise WorkerConfigError(f"{where}.path={model.path!r}: {err}") from err
    return LoadedModel(dataclasses.replace(lm.config, scan_layers=model.scan_layers), lm.params, lm.tokenizer, lm.path)


# ------------------------------------------------------------------------------------------ mesh
def train_parallel(placement: PlacementConfig, where: str = "placement", sp: int = 1,
                   sp_key: str = "actor.ulysses_sequence_parallel_size",
                   devices: int | None = None) -> meshlib.TrainParallel:
    """``placement.train.{pp,tp,dp}`` and the role's Ulysses size ``sp`` (config key ``sp_key``), which must
    divide ``dp``; pp·tp·dp must cover every device of the worker's JAX program (``devices``; default all of
    JAX's, as in a worker)."""
    pp, tp, dp = placement.train.pp, placement.train.tp, placement.train.dp
    devices = jax.device_count() if devices is None else devices
    if devices % (pp * tp):
        raise WorkerConfigError(f"{where}.train: pp·tp = {pp}·{tp} does not divide the {devices} devices")
    if pp * tp * dp != devices:
        raise WorkerConfigError(f"{where}.train: pp·tp·dp = {pp}·{tp}·{dp} = {pp * tp * dp} but the worker's "
                                f"JAX program has {devices} devices (placement.num_processes × devices_per_process)")
    if isinstance(sp, bool) or not isinstance(sp, (int, np.integer)) or sp < 1 or dp % sp:
        raise WorkerConfigError(f"{sp_key}={sp!r}: must be an integer >= 1 dividing {where}.train.dp={dp} (each "
                                f"group of sp data-parallel devices shares rows, each holding 1/sp of the sequence)")
    return meshlib.TrainParallel(pp, tp, dp, int(sp))


def train_rule_set(config: RunConfig, role: str, train: meshlib.TrainParallel) -> meshlib.RuleSet:
    """The sharding rule set a training role uses: ``<section>.strategy`` (verl's key; ``role`` ``"critic"``
    reads ``critic.strategy``, every other role — actor, rollout, ref — ``actor.strategy``), looked up in
    `jaxrl_hf.mesh.RULE_SETS` (``fsdp``/``fsdp2`` become ``fsdp_tp`` when ``placement.train.tp > 1``). The one
    place the workers read it; a bad name, or a rule set needing mesh axes the training mesh lacks, raises
    naming the key."""
    section = "critic" if role == "critic" else "actor"
    key = f"{section}.strategy"
    name = getattr(config, section).strategy
    try:
        rule_set = meshlib.rule_set_for_strategy(name, train.tp, train.sp)
    except ValueError as err:
        raise WorkerConfigError(f"{key}={name!r}: {err}") from None
    axes = meshlib.train_mesh_axes(train)
    missing = sorted(rule_set.mesh_axes() - set(axes))
    if missing:
        hint = " (the sp axis exists with ulysses_sequence_parallel_size > 1)" if "sp" in missing else ""
        raise WorkerConfigError(f"{key}={name!r}: rule set {rule_set.name!r} shards over mesh axes {missing} that "
                                f"the training mesh {axes} does not have{hint}")
    if train.sp > 1 and "sp" not in rule_set.mesh_axes():
        raise WorkerConfigError(f"{key}={name!r}: {section}.ulysses_sequence_parallel_size={train.sp} but rule set "
                                f"{rule_set.name!r} has no sequence-parallel variant (RuleSet.sp_variant) and does not "
                                "shard over 'sp'")
    return rule_set


def check_sequence_parallel_heads(config: DecoderConfig, train: meshlib.TrainParallel, key: str) -> None:
    """Ulysses splits the query heads over ``tp·sp`` devices inside attention: they must divide evenly (kv heads
    need not: attention repeats them, `jaxrl_hf.models.llama.kv_head_repeats`). ``key``: the sp config key."""
    if train.sp > 1 and config.num_attention_heads % (train.tp * train.sp):
        raise WorkerConfigError(f"{key}={train.sp}: the model's {config.num_attention_heads} attention heads do not "
                                f"split over placement.train.tp·sp = {train.tp}·{train.sp} devices (Ulysses splits "
                                "the heads inside attention); choose sp with num_attention_heads divisible by tp·sp")


SEQUENCE_COLUMNS = ("input_ids", "attention_mask", "position_ids")
PER_TOKEN_COLUMNS = {"routed_experts": 2}
"""Columns of one entry per token besides `SEQUENCE_COLUMNS`, with how many dimensions follow the token axis
(routing replay's experts: ``[rows, P+R, layers, k]``)."""


def pad_sequences_to(arrays: Mapping[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """Left-pad the token columns (`SEQUENCE_COLUMNS` ``[rows, P+R]``, `PER_TOKEN_COLUMNS`) with zeros until their
    width divides ``multiple`` (the Ulysses size: each device holds ``1/sp`` of the sequence). An ``attention_mask`` of 0 is
    padding, never attended, and the response stays the last ``R`` columns, so every output is unchanged."""
    width = next((np.shape(arrays[k])[-1] for k in SEQUENCE_COLUMNS if k in arrays), None)
    extra = 0 if width is None else (-width) % multiple
    if not extra:
        return dict(arrays)
    out = dict(arrays)
    trailing = {**dict.fromkeys(SEQUENCE_COLUMNS, 0), **PER_TOKEN_COLUMNS}  # dims after the token axis
    for key, after in trailing.items():  # (padding routes to expert 0: masked, never attended)
        if key in out:
            a = np.asarray(out[key])
            out[key] = np.pad(a, [(0, 0)] * (a.ndim - 1 - after) + [(extra, 0)] + [(0, 0)] * after)
    return out


def reference_params(params: Any, dtype: str) -> Any:
    """The frozen reference policy's weights: a copy of the initial params in the compute dtype ``model.dtype``
    (mixed precision: bf16 halves the reference's memory; its logits, log-probs and the KL stay float32). Each
    leaf keeps its sharding."""
    dt = jnp.dtype(dtype)
    if dt == jnp.float32:
        return jax.tree.map(jnp.copy, params)
    return jax.jit(lambda tree: jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                             tree))(params)


def abstract_like(x: Any) -> jax.ShapeDtypeStruct:
    """Shape and dtype of an array, a ``jax.ShapeDtypeStruct`` or anything ``jnp.asarray`` takes."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(tuple(x.shape), x.dtype)
    x = jnp.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def param_shardings(params: Any, logical_axes: Any, train_mesh: jax.sharding.Mesh,
                    gen: meshlib.GenParallel | None = None, rule_set: meshlib.RuleSet = meshlib.MEGATRON) -> Any:
    """``NamedSharding`` tree for ``params`` (arrays or ``jax.ShapeDtypeStruct``s) on the training mesh:
    ``rule_set``'s param rules ordered for the train -> ``gen`` transition, through the mesh/ resolver
    (divisibility checked)."""
    shapes = jax.tree.map(abstract_like, params)
    return meshlib.logical_to_shardings(logical_axes, train_mesh, rule_set.for_transition(gen).params, shapes=shapes)


def lm_param_shardings(config: DecoderConfig, params: Any, train_mesh: jax.sharding.Mesh,
                       gen: meshlib.GenParallel | None = None, rule_set: meshlib.RuleSet = meshlib.MEGATRON) -> Any:
    """`param_shardings` with the decoder's logical axes."""
    return param_shardings(params, param_logical_axes(config), train_mesh, gen, rule_set)


def rows_sharding(mesh: jax.sharding.Mesh, ndim: int, micro_axis: bool = False) -> NamedSharding:
    """Rows over ``dp`` (replicated over pp/tp); with ``micro_axis`` the leading micro-batch axis stays whole."""
    lead = (None, "dp") if micro_axis else ("dp",)
    return NamedSharding(mesh, PartitionSpec(*lead, *([None] * (ndim - len(lead)))))


def to_global(local: np.ndarray, mesh: jax.sharding.Mesh, dp_processes: int, micro_axis: bool = False) -> jax.Array:
    """This process's rows as a global array sharded over ``dp`` (the row axis is axis 1 with ``micro_axis``)."""
    local = np.asarray(local)
    sharding = rows_sharding(mesh, local.ndim, micro_axis)
    shape = list(local.shape)
    shape[1 if micro_axis else 0] *= dp_processes
    return jax.make_array_from_process_local_data(sharding, local, tuple(shape))


def pad_rows_to(arrays: Mapping[str, np.ndarray], multiple: int) -> tuple[dict[str, np.ndarray], int]:
    """Append copies of row 0 until the row count divides ``multiple``; returns (arrays, rows added)."""
    n = len(next(iter(arrays.values())))
    extra = (-n) % multiple
    if not extra:
        return dict(arrays), 0
    return {k: np.concatenate([v, np.repeat(v[:1], extra, axis=0)]) for k, v in arrays.items()}, extra


def chunked_apply(program: Any, params: Any, arrays: Mapping[str, np.ndarray], chunk: int,
                  mesh: jax.sharding.Mesh, dp_processes: int, *extra: Any,
                  prepare: Any = None) -> tuple[np.ndarray, ...]:
    """Run ``program(params, micro, *extra) -> array or tuple of [rows, ...] arrays`` over this process's rows in
    chunks of ``chunk`` rows (the last padded with copies of row 0; ``prepare(chunk) -> arrays``, if given, lays
    each chunk out first), returning this process's output rows."""
    arrays, added = pad_rows_to({k: np.asarray(v) for k, v in arrays.items()}, chunk)
    rows = len(next(iter(arrays.values())))
    pieces: list[tuple[np.ndarray, ...]] = []
    from jaxrl_hf.controller import process_local_rows

    for start in range(0, rows, chunk):
        piece = {k: v[start:start + chunk] for k, v in arrays.items()}
        micro = {k: to_global(v, mesh, dp_processes) for k, v in (prepare(piece) if prepare else piece).items()}
        out = program(params, micro, *extra)
        out = out if isinstance(out, tuple) else (out,)
        pieces.append(tuple(process_local_rows(o) for o in out))
    return tuple(np.concatenate(col)[:rows - added] for col in zip(*pieces))
