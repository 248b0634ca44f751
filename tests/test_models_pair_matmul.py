"""The bf16 pair kernel (`jaxrl_hf.backends.cpu.pair_matmul`): its packing against numpy, its products against float64,
the weight gradient of `models.matmul.matmul_f32_accumulate` through it against XLA's dot, and a model whose weight
gradients run in it against the same model on XLA's dots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf.backends.cpu import ffi
from jaxrl_hf.backends.cpu import pair_matmul as pm
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.forward import init_params, token_log_probs_and_entropy
from jaxrl_hf.models.matmul import matmul_f32_accumulate

needs_pairs = pytest.mark.skipif(not ffi.bf16_pairs(), reason="the pair kernel needs AVX512-BF16 and g++")


def _bf16(rs: np.random.RandomState, *shape: int, scale: float = 1.0) -> jnp.ndarray:
    return jnp.asarray(rs.randn(*shape) * scale, jnp.bfloat16)


def _packed_reference(b: np.ndarray) -> np.ndarray:
    """numpy's reading of the layout: panel p, pair j, column c, then the two rows of the pair."""
    k, n = b.shape
    return b.reshape(k // 2, 2, n // pm.PANEL, pm.PANEL).transpose(2, 0, 3, 1).reshape(k, n)


@needs_pairs
@pytest.mark.parametrize("rows,cols", [(2, 48), (6, 96), (34, 144)])
def test_packing_is_column_panels_of_row_pairs(rows, cols):
    b = _bf16(np.random.RandomState(0), rows, cols)
    packed = np.asarray(pm.pack_pairs(b))
    np.testing.assert_array_equal(packed.view(np.uint16), _packed_reference(np.asarray(b)).view(np.uint16))


@needs_pairs
@pytest.mark.parametrize("m,k,n", [(1, 48, 48), (7, 96, 96), (64, 576, 192), (129, 192, 144), (0, 48, 48)])
def test_products_equal_float64_to_float32_sums(m, k, n):
    """Exact bf16 inputs, float32 sums: within a few float32 roundings of the float64 product."""
    rs = np.random.RandomState(1)
    a, b = _bf16(rs, m, k), _bf16(rs, k, n)
    y = np.asarray(pm.pair_product(a, pm.pack_pairs(b)), np.float64)
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    bound = k * np.finfo(np.float32).eps * (np.abs(np.asarray(a, np.float64)) @ np.abs(np.asarray(b, np.float64)))
    assert y.shape == (m, n) and np.all(np.abs(y - ref) <= bound + 1e-30)


@needs_pairs
@pytest.mark.parametrize("m,n", [(1, 96), (64, 192), (65, 100), (128, 48), (0, 48)])
def test_the_weight_gradient_follows_xlas_f32_accumulated_dot(m, n):
    """Forward and ∂x are XLA's either way; ∂W (odd rows padded, columns off the panels padded) to float32 sums."""
    rs = np.random.RandomState(m)
    x, w, dy = _bf16(rs, m, 192), jnp.asarray(rs.randn(192, n) * 0.05, jnp.float32), _bf16(rs, m, n)
    (y, vjp), (y_ref, vjp_ref) = (jax.vjp(lambda a, b, pair=pair: matmul_f32_accumulate(a, b, False, pair), x, w)
                                  for pair in (True, False))
    (dx, dw), (dx_ref, dw_ref) = vjp(dy), vjp_ref(dy)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32))
    assert dw.dtype == jnp.float32 and dw.shape == (192, n)
    exact = np.asarray(x, np.float64).T @ np.asarray(dy, np.float64)
    magnitude = np.abs(np.asarray(x, np.float64)).T @ np.abs(np.asarray(dy, np.float64))
    bound = max(m, 1) * np.finfo(np.float32).eps * magnitude
    assert np.all(np.abs(np.asarray(dw, np.float64) - exact) <= bound + 1e-30)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), rtol=1e-5, atol=1e-6)


@needs_pairs
def test_refuses_shapes_off_the_panels():
    with pytest.raises(ValueError, match="multiple of 48"):
        pm.pack_pairs(jnp.ones((4, 40), jnp.bfloat16))
    with pytest.raises(ValueError, match="even K"):
        pm.pack_pairs(jnp.ones((3, 48), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"\[M, K\] and \[K, N\]"):
        pm.pair_product(jnp.ones((4, 46), jnp.bfloat16), pm.pack_pairs(jnp.ones((48, 48), jnp.bfloat16)))


def _tiny(pair_kernels: bool) -> DecoderConfig:
    return DecoderConfig(vocab_size=256, hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=48, dtype="bfloat16",
                         scan_layers=False, pair_kernels=pair_kernels)


@needs_pairs
def test_a_model_on_the_kernel_follows_the_model_on_xlas_dots():
    """Log-probs and the gradient of their sum, every projection's weight gradient in the kernel."""
    base, paired = _tiny(False), _tiny(True)
    params = init_params(base, jax.random.PRNGKey(0))
    ids = jax.random.randint(jax.random.PRNGKey(1), (3, 10), 0, 256)
    targets = jnp.roll(ids, -1, axis=1)

    def loss(p, config):
        logp, _ = token_log_probs_and_entropy(p, config, ids, targets)
        return logp.sum(), logp

    program = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (_, logp_ref), g_ref = program(params, base)
    (_, logp_pair), g_pair = program(params, paired)
    hlo = jax.jit(jax.grad(lambda p: loss(p, paired)[0])).lower(params).compile().as_text()
    assert hlo.count('custom_call_target="jaxrl_hf_pair_matmul"') == 7 * 2  # 7 projections x 2 layers: ∂W
    np.testing.assert_array_equal(np.asarray(logp_pair), np.asarray(logp_ref))  # the forward is XLA's either way
    for a, b in zip(jax.tree.leaves(g_pair), jax.tree.leaves(g_ref)):
        scale = max(float(np.abs(np.asarray(b)).max()), 1e-3)
        assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) <= 0.05 * scale


def test_only_bf16_training_on_one_cpu_device_asks_for_it(monkeypatch):
    assert not pm.wanted("float32")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("dp",)) if jax.device_count() > 1 else None
    if mesh is not None:
        assert not pm.wanted("bfloat16", mesh)
    assert not pm.wanted("bfloat16", None, "off")
    assert pm.training_config(_tiny(False), None, "off") == _tiny(False)
    with pytest.raises(ValueError, match="pair_kernels needs dtype bfloat16"):
        DecoderConfig(vocab_size=8, hidden_size=48, intermediate_size=48, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, head_dim=48, pair_kernels=True)


def test_a_cpu_without_the_instructions_gets_a_clear_error(monkeypatch):
    monkeypatch.setattr(ffi, "bf16_pairs", lambda: False)
    x = jnp.ones((4, 96), jnp.bfloat16)
    with pytest.raises(ValueError, match="pair_kernels: the bf16 pair kernel does not run here"):
        jax.grad(lambda w: matmul_f32_accumulate(x, w, False, True).astype(jnp.float32).sum())(jnp.ones((96, 48)))
