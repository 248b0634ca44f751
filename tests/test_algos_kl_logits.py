"""KL estimators (incl. straight-through '+' forms), controllers, entropy/log-probs, DAPO pieces and rollout
correction vs float64 numpy references."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _np_ref as ref
from jaxrl_hf import algos


def _close(a, b, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=atol, rtol=1e-5)


@pytest.fixture
def logps():
    rng = np.random.default_rng(3)
    lp = rng.normal(-2.0, 1.0, size=(6, 5)).astype(np.float32)
    ref_lp = (lp + rng.normal(0, 0.5, size=(6, 5))).astype(np.float32)
    ref_lp[0, 0] = lp[0, 0] + 30.0  # exercises the ±20 / ±10 clamps of k3
    return lp, ref_lp


def test_kl_estimators_match_reference(logps):
    lp, rp = logps
    x = lp.astype(np.float64) - rp
    expected = {"kl": x, "k1": x, "abs": np.abs(x), "mse": 0.5 * x**2, "k2": 0.5 * x**2,
                "low_var_kl": ref.k3(lp.astype(np.float64), rp), "k3": ref.k3(lp.astype(np.float64), rp)}
    for name, value in expected.items():
        _close(algos.kl_penalty(lp, rp, name), value, atol=1e-4)
    assert float(algos.kl_penalty(lp, rp, "k3")[0, 0]) == 10.0


@pytest.mark.parametrize("base", ["k1", "kl", "abs", "k3", "low_var_kl", "mse"])
def test_straight_through_forms_have_base_value_and_k2_gradient(logps, base):
    lp, rp = logps
    value = algos.kl_penalty(lp, rp, base + "+")
    _close(value, algos.kl_penalty(lp, rp, base), atol=1e-5)
    g = jax.grad(lambda x: jnp.sum(algos.kl_penalty(x, rp, base + "+")))(jnp.asarray(lp))
    _close(g, lp.astype(np.float64) - rp, atol=1e-5)  # ∂/∂logπ of ½(logπ − logπ_ref)²


def test_kl_full_matches_reference():
    rng = np.random.default_rng(4)
    p_logits = rng.normal(size=(3, 4, 11)).astype(np.float32)
    q_logits = rng.normal(size=(3, 4, 11)).astype(np.float32)
    lp, lq = ref.log_softmax(p_logits), ref.log_softmax(q_logits)
    expected = (np.exp(lp) * (lp - lq)).sum(-1)
    _close(algos.kl_penalty(p_logits, q_logits, "full"), expected)
    _close(algos.kl_penalty(lp.astype(np.float32), lq.astype(np.float32), "full"), expected)  # log-probs too
    with pytest.raises(ValueError, match="valid"):
        algos.kl_penalty(p_logits, q_logits, "k4")


def test_apply_kl_penalty_and_controllers(logps):
    lp, rp = logps
    mask = np.ones_like(lp)
    mask[:, 3:] = 0
    scores = np.zeros_like(lp)
    scores[:, 2] = 1.0
    rewards, current_kl = algos.apply_kl_penalty(scores, lp, rp, mask, 0.1, "kl")
    kld = (lp.astype(np.float64) - rp) * mask
    _close(rewards, scores - 0.1 * kld)
    _close(current_kl, np.mean([(kld[i] * mask[i]).sum() / mask[i].sum() for i in range(len(lp))]))

    fixed = algos.init_kl_controller(0.05)
    assert float(algos.update_kl_controller(fixed, 5.0, 100).value) == pytest.approx(0.05)
    st = algos.init_kl_controller(0.05, kind="adaptive", target_kl=0.1, horizon=1000)
    st = algos.update_kl_controller(st, 0.5, 64)  # error clipped to +0.2
    assert float(st.value) == pytest.approx(0.05 * (1 + 0.2 * 64 / 1000))
    st = jax.jit(algos.update_kl_controller, static_argnums=())(st, jnp.float32(0.09), 64)
    assert float(st.value) == pytest.approx(0.05 * (1 + 0.2 * 64 / 1000) * (1 - 0.1 * 64 / 1000), rel=1e-5)
    with pytest.raises(ValueError, match="horizon"):
        algos.init_kl_controller(0.1, kind="adaptive", horizon=0)


@pytest.mark.parametrize("chunk", [None, 4, 7, 64])
def test_entropy_and_logprobs_match_reference(chunk):
    rng = np.random.default_rng(7)
    logits = (rng.normal(size=(3, 5, 29)) * 5).astype(np.float32)
    logits[0, 0, 3] = 80.0  # a very confident position: must not overflow
    labels = rng.integers(0, 29, size=(3, 5))
    ent = algos.entropy_from_logits(logits, vocab_chunk_size=chunk)
    lp = algos.logprobs_from_logits(logits, labels, vocab_chunk_size=chunk)
    chex.assert_shape([ent, lp], (3, 5))
    _close(ent, ref.entropy(logits), atol=2e-5)
    _close(lp, np.take_along_axis(ref.log_softmax(logits), labels[..., None], -1)[..., 0], atol=2e-5)
    # gradients of the chunked forms equal the plain ones
    g_chunk = jax.grad(lambda z: jnp.sum(algos.entropy_from_logits(z, vocab_chunk_size=chunk)))(jnp.asarray(logits))
    g_plain = jax.grad(lambda z: jnp.sum(-jax.nn.softmax(z) * jax.nn.log_softmax(z)))(jnp.asarray(logits))
    chex.assert_trees_all_close(g_chunk, g_plain, atol=1e-4)


def test_entropy_loss_bf16_input():
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 17)), jnp.bfloat16)
    out = algos.compute_entropy_loss(logits, jnp.ones((2, 3)))
    assert out.dtype == jnp.float32 and np.isfinite(float(out))


def test_overlong_penalty_eq13():
    # L_max = 20, L_cache = 4: free up to 16 tokens, linear to −1 at 20, −1 beyond
    lengths = np.array([0, 16, 17, 18, 20, 21, 100])
    out = algos.compute_overlong_penalty(lengths, max_response_length=20, overlong_buffer_len=4, penalty_factor=1.0)
    _close(out, [0, 0, -0.25, -0.5, -1.0, -1.0, -1.0])
    _close(algos.compute_overlong_penalty(lengths, 20, 4, 0.5), 0.5 * np.array([0, 0, -0.25, -0.5, -1, -1, -1]))
    with pytest.raises(ValueError, match="overlong_buffer"):
        algos.compute_overlong_penalty(lengths, 20, 0)


def test_overlong_filter_and_truncation():
    mask = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]], np.float32)
    eos = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 1]], np.int32)
    trunc = algos.is_truncated(mask, eos)
    np.testing.assert_array_equal(np.asarray(trunc), [True, False, False])
    np.testing.assert_array_equal(np.asarray(algos.is_truncated(mask)), [True, False, True])
    filtered = algos.overlong_filter_mask(mask, trunc)
    np.testing.assert_array_equal(np.asarray(filtered), mask * np.array([[0], [1], [1]]))


def test_filter_groups_dapo_dynamic_sampling():
    acc = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0, 1], np.float32)
    index = np.array([0, 0, 0, 1, 1, 1, 2, 2, 2, 3])  # all right, mixed, all wrong, singleton
    keep = np.asarray(algos.filter_groups(acc, index))
    np.testing.assert_array_equal(keep, [0, 0, 0, 1, 1, 1, 0, 0, 0, 1])
    keep = np.asarray(jax.jit(lambda a, i: algos.filter_groups(a, i, keep_singletons=False))(acc, index))
    np.testing.assert_array_equal(keep, [0, 0, 0, 1, 1, 1, 0, 0, 0, 0])


def test_rollout_correction_against_reference():
    rng = np.random.default_rng(11)
    old = rng.normal(-1.0, 0.3, size=(5, 6)).astype(np.float32)
    rollout = (old + rng.normal(0, 0.4, size=(5, 6))).astype(np.float32)
    mask = np.ones((5, 6), np.float32)
    mask[1, 4:] = 0
    mask[4, :] = 0
    o, r = old.astype(np.float64), rollout.astype(np.float64)
    rho = np.exp(o - r)
    _close(algos.compute_rollout_is_weights(old, rollout, mask, threshold=1.5), np.minimum(rho, 1.5) * mask)
    seq = np.exp(((o - r) * mask).sum(-1))
    _close(algos.compute_rollout_is_weights(old, rollout, mask, level="sequence", threshold=2.0),
           np.minimum(seq, 2.0)[:, None] * mask)
    geo = np.exp(((o - r) * mask).sum(-1) / np.maximum(mask.sum(-1), 1))
    rej = algos.compute_rollout_rejection_mask(old, rollout, mask, level="geometric", upper=1.1, lower=0.9)
    _close(rej, mask * ((geo >= 0.9) & (geo <= 1.1))[:, None])
    tok = algos.compute_rollout_rejection_mask(old, rollout, mask, upper=1.5)
    _close(tok, mask * ((rho >= 1 / 1.5) & (rho <= 1.5)))
    veto = algos.compute_rollout_rejection_mask(old, rollout, mask, upper=1e9, lower=0.0, veto_threshold=0.6)
    _close(veto, mask * ~np.any((rho < 0.6) & (mask > 0), -1, keepdims=True))

    m = algos.compute_mismatch_metrics(old, rollout, mask)
    valid = mask > 0
    _close(m["mismatch_k1"], (r - o)[valid].mean())
    _close(m["mismatch_k3"], (rho - 1 - np.log(rho))[valid].mean())
    seqs = [i for i in range(5) if mask[i].sum() > 0]
    tppl = [np.exp(-o[i][valid[i]].mean()) for i in seqs]
    rppl = [np.exp(-r[i][valid[i]].mean()) for i in seqs]
    _close(m["training_ppl"], np.mean(tppl))
    _close(m["ppl_ratio"], np.mean(np.array(tppl) / np.array(rppl)))
    w = rho[valid]
    _close(m["ess"], w.sum() ** 2 / (w.size * (w**2).sum()))
    same = algos.compute_mismatch_metrics(old, old, mask)
    _close(same["ess"], 1.0)
    _close(same["mismatch_k3"], 0.0)
