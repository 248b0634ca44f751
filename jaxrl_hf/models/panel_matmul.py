"""A float32 CPU matmul over weights stored in column panels: the projections of the CPU decode loop.

At a decode step's 64 rows XLA:CPU's dot (YNNPACK) runs SmolLM2-135M's projections at ~290-340 GFLOP/s of this
2-core EPYC's ~500 with the weights streaming from memory (docs/BENCHMARKS.md); the kernel here
(``kernels/panel_matmul.cc``, an XLA FFI custom call) runs them at ~470. It reads ``w [K, N]`` in *panel order*:
column panel ``p`` (columns ``48p .. 48p + 47``) row after row, then the last ``N % 48`` columns row after row
(`to_panel_order`), so each panel is one contiguous stream reused from L2 by every 8-row block of ``x``; each
output is one float32 sum over ``k`` in order (XLA's dots differ from it by float32 summation order only).

The library is compiled on first use with the machine's ``g++`` (``-march=native``, ~2 s) into
``$JAXRL_HF_KERNEL_CACHE`` (default ``~/.cache/jaxrl_hf/kernels``), keyed by the source, the flags and jaxlib's
version. `available` says whether this process can use it: an x86-64 CPU with AVX-512, a compiler, and
``JAXRL_HF_CPU_KERNELS`` not ``0``; otherwise callers keep XLA's dot (`jax_engine.JaxGenerationEngine` decides).
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

PANEL = 48
"""Columns per panel (three AVX-512 vectors of float32)."""
TARGET = "jaxrl_hf_panel_matmul"
_SOURCE = Path(__file__).with_name("kernels") / "panel_matmul.cc"
_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
log = logging.getLogger(__name__)


def to_panel_order(w: jnp.ndarray) -> jnp.ndarray:
    """``w [K, N]`` with its elements in panel order (the same shape; see the module docstring)."""
    k, n = w.shape
    full = n - n % PANEL
    panels = w[:, :full].reshape(k, full // PANEL, PANEL).transpose(1, 0, 2).reshape(-1)
    return jnp.concatenate([panels, w[:, full:].reshape(-1)]).reshape(k, n)


def from_panel_order(w_panels: jnp.ndarray) -> jnp.ndarray:
    """`to_panel_order` inverted: the row-major ``[K, N]`` matrix."""
    k, n = w_panels.shape
    full = n - n % PANEL
    flat = w_panels.reshape(-1)
    panels = flat[:k * full].reshape(full // PANEL, k, PANEL).transpose(1, 0, 2).reshape(k, full)
    return jnp.concatenate([panels, flat[k * full:].reshape(k, n - full)], axis=1)


def panel_matmul(x: jnp.ndarray, w_panels: jnp.ndarray) -> jnp.ndarray:
    """``x [M, K] · w [K, N]`` in float32 for ``w_panels = to_panel_order(w)`` (needs `available`)."""
    if x.ndim != 2 or w_panels.ndim != 2 or x.shape[1] != w_panels.shape[0]:
        raise ValueError(f"panel_matmul: x {x.shape} and w {w_panels.shape} are not [M, K] and [K, N]")
    if x.dtype != jnp.float32 or w_panels.dtype != jnp.float32:
        raise ValueError(f"panel_matmul is float32 only, got x {x.dtype} and w {w_panels.dtype}")
    out = jax.ShapeDtypeStruct((x.shape[0], w_panels.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, w_panels)


def _cpu_has_avx512() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "")
    except OSError:
        return False
    return "avx512f" in flags.split()


def _library_path() -> Path:
    digest = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode() + jax.__version__.encode())
    cache = Path(os.environ.get("JAXRL_HF_KERNEL_CACHE") or Path.home() / ".cache" / "jaxrl_hf" / "kernels")
    return cache / f"panel_matmul-{digest.hexdigest()[:16]}.so"


def _build(target: Path) -> None:
    """Compile the kernel into ``target`` (written to a temporary file first, then renamed: atomic)."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (g++ / c++ / $CXX) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", "-o", tmp, str(_SOURCE)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def available() -> bool:
    """Whether `panel_matmul` runs in this process (built and registered with XLA:CPU on the first call)."""
    if os.environ.get("JAXRL_HF_CPU_KERNELS", "1") == "0":
        return False
    if not _cpu_has_avx512():
        return False
    try:
        path = _library_path()
        if not path.exists():
            _build(path)
        handler = ctypes.cdll.LoadLibrary(str(path)).JaxrlHfPanelMatmul
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    except (OSError, RuntimeError) as err:
        log.warning("the float32 CPU decode keeps XLA's dot: the panel matmul kernel is unavailable (%s)", err)
        return False
    return True
