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

from jaxrl_hf.models import save_hf_dir
from jaxrl_hf.workers.common import copy_tokenizer_files

FORMAT_VERSION = 1
STATE_DIR = "state"
META_FILE = "worker.json"


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


def export_hf_dir(path: str, params: Any, model_config: Any, tokenizer_dir: str | None,
                  save_adapters: Any = None) -> str:
    """Write ``params`` (gathered to the host, float32) as an HF safetensors directory at ``path`` with the
    tokenizer files of ``tokenizer_dir`` and, with ``save_adapters(dir)``, a ``lora_adapter/`` beside them;
    atomically (a temporary directory renamed into place). Every process calls it; process 0 writes."""
    host = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params) if jax.process_count() == 1 else \
        jax.tree.map(lambda x: np.asarray(jax.experimental.multihost_utils.process_allgather(x, tiled=True)), params)
    host = jax.tree.map(lambda x: x.astype(np.float32) if x.dtype != np.float32 else x, host)  # a bf16 reference
    path = os.path.abspath(path)
    if jax.process_index() == 0:
        tmp = f"{path}.tmp-export"
        shutil.rmtree(tmp, ignore_errors=True)
        save_hf_dir(tmp, host, model_config)
        if save_adapters is not None:
            save_adapters(os.path.join(tmp, "lora_adapter"))
        copy_tokenizer_files(tokenizer_dir, tmp)
        if os.path.exists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    return path
