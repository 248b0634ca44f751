"""Shared pieces of the role workers: config access, model construction, the training mesh, batch placement.

Each worker process holds a slice of every data batch (its dp shard, from the controller's MESH_DP
protocol) and runs SPMD programs over the role's mesh ``('pp','tp','dp')`` spanning all processes'
devices. ``to_global`` turns the process's rows into a global ``jax.Array`` sharded on the ``dp`` axis;
``process_local_rows`` (controller) turns a result back into the process's rows.
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
from jaxrl_hf.config.schema import ActorConfig, CriticConfig
from jaxrl_hf.models import DecoderConfig, init_params, param_logical_axes
from jaxrl_hf.models.tokenizer import Tokenizer

TINY_RANDOM = "tiny-random"
TINY_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
             "head_dim", "max_position_embeddings", "pad_token_id", "eos_token_id", "bos_token_id",
             "tie_word_embeddings")


class WorkerConfigError(ValueError):
    """A configuration value a worker cannot use; the message names the dotted key."""


def get(config: Mapping[str, Any], dotted: str, default: Any = ...) -> Any:
    """``config["a"]["b"]`` for ``"a.b"``; a missing key without ``default`` raises naming it."""
    node: Any = config
    for i, part in enumerate(dotted.split(".")):
        if not isinstance(node, Mapping) or part not in node:
            if default is not ...:
                return default
            where = ".".join(dotted.split(".")[:i]) or "<root>"
            valid = sorted(node) if isinstance(node, Mapping) else []
            raise WorkerConfigError(f"missing config key {dotted!r} (no {part!r} under {where}; has {valid})")
        node = node[part]
    return node


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


def tiny_decoder_config(tiny: Mapping[str, Any], dtype: str, remat: str, where: str = "model.tiny") -> DecoderConfig:
    """A small random Llama for smoke tests from ``model.tiny`` (keys: `TINY_KEYS`)."""
    unknown = sorted(set(tiny) - set(TINY_KEYS))
    if unknown:
        raise WorkerConfigError(f"{where}: unknown key(s) {unknown}; valid: {list(TINY_KEYS)}")
    heads = int(tiny.get("num_heads", 4))
    hidden = int(tiny.get("hidden_size", 64))
    eos = tiny.get("eos_token_id", 2)
    try:
        return DecoderConfig(
            vocab_size=int(tiny.get("vocab_size", 256)), hidden_size=hidden,
            intermediate_size=int(tiny.get("intermediate_size", 2 * hidden)),
            num_hidden_layers=int(tiny.get("num_layers", 2)), num_attention_heads=heads,
            num_key_value_heads=int(tiny.get("num_kv_heads", heads)),
            head_dim=int(tiny.get("head_dim") or hidden // heads),
            max_position_embeddings=int(tiny.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(tiny.get("tie_word_embeddings", False)),
            bos_token_id=tiny.get("bos_token_id", 1), pad_token_id=int(tiny.get("pad_token_id", 0)),
            eos_token_ids=tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])),
            dtype=dtype, remat=remat)
    except ValueError as err:
        raise WorkerConfigError(f"{where}: {err}") from None


def load_model(model_cfg: Mapping[str, Any], where: str = "model") -> LoadedModel:
    """``model.path``: ``"tiny-random"`` (random init from ``model.tiny`` and ``model.seed``), a known
    model name (``"smollm2-135m-instruct"``), an HF directory or a ``.gguf`` file."""
    path = get(model_cfg, "path", TINY_RANDOM)
    dtype, remat = get(model_cfg, "dtype", "float32"), get(model_cfg, "remat", "none")
    if path == TINY_RANDOM:
        config = tiny_decoder_config(get(model_cfg, "tiny", {}), dtype, remat, where=f"{where}.tiny")
        params = init_params(config, int(get(model_cfg, "seed", 0)))
        return LoadedModel(config, params, None, None)
    from jaxrl_hf.models import load_pretrained

    try:
        lm = load_pretrained(path, dtype=dtype, remat=remat)
    except (ValueError, FileNotFoundError) as err:
        raise WorkerConfigError(f"{where}.path={path!r}: {err}") from err
    return LoadedModel(lm.config, lm.params, lm.tokenizer, lm.path)


# ------------------------------------------------------------------------------------------ mesh
def train_parallel(placement: Mapping[str, Any], where: str = "placement") -> meshlib.TrainParallel:
    """``placement.train.{pp,tp,dp}``; ``dp`` defaults to all devices / (pp·tp); must cover every device."""
    train = get(placement, "train", {}) or {}
    pp, tp = int(train.get("pp", 1)), int(train.get("tp", 1))
    devices = jax.device_count()
    if devices % (pp * tp):
        raise WorkerConfigError(f"{where}.train: pp·tp = {pp}·{tp} does not divide the {devices} devices")
    dp = int(train.get("dp") or devices // (pp * tp))
    if pp * tp * dp != devices:
        raise WorkerConfigError(f"{where}.train: pp·tp·dp = {pp}·{tp}·{dp} = {pp * tp * dp} but the worker's "
                                f"JAX program has {devices} devices (placement.num_processes × devices_per_process)")
    return meshlib.TrainParallel(pp, tp, dp)


def train_rule_set(config: Mapping[str, Any], role: str, train: meshlib.TrainParallel) -> meshlib.RuleSet:
    """The sharding rule set a training role uses: ``<section>.strategy`` (verl's key; ``role`` ``"critic"``
    reads ``critic.strategy``, every other role — actor, rollout, ref — ``actor.strategy``), looked up in
    `jaxrl_hf.mesh.RULE_SETS` (``fsdp``/``fsdp2`` become ``fsdp_tp`` when ``placement.train.tp > 1``). The one
    place the workers read it; a bad name, or a rule set needing mesh axes the training mesh lacks, raises
    naming the key."""
    section = "critic" if role == "critic" else "actor"
    key = f"{section}.strategy"
    name = get(config, key, (CriticConfig if section == "critic" else ActorConfig).strategy)
    try:
        rule_set = meshlib.rule_set_for_strategy(name, train.tp)
    except ValueError as err:
        raise WorkerConfigError(f"{key}={name!r}: {err}") from None
    missing = sorted(rule_set.mesh_axes() - set(meshlib.TRAIN_AXES))
    if missing:
        raise WorkerConfigError(f"{key}={name!r}: rule set {rule_set.name!r} shards over mesh axes {missing} that "
                                f"the training mesh {meshlib.TRAIN_AXES} does not have (declared, not yet wired)")
    return rule_set


def param_shardings(params: Any, logical_axes: Any, train_mesh: jax.sharding.Mesh,
                    gen: meshlib.GenParallel | None = None, rule_set: meshlib.RuleSet = meshlib.MEGATRON) -> Any:
    """``NamedSharding`` tree for ``params`` on the training mesh: ``rule_set``'s param rules ordered for the
    train -> ``gen`` transition, through the mesh/ resolver (divisibility checked)."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), params)
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


