"""The speed-motivated model forms compute the same thing: unrolled vs scanned layers, the 2-D projection
matmul, and the f32-accumulating low-precision matmul against a float64 reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf.config.schema import TinyModelConfig
from jaxrl_hf.models import init_params
from jaxrl_hf.models.forward import next_token_targets, token_log_probs_and_entropy
from jaxrl_hf.models.matmul import CPU_DOT_ROW_PADDING, SLOW_CPU_MIN_K, matmul_f32_accumulate, padded_cpu_rows
from jaxrl_hf.workers.common import tiny_decoder_config


def _model(dtype: str):
    config = tiny_decoder_config(TinyModelConfig(hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                                                 intermediate_size=64, vocab_size=97), dtype, "none")
    return config, init_params(config, 0)


def _loss_and_grads(config, params):
    ids = jnp.asarray(np.random.RandomState(1).randint(0, config.vocab_size, (3, 11)), jnp.int32)
    mask = jnp.ones_like(ids).at[0, :4].set(0)  # a left-padded row

    def loss(p):
        logp, ent = token_log_probs_and_entropy(p, config, ids, next_token_targets(ids), mask)
        return -(logp * mask).sum() + 0.1 * (ent * mask).sum()

    return jax.value_and_grad(loss)(params)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_unrolled_layers_match_the_layer_loop(dtype, tol):
    config, params = _model(dtype)
    scanned = _loss_and_grads(config, params)
    unrolled = _loss_and_grads(dataclasses.replace(config, scan_layers=False), params)
    assert float(unrolled[0]) == pytest.approx(float(scanned[0]), rel=tol)
    for a, b in zip(jax.tree.leaves(scanned[1]), jax.tree.leaves(unrolled[1])):
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=tol, atol=tol)


def test_f32_accumulating_matmul_and_its_gradients_against_float64():
    """y = x·W, ∂x = ∂y·Wᵀ, ∂W = xᵀ·∂y for bf16 inputs: each within bf16 rounding of the float64 result, and ∂W
    comes back in W's dtype (f32 master weights) without bf16 rounding."""
    rng = np.random.RandomState(0)
    x64, w64, dy64 = rng.randn(37, 300), rng.randn(300, 19) * 0.1, rng.randn(37, 19)
    x, w = jnp.asarray(x64, jnp.bfloat16), jnp.asarray(w64, jnp.float32)
    xq, wq = np.asarray(x, np.float64), np.asarray(w.astype(jnp.bfloat16), np.float64)  # what the dots see
    for f32_out in (False, True):
        y, vjp = jax.vjp(lambda a, b: matmul_f32_accumulate(a, b, f32_out), x, w)
        assert y.dtype == (jnp.float32 if f32_out else jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(y, np.float64), xq @ wq, rtol=1e-2, atol=1e-2)
        dy = jnp.asarray(dy64, y.dtype)
        dx, dw = vjp(dy)
        # the cotangent of bf16 outputs is bf16; that of f32 logits stays f32 (and meets W in f32)
        dyq = np.asarray(dy if f32_out else dy.astype(jnp.bfloat16), np.float64)
        wb = np.asarray(w, np.float64) if f32_out else wq
        assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(dx, np.float64), dyq @ wb.T, rtol=1e-2, atol=2e-2)
        # ∂W sums 37 products in f32 and is not rounded to bf16: far tighter than bf16's 2^-8
        np.testing.assert_allclose(np.asarray(dw, np.float64), xq.T @ dyq, rtol=1e-5, atol=1e-5)


def test_slow_cpu_row_counts_are_padded_and_give_the_same_rows():
    """A bf16 dot with K > 1024 whose row count falls in one of XLA:CPU's slow bands runs with zero rows appended
    on a CPU backend (`models/matmul.CPU_DOT_ROW_PADDING`): the rows equal the plain dot's bit for bit, the
    forward ``x·W`` and the backward ``∂y·Wᵀ``; other row counts are not padded."""
    rng = np.random.RandomState(3)
    k = SLOW_CPU_MIN_K
    plain = jax.jit(lambda a, b, dims: jax.lax.dot_general(a, b.astype(a.dtype), dims,
                                                           preferred_element_type=jnp.float32), static_argnums=2)
    assert [padded_cpu_rows(m) for m in (39, 40, 45, 46, 48, 49, 55, 56, 60, 61, 64, 65)] == \
        [39, 46, 46, 46, 48, 56, 56, 56, 60, 65, 65, 65]
    for rows in (48, *(lo for lo, _, _ in CPU_DOT_ROW_PADDING), 64, 65):
        in_band = padded_cpu_rows(rows) != rows
        # forward: x [rows, K] · W [K, 40] (the decode MLP's down projection)
        x, w = jnp.asarray(rng.randn(rows, k), jnp.bfloat16), jnp.asarray(rng.randn(k, 40) * 0.05, jnp.float32)
        f = jax.jit(lambda a, b: matmul_f32_accumulate(a, b, True))
        assert ("pad(" in f.lower(x, w).compile().as_text()) == in_band, rows
        np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(plain(x, w, (((1,), (0,)), ((), ())))))
        # backward: ∂x = ∂y [rows, K] · Wᵀ for x [rows, 40] · W [40, K]
        x2, w2 = jnp.asarray(rng.randn(rows, 40), jnp.bfloat16), jnp.asarray(rng.randn(40, k) * 0.05, jnp.float32)
        dy = jnp.asarray(rng.randn(rows, k), jnp.bfloat16)
        grad_x = jax.jit(lambda a, b, d: jax.vjp(lambda u: matmul_f32_accumulate(u, b), a)[1](d)[0])
        assert ("pad(" in grad_x.lower(x2, w2, dy).compile().as_text()) == in_band, rows
        ref = plain(dy, w2, (((1,), (1,)), ((), ()))).astype(jnp.bfloat16)
        np.testing.assert_array_equal(np.asarray(grad_x(x2, w2, dy)), np.asarray(ref))
