"""Write a decoder as a self-contained HF model directory: sharded safetensors in a chosen dtype, ``config.json``,
``generation_config.json`` and the tokenizer files.

Layout (transformers' ``save_pretrained`` naming)::

    model.safetensors                         when everything fits in one shard, else
    model-00001-of-0000N.safetensors ...      shards of at most ``max_shard_size`` bytes (a bigger tensor alone)
    model.safetensors.index.json              {"metadata": {"total_size": bytes}, "weight_map": {name: file}}
    config.json                               ``torch_dtype`` and ``dtype`` = the saved dtype
    generation_config.json                    bos/eos/pad ids (the tokenizer's, then the model config's)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja   copied

Shards are written one at a time (one shard's tensors in the target dtype are in memory at once); a bar counts
the tensors converted (`jaxrl_hf.progress.task`, on a terminal).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Mapping, Sequence

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from jaxrl_hf import progress
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.weights_hf import Params, iter_hf_tensor_views

EXPORT_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
INDEX_FILE = "model.safetensors.index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_shard_size(size: int | str, key: str = "max_shard_size") -> int:
    """Bytes of ``"5GB"`` (10^9, transformers' convention), ``"2GiB"`` (2^30), ``"500MB"`` or a plain integer."""
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        value = int(size)
    else:
        match = _SIZE.match(str(size))
        if match is None:
            raise ValueError(f"{key}={size!r}: not a size; use e.g. 5GB, 500MB, 2GiB or a number of bytes")
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").upper()])
    if value <= 0:
        raise ValueError(f"{key}={size!r}: must be > 0 bytes")
    return value


def export_dtype(name: str, key: str = "dtype") -> Any:
    """The numpy dtype of an export dtype name (``bfloat16`` | ``float16`` | ``float32``)."""
    if name not in EXPORT_DTYPES:
        raise ValueError(f"{key}={name!r}; valid: {sorted(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


def plan_shards(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Greedy split of ``(name, nbytes)`` in order: a shard takes tensors while its total stays <= ``max_bytes``;
    a tensor larger than ``max_bytes`` gets a shard of its own (transformers' rule)."""
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, nbytes in sizes:
        if current and used + nbytes > max_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += nbytes
    if current:
        shards.append(current)
    return shards


def shard_file_names(count: int) -> list[str]:
    """``model.safetensors`` for one shard, else ``model-00001-of-0000N.safetensors`` ..."""
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def save_sharded_safetensors(path: str, params: Params, config: DecoderConfig, dtype: str = "bfloat16",
                             max_shard_size: int | str = "5GB") -> list[str]:
    """Write ``params`` (host arrays) in HF names and layout, cast to ``dtype`` (round-to-nearest-even), split
    into shards of at most ``max_shard_size`` bytes (+ the index file when there are several); returns the
    shard file names."""
    target = export_dtype(dtype)
    limit = parse_shard_size(max_shard_size)
    itemsize = np.dtype(target).itemsize
    sizes = [(name, int(np.prod(view.shape)) * itemsize) for name, view in iter_hf_tensor_views(params, config)]
    shards = plan_shards(sizes, limit)
    files = shard_file_names(len(shards))
    owner = {name: file for file, names in zip(files, shards) for name in names}
    views = iter_hf_tensor_views(params, config)
    with progress.task(f"exporting {dtype} to {os.path.basename(os.path.normpath(path))}", len(sizes),
                       "tensors") as exported:
        for file, names in zip(files, shards):
            tensors = {}
            for _ in names:
                name, view = next(views)
                tensors[name] = np.ascontiguousarray(np.asarray(view).astype(target, copy=False))
                exported.advance()
            save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
            os.chmod(os.path.join(path, file), 0o666 & ~_umask())  # safetensors writes 0600; share as open() would
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(n for _, n in sizes)}, "weight_map": dict(sorted(owner.items()))}
        with open(os.path.join(path, INDEX_FILE), "w") as fh:
            json.dump(index, fh, indent=2)
    return files


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def generation_config(config: DecoderConfig, tokenizer: Any = None,
                      base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``generation_config.json``: ``base`` (the source model's, keeping its sampling defaults) with bos/pad from
    the tokenizer (else the model config) and eos = the source's, the tokenizer's and the model config's ids."""
    out = dict(base or {})
    tok = (lambda attr: getattr(tokenizer, attr, None)) if tokenizer is not None else (lambda attr: None)
    eos = out.get("eos_token_id")
    eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    for candidate in (tok("eos_token_id"), *config.eos_token_ids):
        if candidate is not None and int(candidate) not in eos_ids:
            eos_ids.append(int(candidate))
    bos = tok("bos_token_id") if tok("bos_token_id") is not None else config.bos_token_id
    pad = tok("pad_token_id") if tok("pad_token_id") is not None else config.pad_token_id
    for key, value in (("bos_token_id", bos), ("pad_token_id", pad)):
        if value is not None:
            out[key] = int(value)
    if eos_ids:
        out["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    return out


def write_hf_model_dir(path: str | os.PathLike, params: Params, config: DecoderConfig,
                       tokenizer_dir: str | None = None, dtype: str = "bfloat16",
                       max_shard_size: int | str = "5GB") -> str:
    """The whole HF directory (see the module docstring) into ``path`` (created; not atomic: callers write a
    temporary directory and rename it). Loads with ``AutoModelForCausalLM.from_pretrained`` and vLLM."""
    from jaxrl_hf.models.tokenizer import Tokenizer

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_sharded_safetensors(path, params, config, dtype, max_shard_size)
    hf = config.to_hf_dict()
    hf["torch_dtype"] = hf["dtype"] = dtype
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(hf, fh, indent=2)
    tokenizer, base = None, None
    if tokenizer_dir:
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(path, name))
        if os.path.isfile(os.path.join(tokenizer_dir, "tokenizer.json")):
            tokenizer = Tokenizer.from_dir(tokenizer_dir)
        source_gen = os.path.join(tokenizer_dir, "generation_config.json")
        if os.path.isfile(source_gen):
            with open(source_gen) as fh:
                base = json.load(fh)
    with open(os.path.join(path, "generation_config.json"), "w") as fh:
        json.dump(generation_config(config, tokenizer, base), fh, indent=2)
    return path
