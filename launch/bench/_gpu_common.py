"""Shared pieces of ``bench_gpu.py`` and its child processes: the JSON store, progress lines, the shapes.

The parent (``bench_gpu.py``) and one child at a time (``_gpu_child.py``) update the same ``bench_gpu.json``
(read, modify, atomic replace, under a file lock), each sub-measurement as soon as it is done, so a run cut
short keeps everything measured until then. Nothing here imports JAX or torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile
import time
import traceback
from typing import Any, Callable, Iterator

JSON_NAME = "bench_gpu.json"
SECTIONS = ("env", "peak", "update", "generate", "colocate")
DATASHEET_BF16_PEAK = 989e12
"""H100 / H200 SXM dense bf16 datasheet peak (FLOP/s); the MFU's second denominator."""

START = float(os.environ.get("BENCH_GPU_T0", time.time()))
"""Wall-clock start of the whole benchmark (the parent passes its own to every child)."""

UPDATE_VARIANTS = ("bf16-auto-none", "bf16-blockwise-none", "bf16-auto-full", "bf16-blockwise-full")
"""Actor-update variants, most important first: ``<dtype>-<model.attn_implementation>-<model.remat>``."""

# Qwen2.5-1.5B-like (tied embeddings; the random tiny-random model is a Llama: no qkv bias) and a 2-layer toy.
# Micro-batches of 2 rows (8 per optimizer step): the project's XLA:CPU plan puts remat=none at 65 GiB per device
# with 4-row micro-batches (48 GiB of activations), too close to an H100's 80 GB; 2 rows keep every variant on
# one H100 with room to spare.
UPDATE_SHAPES = {
    "full": {"model": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                           num_kv_heads=2, max_position_embeddings=4096, tie_word_embeddings=True),
             "rows": 16, "prompt": 512, "response": 512, "micro": 2, "repeats": 3},
    "quick": {"model": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                            num_kv_heads=2, max_position_embeddings=256, tie_word_embeddings=True),
              "rows": 4, "prompt": 16, "response": 16, "micro": 2, "repeats": 3},
}
# Qwen2-0.5B-like for generation (a transformers Qwen2ForCausalLM, random, saved as bf16 safetensors).
GENERATE_SHAPES = {
    "full": {"model": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096),
             "batch": 64, "prompt": 128, "new": 128},
    "quick": {"model": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
              "batch": 4, "prompt": 8, "new": 8},
}


SHAPE_OVERRIDES_ENV = "BENCH_GPU_SHAPES"
"""JSON ``{"update": {...}, "generate": {...}}`` merged over the full shapes (``bench_gpu.py --micro / --gen-batch``
set it; the children read it)."""


def full_shapes() -> tuple[dict[str, Any], dict[str, Any]]:
    """The full update and generate shapes with ``$BENCH_GPU_SHAPES`` applied."""
    over = json.loads(os.environ.get(SHAPE_OVERRIDES_ENV) or "{}")
    return {**UPDATE_SHAPES["full"], **over.get("update", {})}, {**GENERATE_SHAPES["full"], **over.get("generate", {})}


def elapsed() -> float:
    return time.time() - START


def log(msg: str) -> None:
    """A progress line with the benchmark's elapsed time."""
    print(f"[bench_gpu {elapsed():7.1f}s] {msg}", flush=True)


def time_left(deadline: float) -> float:
    return deadline - time.time()


def lock_path(path: str) -> str:
    """The lock file of ``path``, kept outside its directory (the output folder holds only results)."""
    key = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"bench_gpu_{key}.lock")


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(lock_path(path), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def update_json(path: str, fn: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Apply ``fn`` to the stored document and write it back atomically; returns the new document."""
    with _locked(path):
        doc = read_json(path)
        fn(doc)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, default=str)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the results from other readers
        os.replace(tmp, path)
    return doc


def set_at(path: str, keys: tuple[str, ...], value: Any, merge: bool = True) -> None:
    """Store ``value`` at ``doc[k0][k1]...`` (dicts merged into what is there when ``merge``)."""
    def apply(doc: dict[str, Any]) -> None:
        node = doc
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        if merge and isinstance(value, dict) and isinstance(node.get(keys[-1]), dict):
            node[keys[-1]].update(value)
        else:
            node[keys[-1]] = value
    update_json(path, apply)


def error_record(err: BaseException) -> dict[str, Any]:
    return {"status": "error", "error": f"{type(err).__name__}: {err}"[:2000],
            "traceback": traceback.format_exc()[-6000:]}


def fmt(value: Any, scale: float = 1.0, digits: int = 2) -> str:
    """A table cell: numbers scaled and rounded, anything else as text, missing as '-'."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value / scale:.{digits}f}"
    return str(value)
