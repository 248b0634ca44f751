"""The peak FLOP/s of one device, measured once per machine, for ``perf/mfu/actor``.

MFU needs a peak. A GPU's datasheet number is known (``trainer.peak_flops_per_device``); a CPU's is not, and a
datasheet number would not say what XLA reaches there anyway. So when no peak is configured, the actor worker
times short jitted square matmuls in each compute dtype on its first device and takes the best rate seen in any
of them: what the host can do (dtypes differ widely between CPUs: one with AMX tiles multiplies bfloat16 several
times faster than float32, one without may be slower in bfloat16). The same rates choose ``model.dtype=auto``
(`resolve_compute_dtype`). XLA:CPU host devices share the host's cores, so on CPU the measured rate is divided
among the host's devices.

The result is cached in a small JSON file keyed by platform, device kind, core count, dtype and JAX version
(``$JAXRL_HF_PEAK_CACHE``, default ``~/.cache/jaxrl_hf/peak_flops.json``), so only a machine's first run pays the
second or two it takes.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp

CACHE_ENV = "JAXRL_HF_PEAK_CACHE"
MATMUL_SIZES = {"cpu": (1024, 2048)}
"""Sides of the calibration matmuls per platform (others: 8192, large enough to fill a GPU's tensor cores)."""
REPEATS = 5


def cache_path() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jaxrl_hf", "peak_flops.json")


def machine_key(device: Any, dtype: str) -> str:
    """What the measured peak depends on: platform, device kind, visible cores, dtype, JAX version."""
    kind = getattr(device, "device_kind", "?")
    return f"{device.platform}|{kind}|cores={os.cpu_count()}|{jnp.dtype(dtype).name}|jax={jax.__version__}"


def matmul_rate(device: Any, dtype: Any, n: int, repeats: int = REPEATS) -> float:
    """FLOP/s of the best of ``repeats`` timed ``[n,n] @ [n,n]`` products (2·n³ FLOPs each), after one warm-up.

    The result is accumulated in float32 (``preferred_element_type``), as the model's matmuls are."""
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    b = jax.device_put(jnp.full((n, n), 0.5, dtype), device)
    product = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
    product(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best


def measure_device_peak(device: Any, dtype: str) -> float:
    """The best ``dtype`` matmul rate of ``device`` over the platform's calibration sizes (FLOP/s)."""
    return max(matmul_rate(device, jnp.dtype(dtype), n) for n in MATMUL_SIZES.get(device.platform, (8192,)))


def _read_cache(path: str) -> dict[str, float]:
    try:
        with open(path) as f:
            data = json.load(f)
        return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}  # a missing or damaged cache is measured again


def _write_cache(path: str, data: dict[str, float]) -> None:
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)  # atomic: concurrent workers never see half a file
    except OSError:
        pass  # a read-only home only costs a re-measurement next run


def measured_peak(device: Any, dtype: str) -> float:
    """The cached peak of ``device``'s kind on the host; measured (under a file lock, so processes starting
    together neither measure at once nor slow each other's measurement) when not cached yet."""
    path, key = cache_path(), machine_key(device, dtype)
    cached = _read_cache(path).get(key)
    if cached:
        return cached
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        cache = _read_cache(path)
        if not cache.get(key):
            cache[key] = measure_device_peak(device, dtype)
            _write_cache(path, cache)
    return cache[key]


def peak_flops_per_device(configured: float | None = None, processes_per_host: int = 1,
                          dtype: str = "float32") -> float:
    """``configured`` when given, else the host's measured ``dtype`` peak per device: on CPU the host's rate
    shared by all devices of the ``processes_per_host`` processes on it; an accelerator's own rate elsewhere."""
    if configured:
        return float(configured)
    device = jax.local_devices()[0]
    shared = jax.local_device_count() * max(processes_per_host, 1) if device.platform == "cpu" else 1
    return measured_peak(device, dtype) / shared


COMPUTE_DTYPES = ("float32", "bfloat16")


def dtype_rates(device: Any) -> dict[str, float]:
    """The peak of ``device`` in each of `COMPUTE_DTYPES` (each measured once, cached)."""
    return {dtype: measured_peak(device, dtype) for dtype in COMPUTE_DTYPES}


def resolve_compute_dtype(dtype: str, accelerator: bool) -> tuple[str, str]:
    """``model.dtype`` as a worker computes in it: ``auto`` becomes ``bfloat16`` with an accelerator (tensor
    cores), else the faster of `COMPUTE_DTYPES` on this host's CPU (`dtype_rates`); any other value stays. Returns
    (dtype, why)."""
    if dtype != "auto":
        return dtype, "as configured"
    if accelerator:
        return "bfloat16", "an accelerator's tensor cores"
    rates = dtype_rates(jax.devices("cpu")[0])
    listed = ", ".join(f"{d} {rate / 1e9:.0f} GFLOP/s" for d, rate in rates.items())
    return max(rates, key=rates.get), f"the faster on this host's CPU ({listed})"


def mfu_summary(model_config: Any, params: Any, configured: float | None, processes_per_host: int) -> dict[str, Any]:
    """What the driver needs for ``perf/mfu/actor``: the model's matmul parameter count (the full model's, also
    under LoRA; an untied input embedding is a lookup, left out; a mixture of experts: the active ones), its
    layers, attention width (heads × head_dim)
    and the peak FLOP/s per device: the best rate the device reaches in any of `COMPUTE_DTYPES` (so an MFU is of what
    the machine can do, whichever dtype the model computes in), or ``configured``."""
    total = int(sum(x.size for x in jax.tree.leaves(params)))
    if model_config.is_moe:  # a token runs the router and k experts of a sparse layer (and a mixed model's params
        total = model_config.num_params(active=True)  # hold unused dense/expert leaves per layer): N_active
    lookup = 0 if model_config.tie_word_embeddings else model_config.vocab_size * model_config.hidden_size
    return {"model_params": total - lookup,  # the input embedding is a gather, not a matmul (unless tied)
            "num_layers": int(model_config.num_hidden_layers),
            "attn_dim": int(model_config.num_attention_heads * model_config.head_dim),
            "peak_flops_per_device": max(peak_flops_per_device(configured, processes_per_host, dtype)
                                         for dtype in COMPUTE_DTYPES)}
