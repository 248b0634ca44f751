"""The pure train step: exact accumulation, learning, clipping, schedules, donation, config errors.

The checks use a toy policy (a bigram logit table) with the real `actor_loss` and train step, so each
loss mode compiles fast; the real decoder runs through the same step in test_workers_groups.py (update
direction, log-probs vs transformers).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf import algos
from jaxrl_hf.config.build import build_dataclass
from jaxrl_hf.config.schema import ActorConfig, OptimConfig, PolicyLossConfig, RolloutCorrectionConfig
from jaxrl_hf.workers.losses import ACTOR_SUMMED_METRICS, actor_loss, actor_loss_config, response_denominator
from jaxrl_hf.workers.optim import check_optim, learning_rate, make_optimizer, set_learning_rate
from jaxrl_hf.workers.train_step import apply_update, init_train_state, make_train_step

V, R, ROWS = 11, 5, 8


def bigram_log_prob_fn(params, micro, temperature):
    """Toy policy: logits of token t = table[previous token]."""
    logits = params["table"][micro["prev"]] / temperature
    logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, micro["responses"][..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1)
    return logp, entropy


def toy_batch(seed=0):
    rng = np.random.default_rng(seed)
    responses = rng.integers(0, V, (ROWS, R)).astype(np.int32)
    prev = np.concatenate([rng.integers(0, V, (ROWS, 1)), responses[:, :-1]], axis=1).astype(np.int32)
    mask = np.zeros((ROWS, R), np.int32)
    lengths = [1, 1, 5, 5, 2, 4, 5, 3]  # very unequal token counts per micro-batch of 2 rows
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    mask[1] = 0  # a fully masked row (e.g. overlong-filtered)
    return dict(responses=responses, prev=prev, response_mask=mask,
                advantages=rng.normal(size=(ROWS, R)).astype(np.float32),
                old_log_probs=(-math.log(V) + rng.normal(0, 0.3, (ROWS, R))).astype(np.float32),
                ref_log_prob=(-math.log(V) + rng.normal(0, 0.3, (ROWS, R))).astype(np.float32),
                rollout_log_probs=(-math.log(V) + rng.normal(0, 0.3, (ROWS, R))).astype(np.float32))


def toy_params(seed=1):
    return {"table": jnp.asarray(np.random.default_rng(seed).normal(0, 0.5, (V, V)), jnp.float32)}


def micro_split(data, m):
    return {k: jnp.asarray(v.reshape(m, v.shape[0] // m, *v.shape[1:])) for k, v in data.items()}


def loss_config(policy_loss=None, rollout_correction=None, **actor):
    """The actor loss view of an ``actor`` section with these keys (the schema's defaults for the rest), T = 1."""
    section = ActorConfig(policy_loss=PolicyLossConfig(**(policy_loss or {})),
                          rollout_correction=RolloutCorrectionConfig(**(rollout_correction or {})), **actor)
    return actor_loss_config(section, temperature=1.0)


def make_step(cfg, optim, grad_clip, log_prob_fn=bigram_log_prob_fn, **kw):
    loss_fn = functools.partial(actor_loss, log_prob_fn=log_prob_fn, cfg=cfg)
    return make_train_step(loss_fn, optim, optimizer=make_optimizer(optim, grad_clip),
                           denominator_fn=response_denominator(cfg.loss_agg_mode), summed_aux=ACTOR_SUMMED_METRICS, **kw)


def whole_batch_loss(params, data, cfg, log_prob_fn=bigram_log_prob_fn):
    """The mini-batch loss written directly with algos on all rows at once (no accumulation code)."""
    logp, ent = log_prob_fn(params, data, cfg.temperature)
    mask = jnp.asarray(data["response_mask"], jnp.float32)
    weights = None
    if cfg.rollout_correction_level:
        weights = algos.compute_rollout_is_weights(data["old_log_probs"], data["rollout_log_probs"], mask,
                                                   level=cfg.rollout_correction_level,
                                                   threshold=cfg.rollout_correction_threshold)
    pg, _ = algos.get_policy_loss(cfg.loss_mode)(
        jnp.asarray(data["old_log_probs"]), logp, jnp.asarray(data["advantages"]), mask,
        loss_agg_mode=cfg.loss_agg_mode, clip_ratio=cfg.clip_ratio, clip_ratio_high=cfg.clip_ratio_high,
        rollout_is_weights=weights)
    loss = pg - cfg.entropy_coeff * algos.agg_loss(ent, mask, cfg.loss_agg_mode)
    if cfg.use_kl_loss:
        kl = algos.kl_penalty(logp, jnp.asarray(data["ref_log_prob"]), cfg.kl_loss_type)
        loss = loss + cfg.kl_loss_coef * algos.agg_loss(kl, mask, cfg.loss_agg_mode)
    return loss


CASES = [
    loss_config(loss_agg_mode=mode, entropy_coeff=0.01, clip_ratio_high=0.28)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
] + [
    loss_config(policy_loss={"loss_mode": "gspo"}, loss_agg_mode="seq-mean-token-mean"),
    loss_config(policy_loss={"loss_mode": "cispo"}, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="low_var_kl"),
    loss_config(policy_loss={"loss_mode": "gpg"}, use_kl_loss=True, kl_loss_type="k1",
                rollout_correction={"level": "sequence", "threshold": 1.5}),
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.loss_mode}-{c.loss_agg_mode}-kl{int(c.use_kl_loss)}-"
                                                      f"{c.rollout_correction_level}")
