"""A float32 matmul over weights stored in column panels: the projections of the CPU decode program.

``panel_matmul(x, w_panels)`` is ``x [M, K] · w [K, N]`` for ``w_panels = to_panel_order(w)``: column panel ``p``
(columns ``48p .. 48p + 47``) row after row, then the last ``N % 48`` columns row after row, so each panel is one
contiguous stream that ``kernels/panel_matmul.cc`` reuses from L2 for every 8-row block of a 256-row chunk of
``x``; each output is one float32 sum over ``k`` in order (XLA's dot differs from it by float32 summation order).
At 64 rows it runs SmolLM2-135M's projections ~1.4x faster than XLA:CPU's dot (`launch/bench/bench_cpu_kernels.py`).
Built and registered by `backends.cpu.ffi` (`ffi.available`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PANEL = 48
"""Columns per panel (three AVX-512 vectors of float32)."""


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
    """``x [M, K] · w [K, N]`` in float32 for ``w_panels = to_panel_order(w)`` (needs `ffi.available`)."""
    if x.ndim != 2 or w_panels.ndim != 2 or x.shape[1] != w_panels.shape[0]:
        raise ValueError(f"panel_matmul: x {x.shape} and w {w_panels.shape} are not [M, K] and [K, N]")
    if x.dtype != jnp.float32 or w_panels.dtype != jnp.float32:
        raise ValueError(f"panel_matmul is float32 only, got x {x.dtype} and w {w_panels.dtype}")
    out = jax.ShapeDtypeStruct((x.shape[0], w_panels.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("jaxrl_hf_panel_matmul", out)(x, w_panels)
