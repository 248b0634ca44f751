"""`jaxrl_hf.backends.cpu.ffi` (XLA FFI kernels built with the machine's g++ on first use): the float32 matmul
over weights in panel order (`backends.cpu.panel_matmul`) and the attention over a stored KV cache, against numpy
float64; the panel layout; their refusals; the build, its failure and the switch that turns them off."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf.backends.cpu import ffi as ck
from jaxrl_hf.backends.cpu import panel_matmul as pm
from jaxrl_hf.models.attention import NEG_INF

needs_kernel = pytest.mark.skipif(not ck.available(), reason="needs x86-64 with AVX-512 and g++ (the kernels' build)")


def test_panel_order_is_column_panels_row_after_row_then_the_remaining_columns():
    k, n = 3, 2 * pm.PANEL + 5
    w = np.arange(k * n, dtype=np.float32).reshape(k, n)
    expected = [w[r, p * pm.PANEL:(p + 1) * pm.PANEL] for p in range(2) for r in range(k)]
    expected += [w[r, 2 * pm.PANEL:] for r in range(k)]
    got = pm.to_panel_order(jnp.asarray(w))
    assert got.shape == (k, n)
    np.testing.assert_array_equal(np.asarray(got).reshape(-1), np.concatenate(expected))
    np.testing.assert_array_equal(np.asarray(pm.from_panel_order(got)), w)


@needs_kernel
@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (1, 64, 48), (3, 7, 5), (7, 33, 47), (8, 16, 96), (13, 100, 97),
                                     (64, 576, 192), (64, 1536, 576), (61, 576, 1536), (64, 576, 16 * 1024 + 16)])
def test_products_equal_numpy_float64(m, k, n):
    """Row blocks of 8 and their tails (1-7 rows), full panels and a last partial one (masked), one panel or
    hundreds shared out over threads: every output is the float64 product to float32 summation error."""
    rng = np.random.default_rng(m * 1000 + n)
    x, w = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    y = jax.jit(lambda x, w: pm.panel_matmul(x, pm.to_panel_order(w)))(x, w)
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-6 * k + 4e-6 * math.sqrt(k))


@needs_kernel
def test_a_pure_op_in_a_jitted_loop():
    """The call is a pure op in a jitted loop (the decode loop's use): ten steps equal ten numpy steps."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((16, 96), dtype=np.float32), rng.standard_normal((96, 96), dtype=np.float32) * 0.1
    panels = pm.to_panel_order(jnp.asarray(w))
    y = jax.jit(lambda x: jax.lax.fori_loop(0, 10, lambda i, h: jnp.tanh(pm.panel_matmul(h, panels)), x))(x)
    ref = x.astype(np.float64)
    for _ in range(10):
        ref = np.tanh(ref @ w)
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5)


def test_refuses_other_dtypes_and_mismatched_shapes():
    x = jnp.ones((4, 8), jnp.float32)
    with pytest.raises(ValueError, match="float32 only"):
        pm.panel_matmul(x.astype(jnp.bfloat16), jnp.ones((8, 48), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\[M, K\] and \[K, N\]"):
        pm.panel_matmul(x, jnp.ones((9, 48), jnp.float32))


def test_a_failed_build_names_the_command_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")
    target = tmp_path / "kernels" / "cpu_kernels-x.so"
    sources = r"panel_matmul\.cc .*cache_attention\.cc .*clip_adamw\.cc .*pair_matmul\.cc"
    with pytest.raises(RuntimeError, match=rf"`false .*{sources}` failed"):
        ck._build(target)
    assert list(target.parent.iterdir()) == []


@needs_kernel
def test_builds_into_a_fresh_cache(tmp_path):
    """What a clean machine's first call does: compile every source into the cache folder, load the library, find
    every handler `available` registers."""
    import ctypes

    target = tmp_path / "fresh" / "cpu_kernels-y.so"
    ck._build(target)
    library = ctypes.cdll.LoadLibrary(str(target))
    assert all(getattr(library, symbol) for _, symbol in ck.TARGETS.values())
    assert [p.name for p in target.parent.iterdir()] == [target.name]


def test_switched_off_by_the_config_key():
    """``model.cpu_backend: off``: no fused update, no pair kernel, the native engine on XLA's scanned loop."""
    from jaxrl_hf.config.schema import OptimConfig
    from jaxrl_hf.backends.cpu import pair_matmul
    from jaxrl_hf.backends.cpu.fused_adamw import fused_update_for

    params = {"w": jnp.zeros((4, 4), jnp.float32)}
    assert fused_update_for(OptimConfig(), 1.0, params, None, cpu_backend="off") is None
    assert not pair_matmul.wanted("bfloat16", None, "off")
    if ck.available():
        assert fused_update_for(OptimConfig(), 1.0, params, None) is not None


def _attention_reference(q, kt, v, mask, scale):
    """numpy float64: softmax over the slots of where(mask, scale q·k, NEG_INF), times the values."""
    scores = np.einsum("btkgd,bkds->btkgs", q.astype(np.float64), kt.astype(np.float64)) * scale
    scores = np.where(mask[:, :, None, None, :], scores, NEG_INF)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("btkgs,bksd->btkgd", p / p.sum(-1, keepdims=True), v.astype(np.float64))


@needs_kernel
@pytest.mark.parametrize("b, t, k, g, d, s", [(1, 1, 1, 1, 8, 5), (2, 1, 3, 3, 64, 168), (3, 2, 2, 3, 64, 37),
                                              (2, 1, 1, 7, 80, 100), (2, 3, 2, 2, 16, 200)])
def test_cache_attention_equals_numpy_float64(b, t, k, g, d, s):
    """Row groups of 4 and their tails, slots and head_dim not multiples of 64 (masked lanes), several queries per
    row (T), and a row whose every slot is masked (XLA's softmax over NEG_INF: every value averaged)."""
    rng = np.random.default_rng(b * 100 + s)
    q = rng.standard_normal((b, t, k, g, d), dtype=np.float32)
    kt = rng.standard_normal((b, k, d, s), dtype=np.float32)
    v = rng.standard_normal((b, k, s, d), dtype=np.float32)
    mask = rng.random((b, t, s)) < 0.6
    mask[0, 0] = False
    out = jax.jit(ck.cache_attention, static_argnums=4)(q, kt, v, mask, d ** -0.5)
    assert out.shape == (b, t, k, g, d) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), _attention_reference(q, kt, v, mask, d ** -0.5), atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(out)[0, 0], v[0].mean(1)[:, None].repeat(g, 1), atol=2e-6)


def test_cache_attention_refuses_mismatched_shapes():
    q = jnp.ones((2, 1, 3, 3, 8))
    with pytest.raises(ValueError, match=r"cache_attention: .* do not fit"):
        ck.cache_attention(q, jnp.ones((2, 3, 8, 5)), jnp.ones((2, 3, 6, 8)), jnp.ones((2, 1, 5), bool), 1.0)