def test_micro_batches_give_the_one_batch_update(cfg):
    optim = OptimConfig(lr=1e-2, weight_decay=0.0)
    step = make_step(cfg, optim, grad_clip=None, donate=False)
    data, params = toy_batch(), toy_params()
    ref_loss, ref_grads = jax.value_and_grad(whole_batch_loss)(params, data, cfg)
    ref_norm = math.sqrt(float(np.sum(np.asarray(ref_grads["table"], np.float64) ** 2)))
    state0 = init_train_state(params, make_optimizer(optim, None))
    ref_state, _ = apply_update(state0, ref_grads, make_optimizer(optim, None), optim)  # one big batch
    state, metrics = step(state0, micro_split(data, 4))  # 4 micro-batches of 2 rows
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=2e-5, atol=1e-7)
    np.testing.assert_allclose(metrics["grad_norm"], ref_norm, rtol=1e-4)
    np.testing.assert_allclose(state.params["table"], ref_state.params["table"], rtol=1e-5, atol=1e-7)


def test_empty_micro_batches_are_skipped_and_not_averaged():
    """Micro-batches that only pad the count to a static size (``live_fn`` false: no scored token; packed
    micro-batches by token budget) leave the update and every metric as without them."""
    cfg = loss_config(loss_agg_mode="seq-mean-token-mean", clip_ratio=0.1, entropy_coeff=0.01)
    optim = OptimConfig(lr=1e-2, weight_decay=0.0)
    micro = micro_split(toy_batch(), 4)
    padded = jax.tree.map(lambda x: jnp.concatenate([x[:2], jnp.zeros_like(x[:3]), x[2:]]), micro)
    state0 = init_train_state(toy_params(), make_optimizer(optim, None))
    plain_state, plain = make_step(cfg, optim, grad_clip=None, donate=False)(state0, micro)
    live = lambda m: jnp.any(m["response_mask"] != 0)  # noqa: E731
    state, metrics = make_step(cfg, optim, grad_clip=None, donate=False, live_fn=live)(state0, padded)
    assert float(plain["pg_clipfrac"]) > 0
    for key in plain:
        np.testing.assert_allclose(metrics[key], plain[key], rtol=1e-6, atol=1e-9, err_msg=key)
    np.testing.assert_allclose(state.params["table"], plain_state.params["table"], rtol=1e-6, atol=1e-9)
    _, counted = make_step(cfg, optim, grad_clip=None, donate=False)(state0, padded)  # empties counted: diluted
    np.testing.assert_allclose(counted["pg_clipfrac"], plain["pg_clipfrac"] * 4 / 7, rtol=1e-5)


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_loss_value_matches_numpy_formula_on_policy(mode):
    """Ratio 1 (old = current log-probs): the vanilla loss is −agg(A); computed here in float64."""
    data, params = toy_batch(), toy_params()
    logp, _ = bigram_log_prob_fn(params, data, 1.0)
    data["old_log_probs"] = np.asarray(logp)
    micro = micro_split(data, 4)
    denominator = response_denominator(mode)(micro)
    cfg = loss_config(loss_agg_mode=mode)
    shares = [actor_loss(params, jax.tree.map(lambda x: x[i], micro), denominator, log_prob_fn=bigram_log_prob_fn,
                         cfg=cfg)[1]["pg_loss"] for i in range(4)]
    a, m = data["advantages"].astype(np.float64), data["response_mask"].astype(np.float64)
    tok, valid = m.sum(1), m.sum(1) > 0
    expected = {
        "token-mean": -(a * m).sum() / m.sum(),
        "token-sum": -(a * m).sum(),
        "seq-mean-token-mean": np.mean([-(a[i] * m[i]).sum() / tok[i] for i in range(ROWS) if valid[i]]),
        "seq-mean-token-sum": np.mean([-(a[i] * m[i]).sum() for i in range(ROWS) if valid[i]]),
        "seq-mean-token-sum-norm": -(a * m).sum() / (valid.sum() * R),
    }[mode]
    np.testing.assert_allclose(float(sum(shares)), expected, rtol=1e-5)
    # the naive mean of per-micro-batch token-means is different: accumulation must not do that
    if mode == "token-mean":
        naive = np.mean([-(a[i:i + 2] * m[i:i + 2]).sum() / max(m[i:i + 2].sum(), 1) for i in range(0, ROWS, 2)])
        assert abs(naive - expected) > 1e-2


