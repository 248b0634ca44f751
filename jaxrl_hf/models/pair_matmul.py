"""bf16 projections of the training forward and backward on a CPU with AVX512-BF16 (`kernels/pair_matmul.cc`).

``matmul(x, w)`` is `models.matmul.matmul_f32_accumulate` (``f32_out`` False) computed by the pair kernel:

    y  = x · W          x [M, K] bf16, W cast to bf16, each sum over k in float32
    ∂x = ∂y · Wᵀ        in float32, stored in x's dtype
    ∂W = xᵀ · ∂y        in float32, stored in W's dtype (the float32 master weights)

The kernel multiplies a row-major bf16 ``a`` by a ``b`` packed in pairs along its contraction (`pack_pairs`), with
``vdpbf16ps`` (two bf16 products added into one float32 lane). Each product packs one operand: ``W`` for ``y``,
``Wᵀ`` for ``∂x`` (both once per weight and call, shared by every pass of an update through XLA's CSE), ``∂y``
for ``∂W``, whose ``a`` is ``xᵀ`` in row pairs (an XLA transpose of the activations). Where XLA:CPU's bf16 dot
runs on YNNPACK at the default run's 64-128 rows it reaches ~300-510 GFLOP/s of this 2-core EPYC's ~960; the pair
kernel 470-690 (`launch/bench/bench_cpu_kernels.py`). XLA's weight-gradient dot upcasts to float32 (Eigen).
On a CPU with AMX (``amx_bf16``) XLA's own dot is faster, and the training programs keep it (`wanted`).

The numbers are XLA's up to float32 summation order, and bf16 denormals (below ~1e-38) count as zero
(`tests/test_models_pair_matmul.py`).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf.models import cpu_kernels
from jaxrl_hf.models.config import DecoderConfig

PANEL = 48
"""Columns per packed panel (three AVX-512 vectors of float32 sums)."""


def fits(fan_in: int, fan_out: int) -> bool:
    """Whether a ``[fan_in, fan_out]`` weight runs in the kernel: both multiples of `PANEL` (the forward's and
    ∂W's panels run over ``fan_out``, ∂x's over ``fan_in``)."""
    return fan_in % PANEL == 0 and fan_out % PANEL == 0 and fan_in > 0 and fan_out > 0


def wanted(dtype: str, mesh: Any = None) -> bool:
    """Whether the training programs of a model in compute ``dtype`` use the kernel: bf16, one CPU device, the
    kernel available (`cpu_kernels.bf16_pairs`), no AMX (where XLA's dot runs on the matrix units) and
    ``JAXRL_HF_PAIR_KERNELS`` not ``0``."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    if dtype != "bfloat16" or len(devices) != 1 or devices[0].platform != "cpu":
        return False
    if os.environ.get("JAXRL_HF_PAIR_KERNELS", "1") == "0" or "amx_bf16" in cpu_kernels.cpu_flags():
        return False
    return cpu_kernels.bf16_pairs()


def training_config(config: DecoderConfig, mesh: Any = None) -> DecoderConfig:
    """``config`` for the training programs (update and log-probs): ``pair_kernels`` set where `wanted`."""
    return config.replace(pair_kernels=True) if wanted(config.dtype, mesh) else config


def pack_pairs(src: jnp.ndarray, transpose: bool = False) -> jnp.ndarray:
    """``b`` for the kernel: ``src`` (``transpose``: its transpose) ``[K, N]`` in bf16, packed in column panels of
    `PANEL`, each a run of k-pairs of 48 (``b[2j, c]``, ``b[2j + 1, c]``) units (``K`` even, ``N % 48 == 0``)."""
    rows, cols = src.shape
    shape = (cols, rows) if transpose else (rows, cols)
    if shape[0] % 2 or shape[1] % PANEL:
        raise ValueError(f"pack_pairs: b {shape} needs an even K and N a multiple of {PANEL}")
    out = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    return jax.ffi.ffi_call("jaxrl_hf_pack_pairs", out)(src.astype(jnp.bfloat16), transpose=np.int64(transpose))


def pair_product(a: jnp.ndarray, b_pairs: jnp.ndarray) -> jnp.ndarray:
    """``a [M, K] · b [K, N]`` float32 for ``a`` bf16 row-major and ``b_pairs = pack_pairs(b)``."""
    if a.ndim != 2 or b_pairs.ndim != 2 or a.shape[1] != b_pairs.shape[0]:
        raise ValueError(f"pair_product: a {a.shape} and b {b_pairs.shape} are not [M, K] and [K, N]")
    out = jax.ShapeDtypeStruct((a.shape[0], b_pairs.shape[1]), jnp.float32)
    return jax.ffi.ffi_call("jaxrl_hf_pair_matmul", out)(a.astype(jnp.bfloat16), b_pairs)


def row_pairs_transposed(x: jnp.ndarray) -> jnp.ndarray:
    """``xᵀ [K, M']`` with the rows of ``x [M, K]`` in pairs (``M'`` = ``M`` rounded up to even, a zero row added):
    unit ``(k, j)`` = ``x[2j, k], x[2j + 1, k]``, the ``a`` of ∂W = xᵀ · ∂y."""
    m, k = x.shape
    x = jnp.pad(x, ((0, m % 2), (0, 0)))
    return x.reshape(-1, 2, k).transpose(2, 0, 1).reshape(k, -1)


@jax.custom_vjp
def matmul(x: jnp.ndarray, w: jnp.ndarray) -> jnp.ndarray:
    """``x [M, K] · w [K, N]`` in bf16 (``w`` cast), float32 sums forward and backward (module docstring)."""
    return pair_product(x, pack_pairs(w)).astype(x.dtype)


def _forward(x: jnp.ndarray, w: jnp.ndarray) -> tuple[jnp.ndarray, tuple[jnp.ndarray, jnp.ndarray]]:
    return matmul(x, w), (x, w)


def _backward(saved: tuple[jnp.ndarray, jnp.ndarray], dy: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    x, w = saved
    dy = dy.astype(jnp.bfloat16)
    dx = pair_product(dy, pack_pairs(w, transpose=True)).astype(x.dtype)
    dy_rows = jnp.pad(dy, ((0, dy.shape[0] % 2), (0, 0)))
    dw = pair_product(row_pairs_transposed(x.astype(jnp.bfloat16)), pack_pairs(dy_rows)).astype(w.dtype)
    return dx, dw


matmul.defvjp(_forward, _backward)
