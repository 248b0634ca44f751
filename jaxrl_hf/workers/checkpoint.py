"""Atomic orbax checkpoints of a worker's state (params, optimizer state, step) plus a JSON side file.

Layout of one worker checkpoint directory ``PATH``::

    PATH/state/          orbax PyTree checkpoint (sharded arrays; restored onto the current shardings)
    PATH/worker.json     small JSON: step counters, RNG seeds, model config, format version

Atomicity: everything is written to ``PATH.tmp-<n>`` first and renamed to ``PATH`` only when complete; a
crash leaves either the previous ``PATH`` or no ``PATH`` (plus a ``.tmp-`` leftover that the next save
removes), never a half-written checkpoint that a resume would pick up.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl_hf.models.hf_export import export_dtype, parse_shard_size, write_hf_model_dir

FORMAT_VERSION = 1
STATE_DIR = "state"
META_FILE = "worker.json"
LORA_ADAPTER_DIR = "lora_adapter"  # inside an HF export: the LoRA adapters alone, in PEFT's format


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save_state(path: str | os.PathLike, state: Any, metadata: Mapping[str, Any]) -> str:
    """Write ``state`` (a pytree of arrays) and ``metadata`` (JSON-able) to ``path`` atomically.

    Every process of the worker's JAX program must call this together (orbax writes each process's
    shards); process 0 writes the JSON and performs the rename. An existing ``path`` is replaced.
    """
    path = os.path.abspath(os.fspath(path))
    tmp = f"{path}.tmp-{FORMAT_VERSION}"
    if jax.process_index() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.dirname(path), exist_ok=True)
    _sync(f"ckpt-clean:{path}")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(tmp, STATE_DIR), state)
    checkpointer.wait_until_finished()
    _sync(f"ckpt-written:{path}")
    if jax.process_index() == 0:
        with open(os.path.join(tmp, META_FILE), "w") as fh:
            json.dump({"format_version": FORMAT_VERSION, **metadata}, fh, indent=2, default=_json_default)
        old = f"{path}.old-{FORMAT_VERSION}"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _sync(f"ckpt-renamed:{path}")
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"checkpoint metadata value {value!r} is not JSON-serialisable")


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON side file of a checkpoint; a missing/partial checkpoint raises naming the path."""
    path = os.fspath(path)
    meta_file = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_file) or not os.path.isdir(os.path.join(path, STATE_DIR)):
        raise FileNotFoundError(f"{path} is not a complete worker checkpoint (needs {STATE_DIR}/ and {META_FILE})")
    with open(meta_file) as fh:
        meta = json.load(fh)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_file}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    return meta


def restore_state(path: str | os.PathLike, like: Any) -> tuple[Any, dict[str, Any]]:
    """``(state, metadata)`` from ``path``; arrays are restored with the shapes, dtypes and shardings of
    ``like`` (the worker's current state), so a checkpoint loads onto the current mesh."""
    meta = read_metadata(path)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
    try:
        state = ocp.StandardCheckpointer().restore(os.path.join(os.fspath(path), STATE_DIR), abstract)
    except (ValueError, KeyError) as err:
        raise ValueError(f"checkpoint {path} does not match this worker's state structure: {err}") from err
    return state, meta


def read_params(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(params, metadata)`` of a worker checkpoint as host numpy arrays, on this process's CPU, without the
    worker: only the params subtree is read (an actor's ``train_state.params``, a reference's ``ref_params``);
    the optimizer state stays on disk."""
    meta = read_metadata(path)
    state_dir = os.path.join(os.path.abspath(os.fspath(path)), STATE_DIR)
    checkpointer = ocp.PyTreeCheckpointer()
    saved = checkpointer.metadata(state_dir)
    tree = getattr(getattr(saved, "item_metadata", saved), "tree", getattr(saved, "item_metadata", saved))
    if "train_state" in tree:
        keys = ("train_state", "params")
    elif "ref_params" in tree:
        keys = ("ref_params",)
    else:
        raise ValueError(f"checkpoint {path} holds neither train_state.params nor ref_params (has {sorted(tree)})")
    sub = tree
    for key in keys:
        sub = sub[key]
    item: Any = jax.tree.map(lambda _: np.zeros((), np.float32), sub)
    for key in reversed(keys):
        item = {key: item}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
    restored = checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                                                          partial_restore=True))
    for key in keys:
        restored = restored[key]
    return restored, meta


def hf_export_options(config: Any) -> dict[str, Any]:
    """``export_hf_dir``'s ``dtype`` / ``max_shard_size`` from a run config's ``trainer.export_hf_*`` keys."""
    return {"dtype": config.trainer.export_hf_dtype, "max_shard_size": config.trainer.export_hf_max_shard_size}


def export_hf_dir(path: str, params: Any, model_config: Any, tokenizer_dir: str | None,
                  save_adapters: Any = None, dtype: str = "bfloat16", max_shard_size: int | str = "5GB") -> str:
    """Write ``params`` (gathered to the host) as an HF model directory at ``path``
    (`jaxrl_hf.models.hf_export.write_hf_model_dir`: ``dtype`` safetensors in shards of ``max_shard_size``,
    config, generation config, the tokenizer files of ``tokenizer_dir``) and, with ``save_adapters(dir)``, a
    ``lora_adapter/`` (`LORA_ADAPTER_DIR`) beside them; atomically (a temporary directory renamed into place). Every process calls
    it; process 0 writes."""
    export_dtype(dtype, "trainer.export_hf_dtype")  # a bad value fails before the gather
    parse_shard_size(max_shard_size, "trainer.export_hf_max_shard_size")
    host = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params) if jax.process_count() == 1 else \
        jax.tree.map(lambda x: np.asarray(jax.experimental.multihost_utils.process_allgather(x, tiled=True)), params)
    path = os.path.abspath(path)
    if jax.process_index() == 0:
        tmp = f"{path}.tmp-export"
        shutil.rmtree(tmp, ignore_errors=True)
        write_hf_model_dir(tmp, host, model_config, tokenizer_dir, dtype, max_shard_size)
        if save_adapters is not None:
            save_adapters(os.path.join(tmp, LORA_ADAPTER_DIR))
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    return path
