"""The float32 CPU kernels: C++ sources in ``csrc/`` called as XLA FFI custom calls.

* ``csrc/panel_matmul.cc``: ``x [M, K] · w [K, N]`` over ``w`` stored in panel order (`backends.cpu.panel_matmul`);
* ``csrc/cache_attention.cc``: one layer's attention over a KV cache that holds the new keys already, keys
  stored transposed (`cache_attention`; `attention.stored_attention` calls it);
* ``csrc/clip_adamw.cc``: the optimizer update (clip + AdamW) of every parameter in one pass, in place
  (`backends.cpu.fused_adamw`);
* ``csrc/pair_matmul.cc``: bf16 products with float32 accumulation on AVX512-BF16, over an operand packed in
  pairs (`backends.cpu.pair_matmul`; where `bf16_pairs` says the CPU has the instructions).

The first two run the decode program, the third the train step, the fourth the bf16 training's weight gradients.
All share their work among XLA's intra-op threads (the calling thread claims work too, so it never waits on a task
that has not started). Their speed against XLA's own dot and attention is measured per machine by
`launch/bench/bench_cpu_kernels.py` (docs/BENCHMARKS.md).

The library is compiled on first use with the machine's ``g++`` (``-march=native``, ~3 s) into
``$JAXRL_HF_KERNEL_CACHE`` (default ``~/.cache/jaxrl_hf/kernels``), keyed by the sources, the flags, jax's
version and the CPU's model and flags, written to a temporary file and renamed (concurrent processes never load
half a file). `available` says whether this process can use it: an x86-64 CPU with AVX-512 (F, BW, VL), a
compiler; otherwise, and with ``model.cpu_backend: off``, the engine and the train step keep XLA's ops
(`jax_engine.JaxGenerationEngine`, `backends.cpu.fused_adamw.fused_update_for`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

KERNELS = Path(__file__).with_name("csrc")
TARGETS = {"jaxrl_hf_panel_matmul": ("panel_matmul.cc", "JaxrlHfPanelMatmul"),
           "jaxrl_hf_cache_attention": ("cache_attention.cc", "JaxrlHfCacheAttention"),
           "jaxrl_hf_clip_adamw": ("clip_adamw.cc", "JaxrlHfClipAdamW"),
           "jaxrl_hf_pair_matmul": ("pair_matmul.cc", "JaxrlHfPairMatmul"),
           "jaxrl_hf_pack_pairs": ("pair_matmul.cc", "JaxrlHfPackPairs")}
"""XLA custom-call target -> (source file, handler symbol)."""
HEADERS = ("shared_items.h",)
"""Headers the sources include (part of the library's cache key)."""
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")
log = logging.getLogger(__name__)


def cache_attention(q: jnp.ndarray, kt: jnp.ndarray, v: jnp.ndarray, mask: jnp.ndarray, scale: float) -> jnp.ndarray:
    """``softmax(where(mask, scale · q·kᵀ, NEG_INF)) · v`` in float32 for queries ``q [B, T, K, G, D]`` over keys
    ``kt [B, K, D, S]`` and values ``v [B, K, S, D]``, ``mask [B, T, S]`` (bool): ``[B, T, K, G, D]`` (needs
    `available`). A fully masked row averages every slot's value, as XLA's softmax over ``NEG_INF`` does."""
    b, t, k, g, d = q.shape
    if kt.shape[:3] != (b, k, d) or v.shape != (b, k, kt.shape[3], d) or mask.shape != (b, t, kt.shape[3]):
        raise ValueError(f"cache_attention: q {q.shape}, kt {kt.shape}, v {v.shape}, mask {mask.shape} do not fit "
                         "[B, T, K, G, D], [B, K, D, S], [B, K, S, D], [B, T, S]")
    rows = q.astype(jnp.float32).transpose(0, 2, 3, 1, 4).reshape(b, k, g * t, d)  # row m: group m // T, query m % T
    out = jax.ffi.ffi_call("jaxrl_hf_cache_attention", jax.ShapeDtypeStruct(rows.shape, jnp.float32))(
        rows, kt.astype(jnp.float32), v.astype(jnp.float32), mask.astype(bool), scale=np.float32(scale))
    return out.reshape(b, k, g, t, d).transpose(0, 3, 1, 2, 4)


@functools.cache
def _cpu_identity() -> str:
    """This CPU's model name and feature flags (``/proc/cpuinfo``, read once; empty where unreadable): asked at
    every trace of a weight gradient (`bf16_pairs`)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    first = lambda key: next((line for line in lines if line.startswith(key)), "")  # noqa: E731
    return f"{first('model name')}\n{first('flags')}"


def _cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return set(_CPU_FLAGS) <= cpu_flags()


def _sources() -> list[Path]:
    return [KERNELS / source for source in dict.fromkeys(source for source, _ in TARGETS.values())]


def _library_path() -> Path:
    # -march=native: a library is built for the host's CPU (a cache shared by several hosts keeps one per CPU)
    inputs = _sources() + [KERNELS / header for header in HEADERS]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in inputs) + " ".join(_FLAGS).encode()
                            + jax.__version__.encode() + _cpu_identity().encode())
    cache = Path(os.environ.get("JAXRL_HF_KERNEL_CACHE") or Path.home() / ".cache" / "jaxrl_hf" / "kernels")
    return cache / f"cpu_kernels-{digest.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    """Compile the kernels into ``target`` (written to a temporary file first, then renamed: atomic)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ / c++ / $CXX) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", "-o", tmp, *map(str, _sources())]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def cpu_flags() -> set[str]:
    """This CPU's feature flags (``/proc/cpuinfo``; empty where unreadable)."""
    return set(_cpu_identity().split("\n")[-1].split())


def bf16_pairs() -> bool:
    """Whether `backends.cpu.pair_matmul` runs here: the kernels `available` and the CPU has AVX512-BF16."""
    return "avx512_bf16" in cpu_flags() and available()


@functools.cache
def available() -> bool:
    """Whether the kernels run in this process (built and registered with XLA:CPU on the first call)."""
    if not _cpu_supported():
        return False
    try:
        path = _library_path()
        if not path.exists():
            _build(path)
        library = ctypes.cdll.LoadLibrary(str(path))
        for target, (_, symbol) in TARGETS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    except (OSError, RuntimeError, AttributeError) as err:
        log.warning("the CPU kernels are unavailable, XLA's ops run instead (%s)", err)
        return False
    return True