def copy_tokenizer_files(src_dir: str | None, dst_dir: str) -> list[str]:
    """Copy the tokenizer files of an HF directory (if any) so an exported model is self-contained."""
    import shutil

    copied = []
    if not src_dir:
        return copied
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                 "chat_template.jinja"):
        src = os.path.join(src_dir, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(dst_dir, name))
            copied.append(name)
    return copied


def chunked_apply(program: Any, params: Any, arrays: Mapping[str, np.ndarray], chunk: int,
                  mesh: jax.sharding.Mesh, dp_processes: int, *extra: Any) -> tuple[np.ndarray, ...]:
    """Run ``program(params, micro, *extra) -> array or tuple of [rows, ...] arrays`` over this process's rows in
    chunks of ``chunk`` rows (the last padded with copies of row 0), returning this process's output rows."""
    arrays, added = pad_rows_to({k: np.asarray(v) for k, v in arrays.items()}, chunk)
    rows = len(next(iter(arrays.values())))
    pieces: list[tuple[np.ndarray, ...]] = []
    from jaxrl_hf.controller import process_local_rows

    for start in range(0, rows, chunk):
        micro = {k: to_global(v[start:start + chunk], mesh, dp_processes) for k, v in arrays.items()}
        out = program(params, micro, *extra)
        out = out if isinstance(out, tuple) else (out,)
        pieces.append(tuple(process_local_rows(o) for o in out))
    return tuple(np.concatenate(col)[:rows - added] for col in zip(*pieces))
