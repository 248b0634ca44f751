"""Router losses of a mixture-of-experts policy (`jaxrl_hf.algos.router_losses`) against transformers' Qwen3-MoE
load-balancing loss on the same weights, and against numpy float64 for the z-loss and the expert loads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf.algos.router_losses import expert_load, load_balancing_loss, router_metrics, router_z_loss
from jaxrl_hf.models import load_hf_dir
from jaxrl_hf.models.forward import hidden_states_and_routing

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=False, norm_topk_prob=True)


def _hf_model(path, **overrides):
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{**TINY, **overrides})).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("overrides", [{}, {"mlp_only_layers": [1]}], ids=["all_sparse", "mlp_only_1"])
def test_aux_loss_equals_transformers_on_the_same_weights(tmp_path, overrides):
    hf = _hf_model(tmp_path, **overrides)
    config, params = load_hf_dir(tmp_path)
    ids = np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # left padding: left out of the loss on both sides
    _, (logits, experts) = jax.jit(hidden_states_and_routing, static_argnums=1)(params, config, jnp.asarray(ids),
                                                                                jnp.asarray(mask))
    sparse = 4 - len(overrides.get("mlp_only_layers", []))
    assert logits.shape == (4, 24, 8) and experts.shape == (4, 24, 2)
    assert int(jnp.sum(jnp.any(experts[..., 0] >= 0, axis=-1))) == sparse
    with torch.no_grad():
        positions = torch.from_numpy(np.maximum(np.cumsum(mask, -1) - 1, 0))
        out = hf(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                 position_ids=positions, output_router_logits=True)
    assert len(out.router_logits) == sparse
    ours = float(load_balancing_loss(logits, experts, jnp.asarray(mask.reshape(-1))))
    np.testing.assert_allclose(ours, float(out.aux_loss), rtol=1e-5)
    # the z-loss and the loads from transformers' router logits, in float64
    z = np.stack([r.double().numpy() for r in out.router_logits])  # [L_sparse, N, E]
    w = mask.reshape(-1).astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    ref_z = float((lse ** 2 * w).sum() / (w.sum() * sparse))
    np.testing.assert_allclose(float(router_z_loss(logits, experts, jnp.asarray(mask.reshape(-1)))), ref_z, rtol=1e-5)
    top = np.argsort(-z, axis=-1)[..., :2]
    counts = np.stack([(np.eye(8)[top[l]].sum(1) * w[:, None]).sum(0) for l in range(sparse)])
    share, is_sparse = expert_load(experts, jnp.asarray(mask.reshape(-1)), 8)
    np.testing.assert_allclose(np.asarray(share)[np.asarray(is_sparse)], counts / counts.sum(-1, keepdims=True),
                               atol=1e-6)
    metrics = router_metrics(logits, experts, jnp.asarray(mask.reshape(-1)))
    assert float(metrics["moe/tokens_dropped"]) == 0.0  # dropless: every choice reached its expert
    np.testing.assert_allclose(float(metrics["moe/expert_load_max"]),
                               (counts / counts.sum(-1, keepdims=True)).max(-1).mean(), atol=1e-6)


def test_uniform_routing_gives_k_and_the_gradient_pushes_toward_balance():
    rng = np.random.default_rng(1)
    n, e, k = 64, 4, 2
    experts = np.stack([rng.permutation(e)[:k] for _ in range(n)])[None]
    uniform = load_balancing_loss(jnp.zeros((1, n, e)), jnp.asarray(experts), jnp.ones(n))
    assert float(uniform) == pytest.approx(k)  # P_e = 1/E, so E · Σ_e f_e / E = Σ_e f_e = k
    # every token routed to experts 0 and 1: the gradient lowers their logits and raises the idle ones'
    skewed = np.zeros((1, n, k), np.int32)
    skewed[..., 1] = 1
    grad = jax.grad(load_balancing_loss)(jnp.zeros((1, n, e)), jnp.asarray(skewed), jnp.ones(n))
    assert float(grad[0, :, 0].mean()) > 0 and float(grad[0, :, 3].mean()) < 0
    assert float(router_z_loss(jnp.zeros((1, n, e)), jnp.asarray(skewed), jnp.ones(n))) == pytest.approx(np.log(e) ** 2)