def test_grad_clipping_matches_the_formula():
    c, eps = 0.5, 1e4
    optim = OptimConfig(lr=0.1, weight_decay=0.0, betas=[0.0, 0.0], eps=eps)
    params = {"w": jnp.zeros((3,), jnp.float32), "b": jnp.zeros((2,), jnp.float32)}
    grads = {"w": jnp.asarray([3.0, 0.0, 4.0]), "b": jnp.asarray([0.0, 12.0])}
    new, metrics = apply_update(init_train_state(params, make_optimizer(optim, c)), grads, make_optimizer(optim, c),
                                optim)
    g = {k: np.asarray(v, np.float64) for k, v in grads.items()}
    norm = math.sqrt(sum((v ** 2).sum() for v in g.values()))
    assert math.isclose(float(metrics["grad_norm"]), norm, rel_tol=1e-6)  # 13, reported before clipping
    scale = min(1.0, c / norm)
    for k in g:
        gc = g[k] * scale
        np.testing.assert_allclose(new.params[k], -0.1 * gc / (np.abs(gc) + eps), rtol=1e-5)  # Adam, b1=b2=0
    free = optim  # the same settings, no grad_clip
    unclipped, _ = apply_update(init_train_state(params, make_optimizer(free, None)), grads, make_optimizer(free, None),
                                free)
    np.testing.assert_allclose(unclipped.params["w"], np.asarray(new.params["w"]) / scale, rtol=1e-3)


def test_non_finite_gradient_skips_the_update():
    optim = OptimConfig(lr=0.1)
    params = {"w": jnp.ones((2,), jnp.float32)}
    state = init_train_state(params, make_optimizer(optim, 1.0))
    new, metrics = apply_update(state, {"w": jnp.asarray([jnp.nan, 1.0])}, make_optimizer(optim, 1.0), optim)
    assert float(metrics["skipped"]) == 1.0 and int(new.step) == 0
    np.testing.assert_array_equal(new.params["w"], params["w"])
    for a, b in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(a, b)


def test_jitted_donated_step_skips_a_non_finite_update_and_matches_optax_on_a_finite_one():
    """The jitted, donated train step (the update under ``lax.cond``): a NaN loss leaves params, Adam moments and the
    step count as they were, bit for bit; the next finite step equals clip + AdamW written with optax directly."""
    optim = OptimConfig(lr=0.05, weight_decay=0.01)
    optimizer = make_optimizer(optim, 1.0)
    params = {"w": jnp.asarray(np.random.RandomState(0).normal(size=(3, 4)), jnp.float32), "b": jnp.ones((4,))}

    def loss_fn(p, micro, _denominators):
        out = micro["x"] @ p["w"] + p["b"]
        return jnp.sum(out * out) * micro["scale"][0], {}

    step = make_train_step(loss_fn, optim, optimizer=optimizer, donate=True)
    x = jnp.asarray(np.random.RandomState(1).normal(size=(2, 5, 3)), jnp.float32)  # 2 micro-batches of 5 rows
    start = init_train_state(jax.tree.map(jnp.copy, params), optimizer)
    before = jax.tree.map(np.asarray, start)
    state, metrics = step(start, {"x": x, "scale": jnp.full((2, 1), jnp.nan)})
    assert float(metrics["skipped"]) == 1.0
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)

    state, metrics = step(state, {"x": x, "scale": jnp.ones((2, 1))})
    assert float(metrics["skipped"]) == 0.0 and int(state.step) == 1
    grads = jax.grad(lambda p: sum(loss_fn(p, {"x": x[i], "scale": jnp.ones((1,))}, None)[0] for i in range(2)))(params)
    assert float(learning_rate(optim, 0)) > 0
    updates, _ = optimizer.update(grads, set_learning_rate(optimizer.init(params), learning_rate(optim, 0)), params)
    for name in params:
        np.testing.assert_allclose(state.params[name], params[name] + updates[name], rtol=1e-6, atol=1e-7)


