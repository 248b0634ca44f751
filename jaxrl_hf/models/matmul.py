"""Low-precision matmul with float32 accumulation in both directions of autodiff.

``jnp.dot(x, w, preferred_element_type=float32)`` asks for f32 accumulation in the forward pass only: JAX
transposes it into low-precision backward dots. Some backends route only f32-accumulating bf16 dots to their
matrix units, and on any device f32 accumulation keeps the gradients' sums exact to f32. So the backward below is
written out:

    y  = (x · W)           accumulated in f32, stored in x's dtype
    ∂x = (∂y · Wᵀ)         accumulated in f32, stored in x's dtype
    ∂W = (xᵀ · ∂y)         accumulated in f32, stored in W's dtype (the f32 master weights: no bf16 rounding)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxrl_hf.backends.cpu import pair_matmul

# On a CPU backend a bf16 dot with K > 1024 and a row count in ``[lo, hi]`` is computed as ``to`` rows (zero rows
# appended, dropped after): (lo, hi, to). The same product; row counts where XLA:CPU's bf16 dot (YNNPACK) picks a
# slow tiling (docs/CPU_BACKEND.md).
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
    backward in `backends.cpu.pair_matmul.weight_gradient` (``DecoderConfig.pair_kernels``). ``w_transposed``: ``w``
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
    if pair_kernel and ct == jnp.bfloat16:  # XLA:CPU would run this dot in float32 (`backends.cpu.pair_matmul`)
        return dx, pair_matmul.weight_gradient(x, dy).astype(w.dtype)
    dw = jax.lax.dot_general(x.astype(ct), dy, _TN, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


matmul_f32_accumulate.defvjp(_forward, _backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def lm_head_matmul(x: jnp.ndarray, w: jnp.ndarray, targets: jnp.ndarray, w_transposed: bool = False) -> jnp.ndarray:
    """Float32 logits ``x [M, E] · w`` (`matmul_f32_accumulate` with ``f32_out``) whose backward splits the
    logits' cotangent ``∂z`` at each row's scored token ``targets [M]``:

        ∂x = bf16(∂z, ∂z_y := 0) · W  +  ∂z_y · W_y          (float32 sums; W the forward's bf16 weights)
        ∂W = x ⊗ bf16(∂z, ∂z_y := 0)  +  ∂z_y · x added at y   (``w_transposed``: the tied embedding's layout)

    ``∂z`` is ``g·(onehot(y) − p)`` plus an entropy term: its one large entry, at ``y``, is taken exactly in
    float32, and the rest, ``p``-sized and of both signs, is rounded to bf16 with its relative error, so the products
    run as bf16 matmuls. Rounding all of ``∂z`` biased ``∂x``: the ``−1`` of the
    one-hot does not cancel (`tests/test_models_lm_head_matmul.py`). An untied ``w`` (``[E, V]``) keeps the
    float32 ``∂W`` of `matmul_f32_accumulate`. Each row's ``W_y`` is gathered along the vocabulary as the
    leading axis: a gather along axis 1 of a vocabulary-sharded ``[E, V]`` came out wrong inside the sharded
    update program (a dp 4 × tp 2 mesh; correct in isolation)."""
    return matmul_f32_accumulate(x, w, True, False, w_transposed)


def _lm_head_forward(x: jnp.ndarray, w: jnp.ndarray, targets: jnp.ndarray,
                     w_transposed: bool) -> tuple[jnp.ndarray, tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]]:
    return lm_head_matmul(x, w, targets, w_transposed), (x, w, targets)


def _lm_head_backward(w_transposed: bool, saved: tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray],
                      dy: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray, None]:
    x, w, targets = saved
    dy, targets = dy.astype(jnp.float32), targets.astype(jnp.int32)
    at_target = jnp.take_along_axis(dy, targets[:, None], axis=1)  # [M, 1]
    vocab = jnp.arange(dy.shape[1], dtype=jnp.int32)
    rest = jnp.where(vocab[None, :] == targets[:, None], 0.0, dy).astype(x.dtype)  # [M, V]
    wx = w.astype(x.dtype)
    w_target = jnp.take(wx if w_transposed else wx.T, targets, axis=0, mode="clip")  # [M, E]
    dx = _dot_f32(rest, wx, _NN if w_transposed else _NT) + at_target * w_target.astype(jnp.float32)
    if w_transposed:  # ∂Wᵀ [V, E] = restᵀ · x (restᵀ made once: XLA would fold the transpose into a dot whose
        # operands XLA:CPU converts to float32, `backends.cpu.pair_matmul`), then each row's target term at its row
        rest_t = jax.lax.optimization_barrier(rest.T)
        exact = at_target * x.astype(jnp.float32)
        dw = jax.lax.dot_general(rest_t, x, _NN, preferred_element_type=jnp.float32).at[targets].add(exact)
    else:
        dw = jax.lax.dot_general(x.astype(jnp.float32), dy, _TN, preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype), None


lm_head_matmul.defvjp(_lm_head_forward, _lm_head_backward)
