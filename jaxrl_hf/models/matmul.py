"""Low-precision matmul with float32 accumulation in both directions of autodiff.

``jnp.dot(x, w, preferred_element_type=float32)`` asks for f32 accumulation in the forward pass only: JAX
transposes it into low-precision backward dots. On a CPU with bf16 matrix units (this CI's Xeon: AMX) XLA routes
only the f32-accumulating bf16 dots to them (~1.8 TFLOP/s vs ~0.32 for a plain bf16 dot here), and on any
device f32 accumulation keeps the gradients' sums exact to f32. So the backward below is written out:

    y  = (x · W)           accumulated in f32, stored in x's dtype
    ∂x = (∂y · Wᵀ)         accumulated in f32, stored in x's dtype
    ∂W = (xᵀ · ∂y)         accumulated in f32, stored in W's dtype (the f32 master weights: no bf16 rounding)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_hf.models import pair_matmul

# XLA:CPU's bf16 dot (YNNPACK) runs ~2x slower at some row counts below 65 once K > 1024 (measured on a 2-core
# AMD EPYC with AVX512-BF16, jax 0.10.2, `launch/bench/bench_matmul_rows.py`): at 64 rows, a 64-row decode step,
# SmolLM2-135M's down projection takes 0.33-0.40 ms against 0.17-0.19 ms at 65. On a CPU backend a row count
# in ``[lo, hi]`` is computed as ``to`` rows (zero rows appended, dropped after): (lo, hi, to).
CPU_DOT_ROW_PADDING = ((40, 45, 46), (49, 55, 56), (61, 64, 65))
SLOW_CPU_MIN_K = 1025

_NN = (((1,), (0,)), ((), ()))  # [M,K] · [K,N]
_NT = (((1,), (1,)), ((), ()))  # [M,N] · [K,N]ᵀ
_TN = (((0,), (0,)), ((), ()))  # [M,K]ᵀ · [M,N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def matmul_f32_accumulate(x: jnp.ndarray, w: jnp.ndarray, f32_out: bool = False, pair_kernel: bool = False,
                          w_transposed: bool = False) -> jnp.ndarray:
    """``x [M,K] · w [K,N]`` with ``w`` cast to ``x``'s dtype, every product accumulated in float32; the result
    in ``x``'s dtype, or float32 with ``f32_out`` (logits for a softmax). ``pair_kernel``: a bf16 ``∂W`` of the
    backward in `models.pair_matmul.weight_gradient` (``DecoderConfig.pair_kernels``). ``w_transposed``: ``w``
    is stored ``[N, K]`` (a tied LM head's embedding): ``x · wᵀ``, and ``∂W = ∂yᵀ · x`` comes out ``[N, K]``, so
    no transposed copy of a vocabulary-sized gradient is made."""
    y = _dot_f32(x, w.astype(x.dtype), _NT if w_transposed else _NN)
    return y if f32_out else y.astype(x.dtype)


def _dot_f32(x: jnp.ndarray, w: jnp.ndarray, dims: tuple) -> jnp.ndarray:
    """``dot_general(x [M, K], w, dims)`` accumulated in float32; a 16-bit ``x`` with ``K >= SLOW_CPU_MIN_K`` on
    a CPU backend is computed with the rows `CPU_DOT_ROW_PADDING` gives ``M`` (the same rows, bit for bit:
    `tests/test_models_layer_loop.py`)."""
    m, k = x.shape
    rows = padded_cpu_rows(m) if k >= SLOW_CPU_MIN_K and x.dtype.itemsize == 2 else m
    if rows == m or jax.default_backend() != "cpu":
        return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
    padded = jnp.pad(x, ((0, rows - m), (0, 0)))
    return jax.lax.dot_general(padded, w, dims, preferred_element_type=jnp.float32)[:m]


def padded_cpu_rows(m: int) -> int:
    """The row count a CPU bf16 dot of ``m`` rows runs with (`CPU_DOT_ROW_PADDING`; ``m`` outside its bands)."""
    return next((to for lo, hi, to in CPU_DOT_ROW_PADDING if lo <= m <= hi), m)


def _forward(x: jnp.ndarray, w: jnp.ndarray, f32_out: bool, pair_kernel: bool,
             w_transposed: bool) -> tuple[jnp.ndarray, tuple[jnp.ndarray, jnp.ndarray]]:
    return matmul_f32_accumulate(x, w, f32_out, pair_kernel, w_transposed), (x, w)


def _backward(f32_out: bool, pair_kernel: bool, w_transposed: bool, saved: tuple[jnp.ndarray, jnp.ndarray],
              dy: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    x, w = saved
    # f32 logits keep an f32 cotangent: softmax − one-hot rounded to bf16 moved the tiny model's gradient norm
    # by 10% (tests/test_workers_mixed_precision.py); elsewhere the cotangent is in the compute dtype already.
    ct = jnp.float32 if f32_out else x.dtype
    dy = dy.astype(ct)
    dx = _dot_f32(dy, w.astype(ct), _NN if w_transposed else _NT).astype(x.dtype)
    if w_transposed:  # ∂Wᵀ [N, K] = ∂yᵀ · x
        return dx, jax.lax.dot_general(dy, x.astype(ct), _TN, preferred_element_type=jnp.float32).astype(w.dtype)
    if pair_kernel and ct == jnp.bfloat16:  # XLA:CPU would run this dot in float32 (`models.pair_matmul`)
        return dx, pair_matmul.weight_gradient(x, dy).astype(w.dtype)
    dw = jax.lax.dot_general(x.astype(ct), dy, _TN, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


matmul_f32_accumulate.defvjp(_forward, _backward)