def _reference_lr(s, lr, warmup, kind, total, ratio):
    """verl's LambdaLR factors (``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup``
    in verl/utils/torch_functional.py), written out in float64: s/W during warm-up, then 1 or the cosine."""
    if s < warmup:
        return lr * s / max(1, warmup)
    if kind == "constant":
        return lr
    p = min(max((s - warmup) / max(1, total - warmup), 0.0), 1.0)
    coef, intercept = (1 - ratio) * 0.5, (1 + ratio) * 0.5
    return lr * max(ratio, math.cos(math.pi * p) * coef + intercept)


@pytest.mark.parametrize("kind,ratio", [("constant", 0.0), ("cosine", 0.0), ("cosine", 0.1)])
def test_lr_schedule_values(kind, ratio):
    cfg = OptimConfig(lr=2e-3, warmup_steps=4, lr_scheduler=kind, total_steps=20, min_lr_ratio=ratio)
    for s in [0, 1, 3, 4, 5, 10, 19, 20, 30]:
        assert math.isclose(float(learning_rate(cfg, s)), _reference_lr(s, 2e-3, 4, kind, 20, ratio), rel_tol=1e-5)


def test_train_step_uses_the_scheduled_lr():
    optim = OptimConfig(lr=1e-3, warmup_steps=3, weight_decay=0.0, lr_scheduler="cosine", total_steps=6)
    step = make_step(loss_config(), optim, grad_clip=1.0)
    state = init_train_state(toy_params(), make_optimizer(optim, 1.0))
    seen = []
    for _ in range(5):
        old = state
        state, metrics = step(state, micro_split(toy_batch(), 2))
        seen.append(float(metrics["lr"]))
        assert old.params["table"].is_deleted(), "the state was not donated"
    np.testing.assert_allclose(seen, [_reference_lr(s, 1e-3, 3, "cosine", 6, 0.0) for s in range(5)], rtol=1e-5)


def test_schedule_step_sets_the_lr_of_every_update_it_is_given():
    """verl steps its scheduler once per update_actor call, however many optimizer updates that call takes:
    the step given to the train step sets the lr; the updates taken so far (state.step) do not."""
    optim = OptimConfig(lr=1e-3, warmup_steps=2, weight_decay=0.0)
    step = make_step(loss_config(), optim, grad_clip=1.0)
    state = init_train_state(toy_params(), make_optimizer(optim, 1.0))
    seen = []
    for schedule_step in (0, 0, 0, 1, 1, 1, 2):  # three training steps of 3, 3 and 1 updates
        before = np.asarray(state.params["table"]).copy()
        state, metrics = step(state, micro_split(toy_batch(), 2), schedule_step)
        seen.append(float(metrics["lr"]))
        if schedule_step == 0:  # lr 0: Adam moves nothing (weight decay is scaled by the lr too)
            np.testing.assert_array_equal(np.asarray(state.params["table"]), before)
    assert int(state.step) == 7
    np.testing.assert_allclose(seen, [0.0] * 3 + [5e-4] * 3 + [1e-3], rtol=1e-6)


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match=r"actor.optim: unknown key\(s\) \['lr_warmup'\]; valid: .*warmup_steps"):
        build_dataclass(OptimConfig, {"lr": 1e-5, "lr_warmup": 3}, "actor.optim")
    with pytest.raises(ValueError, match="lr_scheduler='linear'; valid"):
        check_optim(OptimConfig(lr_scheduler="linear"))
    with pytest.raises(ValueError, match="total_steps"):
        check_optim(OptimConfig(lr_scheduler="cosine", warmup_steps=5, total_steps=5))
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        loss_config(loss_agg_mode="mean")
    with pytest.raises(ValueError, match="vanilla"):
        loss_config(policy_loss={"loss_mode": "ppo2"})
    with pytest.raises(ValueError, match="rollout_correction.level='tokens'"):
        loss_config(rollout_correction={"level": "tokens"})
