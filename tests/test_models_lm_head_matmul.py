"""`models.matmul.lm_head_matmul`'s backward (the log-prob's cotangent split at the scored token, the rest in bf16)
against float64 on the same bf16-rounded operands the forward multiplies.

The weights carry a large component common to every vocabulary entry (an embedding's mean): the cotangent
``g·(onehot(y) − p)`` sums to zero over the vocabulary, so that component cancels in exact arithmetic, and rounding
the whole cotangent to bf16 leaves ``|1 − p_y|·2⁻⁹`` of it in ``∂x`` (the bias the split avoids)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf.models.matmul import lm_head_matmul, matmul_f32_accumulate

M, E, V = 24, 32, 512


def operands(vocab_major: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(M, E)), jnp.bfloat16)
    w = 1.0 + 0.05 * rng.normal(size=(V, E))  # the common component: 1.0 in every entry
    w = jnp.asarray(w if vocab_major else w.T, jnp.float32)
    targets = jnp.asarray(rng.integers(0, V, size=M), jnp.int32)
    return x, w, targets, jnp.asarray(rng.normal(size=M), jnp.float32)


def cotangent(logits: np.ndarray, targets: np.ndarray, g: np.ndarray) -> np.ndarray:
    """``∂z`` of ``Σ_m g_m log softmax(z_m)[y_m]``: ``g·(onehot(y) − p)`` (float64)."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    return g[:, None] * (np.eye(logits.shape[1])[targets] - p)


def backward(fn, x, w, dz):
    _, vjp = jax.vjp(fn, x, w)
    return (np.asarray(a, np.float64) for a in vjp(jnp.asarray(dz, jnp.float32)))


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("vocab_major", [False, True])
def test_split_backward_matches_float64(vocab_major):
    x, w, targets, g = operands(vocab_major)
    logits = lm_head_matmul(x, w, targets, vocab_major)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(matmul_f32_accumulate(x, w, True, False, vocab_major)))
    dz = cotangent(np.asarray(logits, np.float64), np.asarray(targets), np.asarray(g, np.float64))
    x64, w64 = np.asarray(x, np.float64), np.asarray(w.astype(jnp.bfloat16), np.float64)
    wv = w64 if vocab_major else w64.T  # [V, E]
    dx_ref, dw_ref = dz @ wv, (dz.T @ x64 if vocab_major else x64.T @ dz)
    dx, dw = backward(lambda a, b: lm_head_matmul(a, b, targets, vocab_major), x, w, dz)
    assert rel(dx, dx_ref) < 2 ** -8  # ∂x is stored in bf16 (measured 2.6e-3)
    # tied (vocab-major): the rest of ∂z in bf16, 2⁻⁹ relative each, of both signs (measured 7.7e-5); untied: float32
    assert rel(dw, dw_ref) < (5e-4 if vocab_major else 1e-6)
    # rounding the whole cotangent (target entry included) to bf16 leaves the common component in ∂x
    dx_all_bf16 = np.asarray(jnp.asarray(dz, jnp.bfloat16), np.float64) @ wv
    assert rel(dx_all_bf16, dx_ref) > 5 * rel(dx, dx_ref)


def test_target_entries_are_taken_in_float32():
    """A cotangent at the targets only (``p`` = 0): both products equal the float32 ones to float32 rounding."""
    x, w, targets, g = operands(vocab_major=True, seed=1)
    dz = np.zeros((M, V))
    dz[np.arange(M), np.asarray(targets)] = 1.0 + 2.0 ** -12 + np.asarray(g)  # not representable in bf16
    dx, dw = backward(lambda a, b: lm_head_matmul(a, b, targets, True), x, w, dz)
    dx32, dw32 = backward(lambda a, b: matmul_f32_accumulate(a, b, True, False, True), x, w, dz)
    np.testing.assert_allclose(dw, dw32, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, dx32, rtol=2 ** -7, atol=1e-6)  # stored in bf16: at most one ulp apart
