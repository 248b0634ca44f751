"""Policy/value losses and aggregation vs float64 numpy references; clip-higher gradient property;
exactness of micro-batch gradient accumulation."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _np_ref as ref
from jaxrl_hf import algos

B, T = 10, 7
MODES = list(algos.LOSS_AGG_MODES)


@pytest.fixture(params=[0, 1])
def data(request):
    rng = np.random.default_rng(100 + request.param)
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    if request.param == 1:
        mask[3] = 0.0  # a fully masked (e.g. overlong-filtered) sample
    old = rng.normal(-1.5, 0.5, size=(B, T)).astype(np.float32)
    new = (old + rng.normal(0, 0.3, size=(B, T))).astype(np.float32)
    adv = rng.normal(size=(B, T)).astype(np.float32)
    adv[0, :] = -2.0
    new[0, :2] = old[0, :2] + 1.5  # ratio ≈ 4.5 > clip_ratio_c with A < 0: exercises dual-clip
    return old, new, adv, mask


def _close(a, b, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_reference(data, mode):
    _, _, loss_mat, mask = data
    _close(algos.agg_loss(loss_mat, mask, mode), ref.agg(loss_mat, mask, mode))
    _close(algos.agg_loss(loss_mat, mask, mode, loss_scale_factor=3.0), ref.agg(loss_mat, mask, mode, 3.0))


def test_agg_loss_rejects_unknown_mode():
    with pytest.raises(ValueError, match="valid modes"):
        algos.agg_loss(jnp.zeros((2, 2)), jnp.ones((2, 2)), "token-max")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lo,hi", [(0.2, 0.2), (0.2, 0.28)])
def test_vanilla_matches_reference(data, mode, lo, hi):
    old, new, adv, mask = data
    loss, metrics = algos.get_policy_loss("vanilla")(old, new, adv, mask, loss_agg_mode=mode, clip_ratio=0.2,
                                                     clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=3.0)
    r_loss, _, r_cf, r_cfl, r_kl = ref.ppo_clip(old.astype(np.float64), new.astype(np.float64),
                                               adv.astype(np.float64), mask, mode, lo, hi, 3.0)
    _close(loss, r_loss)
    _close(metrics["pg_clipfrac"], r_cf)
    _close(metrics["pg_clipfrac_lower"], r_cfl)
    _close(metrics["ppo_kl"], r_kl)
    assert r_cfl > 0  # the dual-clip branch is actually exercised


def test_vanilla_hand_case():
    # A=+1, r=1.5 with ε_high=0.28 → clipped to 1.28; A=-1, r=0.5 with ε_low=0.2 → clipped to 0.8
    old = np.log(np.array([[0.2, 0.4]], np.float32))
    new = np.log(np.array([[0.3, 0.2]], np.float32))
    adv = np.array([[1.0, -1.0]], np.float32)
    loss, m = algos.compute_policy_loss_vanilla(old, new, adv, np.ones((1, 2)), clip_ratio_low=0.2, clip_ratio_high=0.28)
    _close(loss, (-1.28 + 0.8) / 2)
    _close(m["pg_clipfrac"], 1.0)


def test_clip_higher_gradient_zero_exactly_outside_trust_region():
    lo, hi, c = 0.2, 0.28, 3.0
    ratios = np.array([0.5, 0.79, 0.81, 1.0, 1.27, 1.29, 2.0, 3.5], np.float32)
    old = np.full((2, ratios.size), -1.0, np.float32)
    new = (old + np.log(ratios)).astype(np.float32)
    adv = np.stack([np.ones_like(ratios), -np.ones_like(ratios)])
    mask = np.ones_like(old)

    def f(lp):
        return algos.compute_policy_loss_vanilla(old, lp, adv, mask, loss_agg_mode="seq-mean-token-sum",
                                                 clip_ratio_low=lo, clip_ratio_high=hi, clip_ratio_c=c)[0]

    g = np.asarray(jax.grad(f)(jnp.asarray(new)))
    # A > 0: the clipped direction is r > 1 + ε_high; A < 0: r < 1 − ε_low, and (dual-clip) r > c
    zero_pos = ratios > 1 + hi
    zero_neg = (ratios < 1 - lo) | (ratios > c)
    np.testing.assert_array_equal(g[0] == 0, zero_pos)
    np.testing.assert_array_equal(g[1] == 0, zero_neg)
    # where not clipped the gradient is −A·r/B (seq-mean-token-sum over B=2 rows)
    _close(g[0][~zero_pos], -ratios[~zero_pos] / 2)
    _close(g[1][~zero_neg], ratios[~zero_neg] / 2)


def test_gspo_matches_reference_and_gradient(data):
    old, new, adv, mask = data
    lo, hi = 3e-4, 4e-4
    loss, m = algos.get_policy_loss("gspo")(old, new, adv, mask, clip_ratio_low=lo, clip_ratio_high=hi)
    # reference: s_i = exp(mean log ratio), token loss max(−A s, −A clip(s)), seq-mean-token-mean
    o, n, a = (x.astype(np.float64) for x in (old, new, adv))
    L, hits = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        length = max(mask[b].sum(), 1)
        s = np.exp(min(((n[b] - o[b]) * mask[b]).sum() / length, 10.0))
        for t in range(T):
            u, c = -a[b, t] * s, -a[b, t] * min(max(s, 1 - lo), 1 + hi)
            L[b, t], hits[b, t] = max(u, c), c > u
    _close(loss, ref.agg(L, mask, "seq-mean-token-mean"))
    _close(m["pg_clipfrac"], ref.mmean(hits, mask))
    # gradient: d/dlogp_t of −A s_i·exp(logp_t − sg logp_t) is −A s_i per token (unclipped tokens), / (|y_i| B')
    g = np.asarray(jax.grad(lambda lp: algos.compute_policy_loss_gspo(old, lp, adv, mask, clip_ratio_low=lo,
                                                                     clip_ratio_high=hi)[0])(jnp.asarray(new)))
    n_valid = (mask.sum(-1) > 0).sum()
    for b in range(B):
        length = mask[b].sum()
        if length == 0:
            continue
        s = np.exp(((n[b] - o[b]) * mask[b]).sum() / length)
        expect = np.where((hits[b] == 0) & (mask[b] > 0), -a[b] * s / (length * n_valid), 0.0)
        _close(g[b], expect, atol=1e-5)


def test_cispo_value_and_gradient(data):
    old, new, adv, mask = data
    lo, hi = 0.2, 0.28
    loss, m = algos.get_policy_loss("cispo")(old, new, adv, mask, clip_ratio_low=lo, clip_ratio_high=hi)
    r = np.exp(new.astype(np.float64) - old)
    w = np.clip(r, 1 - lo, 1 + hi)
    _close(loss, ref.agg(-w * adv * new, mask, "token-mean"))
    _close(m["pg_clipfrac"], ref.mmean(w != r, mask))
    g = np.asarray(jax.grad(lambda lp: algos.compute_policy_loss_cispo(old, lp, adv, mask, clip_ratio_low=lo,
                                                                      clip_ratio_high=hi)[0])(jnp.asarray(new)))
    _close(g, -w * adv * mask / mask.sum())  # no token's gradient is zeroed by the clip


def test_gpg_and_rollout_weights(data):
    old, new, adv, mask = data
    w = np.random.default_rng(0).uniform(0.5, 1.5, size=(B, T)).astype(np.float32)
    loss, _ = algos.get_policy_loss("gpg")(old, new, adv, mask, loss_agg_mode="seq-mean-token-mean",
                                          rollout_is_weights=w)
    _close(loss, ref.agg(-new * adv * w, mask, "seq-mean-token-mean"))
    base, _ = algos.compute_policy_loss_vanilla(old, new, adv, mask)
    _, L, *_ = ref.ppo_clip(old, new, adv, mask, "token-mean", 0.2, 0.2, 3.0)
    weighted, _ = algos.compute_policy_loss_vanilla(old, new, adv, mask, rollout_is_weights=w)
    _close(weighted, ref.agg(L * w, mask, "token-mean"))
    assert not np.isclose(float(base), float(weighted))


def test_dual_clip_constant_validated(data):
    old, new, adv, mask = data
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.compute_policy_loss_vanilla(old, new, adv, mask, clip_ratio_c=1.0)


@pytest.mark.parametrize("loss_name", ["vanilla", "gspo", "cispo", "gpg"])
def test_losses_jit_and_grad_finite(data, loss_name):
    old, new, adv, mask = data
    fn = algos.get_policy_loss(loss_name)
    f = jax.jit(lambda lp: fn(old, lp, adv, mask, clip_ratio_high=0.28)[0])
    grad = jax.jit(jax.grad(lambda lp: fn(old, lp, adv, mask, clip_ratio_high=0.28)[0]))(jnp.asarray(new))
    chex.assert_shape(grad, (B, T))
    chex.assert_tree_all_finite(grad)
    _close(f(jnp.asarray(new)), fn(old, new, adv, mask, clip_ratio_high=0.28)[0])
    assert np.all(np.asarray(grad)[mask == 0] == 0)  # masked tokens get no gradient


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loss_name", ["vanilla", "cispo"])
def test_micro_batch_accumulation_is_exact(data, mode, loss_name):
    """k micro-batches with (sum, denominator) accumulation == one mini-batch, loss and gradient."""
    old, new, adv, mask = data
    fn = algos.get_policy_loss(loss_name)
    kw = dict(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28)

    def full(lp):
        return fn(old, lp, adv, mask, **kw)[0]

    splits = [slice(0, 3), slice(3, 4), slice(4, 10)]  # uneven micro-batches
    denom = algos.agg_loss_denominator(mask, mode)

    def accumulated(lp):
        return sum(fn(old[s], lp[s], adv[s], mask[s], global_denominator=denom, **kw)[0] for s in splits)

    lp = jnp.asarray(new)
    _close(accumulated(lp), full(lp), atol=1e-6)
    _close(jax.grad(accumulated)(lp), jax.grad(full)(lp), atol=1e-7)
    # the (numerator, denominator) form, combined once
    _, L, *_ = ref.ppo_clip(old, new, adv, mask, mode, 0.2, 0.28, 3.0)
    L = L if loss_name == "vanilla" else -np.clip(np.exp(new - old.astype(np.float64)), 0.8, 1.28) * adv * new
    parts = [algos.agg_loss_parts(jnp.asarray(L[s], jnp.float32), mask[s], mode) for s in splits]
    _close(algos.combine_loss_parts(parts, mode), ref.agg(L, mask, mode))
    # per-micro-batch averaging (what verl's legacy path does) is *not* exact for token-mean
    if mode == "token-mean":
        naive = np.mean([float(fn(old[s], new[s], adv[s], mask[s], **kw)[0]) for s in splits])
        assert abs(naive - float(full(lp))) > 1e-3


def test_value_loss_matches_reference(data):
    _, _, _, mask = data
    rng = np.random.default_rng(5)
    vpreds, returns, values = (rng.normal(size=(B, T)).astype(np.float32) for _ in range(3))
    loss, clipfrac = algos.compute_value_loss(vpreds, returns, values, mask, cliprange_value=0.3)
    vclip = np.clip(vpreds, values - 0.3, values + 0.3).astype(np.float64)
    l1, l2 = (vpreds - returns.astype(np.float64)) ** 2, (vclip - returns) ** 2
    _close(loss, 0.5 * ref.agg(np.maximum(l1, l2), mask, "token-mean"))
    _close(clipfrac, ref.mmean(l2 > l1, mask))
    g = jax.grad(lambda v: algos.compute_value_loss(v, returns, values, mask, 0.3)[0])(jnp.asarray(vpreds))
    chex.assert_tree_all_finite(g)
