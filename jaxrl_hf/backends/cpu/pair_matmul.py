"""The weight gradients of bf16 training in a kernel of ours on a CPU with AVX512-BF16 (`kernels/pair_matmul.cc`).

`models.matmul.matmul_f32_accumulate`'s backward computes ``∂W = xᵀ · ∂y`` (bf16 operands, float32 sums) here
where ``DecoderConfig.pair_kernels`` is set: XLA:CPU's ``operand_upcaster`` converts both operands of that dot
(its left operand contracts over its major dimension) to float32 and runs Eigen's float32 dot, while the forward
and input-gradient dots run on YNNPACK in bf16; the kernel keeps the weight gradient in bf16 with float32 sums
(docs/CPU_BACKEND.md).

The kernel multiplies a row-major bf16 ``a`` by a ``b`` packed in pairs along its contraction (`pack_pairs`) with
``vdpbf16ps`` (two bf16 products added into one float32 lane): ``a`` is ``xᵀ`` with the rows of ``x`` in pairs
(`row_pairs_transposed`, an XLA transpose of the activations), ``b`` is ``∂y``. No weight is packed or copied.
Each sum is float32 over the rows in order, as XLA's up to summation order; bf16 denormals (below ~1e-38) count as
zero (`tests/test_models_pair_matmul.py`).

On a CPU with AMX (``amx_bf16``) XLA's bf16 dots run on the matrix units and the training programs keep them
(`wanted`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_hf.backends.cpu import ffi
from jaxrl_hf.models.config import DecoderConfig

PANEL = 48
"""Columns per packed panel (three AVX-512 vectors of float32 sums)."""


def wanted(dtype: str, mesh: Any = None, cpu_backend: str = "auto") -> bool:
    """Whether the training programs of a model in compute ``dtype`` use the kernel: ``model.cpu_backend`` not
    ``off``, bf16, one CPU device, the kernel available (`ffi.bf16_pairs`) and no AMX (where XLA's dot
    runs on the matrix units)."""
    devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
    if cpu_backend == "off" or dtype != "bfloat16" or len(devices) != 1 or devices[0].platform != "cpu":
        return False
    if "amx_bf16" in ffi.cpu_flags():
        return False
    return ffi.bf16_pairs()


def training_config(config: DecoderConfig, mesh: Any = None, cpu_backend: str = "auto") -> DecoderConfig:
    """``config`` for the training programs (update and log-probs): ``pair_kernels`` set where `wanted`."""
    return config.replace(pair_kernels=True) if wanted(config.dtype, mesh, cpu_backend) else config


def pack_pairs(b: jnp.ndarray) -> jnp.ndarray:
    """``b [K, N]`` in bf16, packed in column panels of `PANEL`, each a run of k-pairs of 48 (``b[2j, c]``,
    ``b[2j + 1, c]``) units (``K`` even, ``N % 48 == 0``)."""
    k, n = b.shape
    if k % 2 or n % PANEL:
        raise ValueError(f"pack_pairs: b {b.shape} needs an even K and N a multiple of {PANEL}")
    return jax.ffi.ffi_call("jaxrl_hf_pack_pairs", jax.ShapeDtypeStruct(b.shape, jnp.bfloat16))(b.astype(jnp.bfloat16))


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


def weight_gradient(x: jnp.ndarray, dy: jnp.ndarray) -> jnp.ndarray:
    """``xᵀ · dy`` ``[K, N]`` float32 for ``x [M, K]`` and ``dy [M, N]`` in bf16 (rows padded to even, ``dy``'s
    columns to a multiple of `PANEL` and dropped again)."""
    if not ffi.bf16_pairs():  # the kernel's instructions would fault: say why instead
        raise ValueError("DecoderConfig.pair_kernels: the bf16 pair kernel does not run here (it needs an x86-64 "
                         "CPU with AVX512-BF16, g++, and model.cpu_backend not off); set it through "
                         "pair_matmul.training_config, which checks")
    (m, _), n = x.shape, dy.shape[1]
    dy = jnp.pad(dy.astype(jnp.bfloat16), ((0, m % 2), (0, -n % PANEL)))
    dw = pair_product(row_pairs_transposed(x.astype(jnp.bfloat16)), pack_pairs(dy))
    return dw if dw.shape[1] == n else dw[:, :n]
