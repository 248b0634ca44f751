"""Advantage estimators vs independent float64 numpy references, hand cases, jit and properties."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import _np_ref as ref
from jaxrl_hf import algos

B, T = 12, 9


def _ragged_mask(rng, holes=False):
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    if holes:  # interior masked tokens (e.g. tool output inside a response)
        mask = mask * (rng.random((B, T)) > 0.25)
        mask[:, 0] = 1.0
    return mask


@pytest.fixture(params=[0, 1, 2])
def batch(request):
    rng = np.random.default_rng(request.param)
    mask = _ragged_mask(rng, holes=request.param == 2)
    rewards = (rng.normal(size=(B, T)) * mask).astype(np.float32)
    # groups of 3, 3, 2, 1 (a singleton) and 3
    index = np.array([7, 7, 7, 3, 3, 3, 11, 11, 5, 9, 9, 9], np.int64)
    values = rng.normal(size=(B, T)).astype(np.float32)
    baselines = rng.normal(size=(B,)).astype(np.float32)
    return rewards, mask, index, values, baselines


def _close(a, b, atol=2e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=atol, rtol=2e-5)


def test_registry_lists_every_estimator():
    assert set(algos.ADV_ESTIMATORS.names()) >= {
        "gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo", "gpg",
    }
    with pytest.raises(ValueError, match="valid names"):
        algos.get_adv_estimator("ppo2")


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_matches_reference(batch, gamma, lam):
    rewards, mask, _, values, _ = batch
    adv, ret = algos.get_adv_estimator("gae")(rewards, mask, values=values, gamma=gamma, lam=lam)
    ref_adv, ref_ret = ref.gae(rewards.astype(np.float64), values.astype(np.float64), mask, gamma, lam)
    chex.assert_shape([adv, ret], (B, T))
    _close(ret, ref_ret)
    _close(adv, ref_adv, atol=5e-5)


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_reference(batch, norm):
    rewards, mask, index, _, _ = batch
    adv, ret = algos.get_adv_estimator("grpo")(rewards, mask, index=index, norm_adv_by_std_in_grpo=norm)
    _close(adv, ref.grpo(rewards.astype(np.float64), mask, index, norm))
    _close(ret, np.asarray(adv))


def test_grpo_hand_case():
    # one group [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(1/3); a singleton keeps its raw score
    rewards = np.zeros((5, 3), np.float32)
    rewards[:, -1] = [1, 0, 1, 0, 0.7]
    mask = np.ones((5, 3), np.float32)
    adv, _ = algos.compute_grpo_outcome_advantage(rewards, mask, index=np.array([0, 0, 0, 0, 1]))
    expected = np.array([0.5, -0.5, 0.5, -0.5]) / (np.sqrt(1 / 3) + 1e-6)
    _close(np.asarray(adv)[:4, 0], expected)
    _close(np.asarray(adv)[4], np.full(3, 0.7))


def test_grpo_group_sums_are_zero(batch):
    rewards, mask, index, _, _ = batch
    adv, _ = algos.compute_grpo_outcome_advantage(rewards, mask, index=index)
    scalar = np.array([np.asarray(adv)[i][mask[i] > 0][0] for i in range(B)])  # same on every valid token
    for g in set(index.tolist()):
        ids = np.flatnonzero(index == g)
        if len(ids) > 1:
            assert abs(scalar[ids].sum()) < 1e-4


def test_rloo_opo_gpg_match_reference(batch):
    rewards, mask, index, _, _ = batch
    r64 = rewards.astype(np.float64)
    _close(algos.get_adv_estimator("rloo")(rewards, mask, index=index)[0], ref.rloo(r64, mask, index))
    _close(algos.get_adv_estimator("opo")(rewards, mask, index=index)[0], ref.opo(r64, mask, index))
    _close(algos.get_adv_estimator("gpg")(rewards, mask, index=index)[0], ref.gpg(r64, mask, index))


def test_rloo_hand_case():
    rewards = np.array([[1.0], [0.0], [0.0]], np.float32)
    adv, _ = algos.compute_rloo_outcome_advantage(rewards, np.ones((3, 1)), index=np.zeros(3, int))
    _close(np.asarray(adv)[:, 0], [1.0, -0.5, -0.5])


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_reference(batch, gamma):
    rewards, mask, _, _, _ = batch
    adv, ret = algos.get_adv_estimator("reinforce_plus_plus")(rewards, mask, gamma=gamma)
    ref_adv, ref_ret = ref.reinforce_pp(rewards.astype(np.float64), mask, gamma)
    _close(ret, ref_ret)
    _close(adv, ref_adv, atol=5e-5)


def test_reinforce_plus_plus_baseline_matches_reference(batch):
    rewards, mask, index, _, _ = batch
    adv, _ = algos.get_adv_estimator("reinforce_plus_plus_baseline")(rewards, mask, index=index)
    _close(adv, ref.reinforce_pp_baseline(rewards.astype(np.float64), mask, index), atol=5e-5)


def test_remax_matches_reference(batch):
    rewards, mask, _, _, baselines = batch
    adv, ret = algos.get_adv_estimator("remax")(rewards, mask, reward_baselines=baselines)
    ref_adv, ref_ret = ref.remax(rewards.astype(np.float64), mask, baselines.astype(np.float64))
    _close(adv, ref_adv)
    _close(ret, ref_ret)


def test_grpo_passk_best_sample_only():
    rewards = np.array([[0.2], [0.9], [0.5], [1.0], [1.0]], np.float32)
    adv, _ = algos.get_adv_estimator("grpo_passk")(rewards, np.ones((5, 1)), index=np.array([0, 0, 0, 1, 1]),
                                                   norm_adv_by_std_in_grpo=False)
    _close(np.asarray(adv)[:, 0], [0.0, 0.4, 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="at least 2 samples"):
        algos.get_adv_estimator("grpo_passk")(rewards, np.ones((5, 1)), index=np.array([0, 0, 0, 1, 2]))


def test_missing_inputs_and_bad_shapes_raise():
    r = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="needs `index`"):
        algos.get_adv_estimator("grpo")(r, r)
    with pytest.raises(ValueError, match="needs `values`"):
        algos.get_adv_estimator("gae")(r, r)
    with pytest.raises(ValueError, match="index must be"):
        algos.get_adv_estimator("rloo")(r, r, index=np.zeros(3, int))
    with pytest.raises(ValueError, match="batch, response_length"):
        algos.get_adv_estimator("grpo")(r, r[:, :2], index=np.zeros(4, int))


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "opo", "gpg", "reinforce_plus_plus",
                                  "reinforce_plus_plus_baseline", "remax"])
def test_estimators_jit(batch, name):
    rewards, mask, index, values, baselines = batch
    fn = algos.get_adv_estimator(name)
    jitted = jax.jit(lambda *a: fn(a[0], a[1], index=a[2], values=a[3], reward_baselines=a[4], gamma=0.9, lam=0.95))
    adv, ret = jitted(rewards, mask, index, values, baselines)
    eager = fn(rewards, mask, index=index, values=values, reward_baselines=baselines, gamma=0.9, lam=0.95)
    chex.assert_trees_all_close((adv, ret), eager, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(adv)))


def test_user_registered_estimator():
    @algos.register_adv_estimator("test_constant_one")
    def constant(token_level_rewards, response_mask, **_):
        return jnp.asarray(response_mask, jnp.float32), jnp.asarray(response_mask, jnp.float32)

    assert algos.get_adv_estimator("test_constant_one") is constant
    with pytest.raises(ValueError, match="already registered"):
        algos.register_adv_estimator("grpo")(constant)
