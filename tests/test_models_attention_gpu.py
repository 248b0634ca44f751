"""cuDNN flash attention against eager attention on a GPU (skipped elsewhere; CI has no GPU).

Run on a GPU machine: ``PYTHONPATH=. python -m pytest -q tests/test_models_attention_gpu.py``. The whole model's
token log-probs and their gradients with ``attn_implementation=cudnn`` equal the eager path's (both bfloat16
compute, f32 master weights) on left-padded rows, within bf16 tolerance; and each is within a looser bound of the
float32 eager forward (the reference)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import random_params, tiny_config
from jaxrl_hf.models.forward import next_token_targets, token_log_probs_and_entropy

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs a GPU")


def _batch(rows: int = 4, width: int = 96, vocab: int = 97):
    rng = np.random.default_rng(0)
    ids = rng.integers(3, vocab, (rows, width)).astype(np.int32)
    mask = np.ones((rows, width), np.int32)
    for r, pad in enumerate((0, 5, 40, 77)[:rows]):  # left padding of several lengths
        ids[r, :pad], mask[r, :pad] = 0, 0
    return jnp.asarray(ids), jnp.asarray(mask)


def _loss_and_grad(config, params, ids, mask):
    targets = next_token_targets(ids)
    valid = mask * jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1)

    def loss(p):
        logp, _ = token_log_probs_and_entropy(p, config, ids, targets, mask)
        return jnp.sum(logp * valid) / jnp.sum(valid), logp

    (value, logp), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return float(value), np.asarray(logp, np.float32) * np.asarray(valid), grad


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cudnn_attention_equals_eager_on_gpu(dtype):
    base = tiny_config(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       intermediate_size=512, dtype=dtype)
    params = random_params(dataclasses.replace(base, dtype="float32"))
    ids, mask = _batch()
    results = {impl: _loss_and_grad(dataclasses.replace(base, attn_implementation=impl), params, ids, mask)
               for impl in ("cudnn", "eager")}
    ref = _loss_and_grad(dataclasses.replace(base, dtype="float32", attn_implementation="eager"), params, ids, mask)
    (lc, pc, gc), (le, pe, ge) = results["cudnn"], results["eager"]
    assert abs(lc - le) < 2e-2 and abs(lc - ref[0]) < 5e-2
    np.testing.assert_allclose(pc, pe, atol=6e-2)
    np.testing.assert_allclose(pc, ref[1], atol=1.5e-1)
    for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(ge)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 5e-2 * max(np.linalg.norm(b), 1e-6)
