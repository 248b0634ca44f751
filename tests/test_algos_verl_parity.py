"""Parity with verl's own implementation (``verl.trainer.ppo.core_algos``, torch, float32) on random inputs
with ragged masks, tolerance 1e-5 — the same comparison an outside check makes.

verl is a test-only dependency installed ``--no-deps`` by ``scripts/setup.sh``; if it cannot be imported the
module is skipped with the reason, and ``test_algos_*.py`` still check every function against numpy float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf import algos

torch = pytest.importorskip("torch", reason="torch is needed to run verl's reference implementation")
try:
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos as verl_algos
    from verl.utils import torch_functional as verl_F
    from verl.workers.config import ActorConfig
except Exception as exc:  # pragma: no cover - environment dependent
    pytest.skip(f"verl is not importable ({type(exc).__name__}: {exc}); numpy references still run",
                allow_module_level=True)

B, T = 16, 11
ATOL = 1e-5


def _inputs(seed: int):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    rewards = np.zeros((B, T), np.float32)
    rewards[np.arange(B), lengths - 1] = rng.choice([0.0, 1.0, -1.0, 0.5], size=B)
    rewards += (rng.normal(size=(B, T)) * 0.1 * mask).astype(np.float32)
    index = np.repeat(np.arange(5), [4, 4, 4, 3, 1])  # includes a singleton group
    rng.shuffle(index)
    old = rng.normal(-1.2, 0.6, size=(B, T)).astype(np.float32)
    new = (old + rng.normal(0, 0.35, size=(B, T))).astype(np.float32)
    adv = rng.normal(size=(B, T)).astype(np.float32)
    values = rng.normal(size=(B, T)).astype(np.float32)
    return dict(mask=mask, rewards=rewards, index=index, old=old, new=new, adv=adv, values=values,
                baselines=rng.normal(size=B).astype(np.float32), weights=rng.uniform(0.5, 1.5, (B, T)).astype(np.float32))


@pytest.fixture(params=[0, 1, 2])
def x(request):
    return _inputs(request.param)


def _t(a):
    return torch.tensor(np.asarray(a))


def _close(ours, theirs, atol=ATOL):
    theirs = theirs.detach().numpy() if hasattr(theirs, "detach") else np.asarray(theirs)
    np.testing.assert_allclose(np.asarray(ours, np.float32), theirs, atol=atol, rtol=1e-5)


def _actor_config(**kw):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, **kw)


def test_gae(x):
    ours = algos.get_adv_estimator("gae")(x["rewards"], x["mask"], values=x["values"], gamma=0.99, lam=0.95)
    theirs = verl_algos.compute_gae_advantage_return(_t(x["rewards"]), _t(x["values"]), _t(x["mask"]), 0.99, 0.95)
    _close(ours[0], theirs[0])
    _close(ours[1], theirs[1])


@pytest.mark.parametrize("norm", [True, False])
def test_grpo(x, norm):
    ours = algos.get_adv_estimator("grpo")(x["rewards"], x["mask"], index=x["index"], norm_adv_by_std_in_grpo=norm)
    theirs = verl_algos.compute_grpo_outcome_advantage(_t(x["rewards"]), _t(x["mask"]), x["index"],
                                                       norm_adv_by_std_in_grpo=norm)
    _close(ours[0], theirs[0])


@pytest.mark.parametrize("name,fn", [
    ("rloo", "compute_rloo_outcome_advantage"),
    ("opo", "compute_opo_outcome_advantage"),
    ("gpg", "compute_gpg_outcome_advantage"),
    ("reinforce_plus_plus_baseline", "compute_reinforce_plus_plus_baseline_outcome_advantage"),
])
def test_group_estimators(x, name, fn):
    ours = algos.get_adv_estimator(name)(x["rewards"], x["mask"], index=x["index"])
    theirs = getattr(verl_algos, fn)(token_level_rewards=_t(x["rewards"]), response_mask=_t(x["mask"]),
                                     index=x["index"], config=AlgoConfig())
    _close(ours[0], theirs[0])
    _close(ours[1], theirs[1])


@pytest.mark.parametrize("gamma", [1.0, 0.95])
def test_reinforce_plus_plus(x, gamma):
    ours = algos.get_adv_estimator("reinforce_plus_plus")(x["rewards"], x["mask"], gamma=gamma)
    theirs = verl_algos.compute_reinforce_plus_plus_outcome_advantage(
        token_level_rewards=_t(x["rewards"]), response_mask=_t(x["mask"]), config=AlgoConfig(gamma=gamma))
    _close(ours[0], theirs[0])
    _close(ours[1], theirs[1])


def test_remax(x):
    ours = algos.get_adv_estimator("remax")(x["rewards"], x["mask"], reward_baselines=x["baselines"])
    theirs = verl_algos.compute_remax_outcome_advantage(
        token_level_rewards=_t(x["rewards"]), reward_baselines=_t(x["baselines"]), response_mask=_t(x["mask"]),
        config=AlgoConfig())
    _close(ours[0], theirs[0])
    _close(ours[1], theirs[1])


@pytest.mark.parametrize("mode", list(algos.LOSS_AGG_MODES))
def test_agg_loss(x, mode):
    _close(algos.agg_loss(x["adv"], x["mask"], mode), verl_algos.agg_loss(_t(x["adv"]), _t(x["mask"]), mode))


@pytest.mark.parametrize("loss_name", ["vanilla", "gspo", "cispo", "gpg"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("with_weights", [False, True])
def test_policy_losses(x, loss_name, mode, with_weights):
    clip = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    if loss_name == "gspo":
        clip.update(clip_ratio_low=3e-2, clip_ratio_high=4e-2)
    weights = x["weights"] if with_weights else None
    ours, ours_m = algos.get_policy_loss(loss_name)(x["old"], x["new"], x["adv"], x["mask"], loss_agg_mode=mode,
                                                    rollout_is_weights=weights, **clip)
    new_t = _t(x["new"]).requires_grad_(True)
    theirs, theirs_m = verl_algos.get_policy_loss_fn(loss_name)(
        _t(x["old"]), new_t, _t(x["adv"]), _t(x["mask"]), loss_agg_mode=mode, config=_actor_config(**clip),
        rollout_is_weights=None if weights is None else _t(weights))
    _close(ours, theirs)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        if f"actor/{key}" in theirs_m:
            _close(ours_m[key], theirs_m[f"actor/{key}"])
    # gradients w.r.t. the current log-probs agree too
    theirs.backward()
    grad = jax.grad(lambda lp: algos.get_policy_loss(loss_name)(
        x["old"], lp, x["adv"], x["mask"], loss_agg_mode=mode, rollout_is_weights=weights, **clip)[0])(
        jnp.asarray(x["new"]))
    _close(grad, new_t.grad)


def test_value_loss(x):
    ours = algos.compute_value_loss(x["new"], x["adv"], x["old"], x["mask"], cliprange_value=0.2)
    theirs = verl_algos.compute_value_loss(_t(x["new"]), _t(x["adv"]), _t(x["old"]), _t(x["mask"]), 0.2)
    _close(ours[0], theirs[0])
    _close(ours[1], theirs[1])


@pytest.mark.parametrize("name", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+"])
def test_kl_penalty(x, name):
    ours = algos.kl_penalty(x["new"], x["old"], name)
    lp = _t(x["new"]).requires_grad_(True)
    theirs = verl_algos.kl_penalty(lp, _t(x["old"]), name)
    _close(ours, theirs)
    if name.endswith("+"):
        theirs.sum().backward()
        grad = jax.grad(lambda a: jnp.sum(algos.kl_penalty(a, x["old"], name)))(jnp.asarray(x["new"]))
        _close(grad, lp.grad)


def test_entropy_and_logprobs():
    rng = np.random.default_rng(9)
    logits = (rng.normal(size=(4, 6, 101)) * 3).astype(np.float32)
    labels = rng.integers(0, 101, size=(4, 6))
    _close(algos.entropy_from_logits(logits, vocab_chunk_size=32), verl_F.entropy_from_logits(_t(logits)))
    _close(algos.logprobs_from_logits(logits, labels), verl_F.logprobs_from_logits(_t(logits), _t(labels)))


def test_adaptive_kl_controller():
    theirs = verl_algos.AdaptiveKLController(init_kl_coef=0.05, target_kl=0.1, horizon=1000)
    ours = algos.init_kl_controller(0.05, kind="adaptive", target_kl=0.1, horizon=1000)
    for kl in (0.3, 0.05, 0.11, 0.02):
        theirs.update(kl, 64)
        ours = algos.update_kl_controller(ours, kl, 64)
        _close(ours.value, np.float32(theirs.value))
