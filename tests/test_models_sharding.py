"""Decoder and generation engine on a (dp=4, tp=2) mesh of 8 fake CPU devices.

Run with ``XLA_FLAGS=--xla_force_host_platform_device_count=8``; skipped (with the reason) otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import jit_forward, random_params, tiny_config
from jaxrl_hf.models import forward, param_shardings
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams

if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices: set XLA_FLAGS=--xla_force_host_platform_device_count=8", allow_module_level=True)

RULES = (("batch", "dp"), ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", "tp"),
         ("embed", None), ("layers", None), ("head_dim", None), ("length", None), ("attn_length", None),
         ("attn_heads", "tp"), ("attn_kv_heads", "tp"))
CONFIG = tiny_config(vocab_size=96, eos_token_ids=())


@pytest.fixture(scope="module")
def mesh():
    return jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("dp", "tp"))


def test_sharded_forward_matches_single_device(mesh):
    params = random_params(CONFIG, seed=1)
    shardings = param_shardings(CONFIG, mesh, RULES)
    placed = jax.device_put(params, shardings)
    q = placed["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp", None)
    assert len(q.addressable_shards) == 8 and q.addressable_shards[0].data.shape == (2, 32, 2, 8)
    ids = np.random.default_rng(0).integers(0, 96, (8, 6)).astype(np.int32)
    batch_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp", None))
    sharded_fn = jax.jit(lambda p, x: forward(p, CONFIG, x, mesh=mesh, rules=RULES))
    out = sharded_fn(placed, jax.device_put(ids, batch_sharding))
    assert out.sharding.spec[0] == "dp"  # activations keep the batch sharding
    ref = np.asarray(jit_forward(params, CONFIG, jnp.asarray(ids)))
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


def test_engine_on_mesh_matches_unsharded(mesh):
    params = random_params(CONFIG, seed=2)
    kwargs = dict(pad_token_id=0, length_buckets=(8,), batch_buckets=(8,))
    sharded = JaxGenerationEngine(CONFIG, params, mesh=mesh, rules=RULES, **kwargs)
    plain = JaxGenerationEngine(CONFIG, params, **kwargs)
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, 96, n)) for n in (4, 7, 2)]
    sp = SamplingParams(greedy=True, max_new_tokens=5)
    a, b = sharded.generate(prompts, sp), plain.generate(prompts, sp)
    assert np.array_equal(a.response_ids, b.response_ids)
    np.testing.assert_allclose(a.log_probs, b.log_probs, atol=1e-5)
    leaf = sharded.params["model"]["layers"]["mlp"]["up_proj"]["kernel"]
    assert leaf.sharding.spec == jax.sharding.PartitionSpec(None, None, "tp")
    with pytest.raises(ValueError, match="both mesh and rules"):
        JaxGenerationEngine(CONFIG, params, mesh=mesh, **kwargs)
