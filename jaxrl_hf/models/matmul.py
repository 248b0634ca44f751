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

_NN = (((1,), (0,)), ((), ()))  # [M,K] · [K,N]
_NT = (((1,), (1,)), ((), ()))  # [M,N] · [K,N]ᵀ
_TN = (((0,), (0,)), ((), ()))  # [M,K]ᵀ · [M,N]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul_f32_accumulate(x: jnp.ndarray, w: jnp.ndarray, f32_out: bool = False) -> jnp.ndarray:
    """``x [M,K] · w [K,N]`` with ``w`` cast to ``x``'s dtype, every product accumulated in float32; the result
    in ``x``'s dtype, or float32 with ``f32_out`` (logits for a softmax)."""
    y = jax.lax.dot_general(x, w.astype(x.dtype), _NN, preferred_element_type=jnp.float32)
    return y if f32_out else y.astype(x.dtype)


def _forward(x: jnp.ndarray, w: jnp.ndarray, f32_out: bool) -> tuple[jnp.ndarray, tuple[jnp.ndarray, jnp.ndarray]]:
    return matmul_f32_accumulate(x, w, f32_out), (x, w)


def _backward(f32_out: bool, saved: tuple[jnp.ndarray, jnp.ndarray],
              dy: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    x, w = saved
    # f32 logits keep an f32 cotangent: softmax − one-hot rounded to bf16 moved the tiny model's gradient norm
    # by 10% (tests/test_workers_mixed_precision.py); elsewhere the cotangent is in the compute dtype already.
    ct = jnp.float32 if f32_out else x.dtype
    dy = dy.astype(ct)
    dx = jax.lax.dot_general(dy, w.astype(ct), _NT, preferred_element_type=jnp.float32).astype(x.dtype)
    dw = jax.lax.dot_general(x.astype(ct), dy, _TN, preferred_element_type=jnp.float32).astype(w.dtype)
    return dx, dw


matmul_f32_accumulate.defvjp(_forward, _backward)
