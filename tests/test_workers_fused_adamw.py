"""The one-pass CPU optimizer update (`jaxrl_hf.backends.cpu.fused_adamw`) against AdamW's formula in float64 and against
optax's update, and inside the jitted, donated train step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_hf.config.schema import OptimConfig
from jaxrl_hf.backends.cpu import ffi
from jaxrl_hf.backends.cpu.fused_adamw import TARGET, FusedClipAdamW, clip_adamw, fused_update_for
from jaxrl_hf.workers.optim import learning_rate, make_optimizer, set_learning_rate
from jaxrl_hf.workers.train_step import TrainState, apply_update, init_train_state, make_train_step

pytestmark = pytest.mark.skipif(not ffi.available(), reason="the CPU kernels need x86-64 AVX-512 and g++")

SHAPES = {"w": (37, 129), "v16": (16,), "tail": (16 * 1024 + 5,), "one": (1,), "empty": (0, 3)}
EPS32 = float(np.finfo(np.float32).eps)


def _state(optimizer, seed: int = 0, count: int = 4):
    """A train state whose moments are random (as after ``count`` updates) and its gradients."""
    rs = np.random.RandomState(seed)
    params = {k: (rs.randn(*s) * 0.05).astype(np.float32) for k, s in SHAPES.items()}
    state = init_train_state(params, optimizer)
    mu = {k: (rs.randn(*s) * 1e-3).astype(np.float32) for k, s in SHAPES.items()}
    nu = {k: (rs.rand(*s) * 1e-6).astype(np.float32) for k, s in SHAPES.items()}

    def with_moments(node):
        if isinstance(node, optax.ScaleByAdamState):
            return node._replace(count=jnp.int32(count), mu=mu, nu=nu)
        return node

    opt = jax.tree.map(with_moments, state.opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
    grads = {k: (rs.randn(*s) * 1e-2).astype(np.float32) for k, s in SHAPES.items()}
    return TrainState(params, opt, jnp.int32(count)), grads


def _adam(state: TrainState) -> optax.ScaleByAdamState:
    return next(n for n in jax.tree.leaves(state.opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByAdamState))
                if isinstance(n, optax.ScaleByAdamState))


def _fused_step(fused: FusedClipAdamW, optim: OptimConfig):
    def step(state, grads):
        lr = learning_rate(optim, state.step)
        params, opt = fused(grads, set_learning_rate(state.opt_state, lr), state.params)
        return TrainState(params, opt, state.step + 1)
    return jax.jit(step)


def _reference(state: TrainState, grads, optim: OptimConfig, clip: float | None):
    """AdamW after global-norm clipping, in float64 (the formula of `fused_adamw`'s kernel), and per element the
    magnitude of the terms each result sums (its float32 rounding is relative to them)."""
    f = functools.partial(np.asarray, dtype=np.float64)
    b1, b2 = optim.betas
    # the bias corrections 1 - b^t as optax computes them, in float32 (1 - b^t cancels: the float32 power's
    # rounding moves b2's by ~1e-5 relative at t = 5, in optax's update and the kernel's alike)
    bc1, bc2 = (float(1 - b ** (_adam(state).count + 1)) for b in (b1, b2))
    lr = float(learning_rate(optim, state.step))
    norm = np.sqrt(sum((f(g) ** 2).sum() for g in grads.values()))
    s = clip / norm if clip and norm >= clip else 1.0
    out = {}
    for k, p in state.params.items():
        g, p, m, v = f(grads[k]) * s, f(p), f(_adam(state).mu[k]), f(_adam(state).nu[k])
        m2, v2 = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        m_terms = np.abs(b1 * m) + np.abs((1 - b1) * g)  # m2 is a difference of these: its rounding is theirs
        denom = np.sqrt(v2 / bc2) + optim.eps
        u = (m2 / bc1) / denom + optim.weight_decay * p
        u_terms = (m_terms / bc1) / denom + optim.weight_decay * np.abs(p)
        out[k] = {"p": (p - lr * u, np.abs(p) + lr * u_terms), "m": (m2, m_terms),
                  "v": (v2, np.abs(b2 * v) + (1 - b2) * g * g)}
    return out


def _results(state: TrainState):
    adam = _adam(state)
    return {k: {"p": np.asarray(state.params[k]), "m": np.asarray(adam.mu[k]), "v": np.asarray(adam.nu[k])}
            for k in state.params}


@pytest.mark.parametrize("clip", [1e-3, 10.0, None])  # clipping active, inactive, no clip transform
def test_matches_adamw_in_float64_and_optax(clip):
    optim = OptimConfig(lr=1e-3, weight_decay=0.01, warmup_steps=0)
    optimizer = make_optimizer(optim, clip)
    state, grads = _state(optimizer)
    fused = fused_update_for(optim, clip, state.params, None)
    assert isinstance(fused, FusedClipAdamW)
    ours = _results(_fused_step(fused, optim)(state, grads))
    theirs = _results(jax.jit(functools.partial(apply_update, optimizer=optimizer, optim=optim))(state, grads)[0])
    for k, ref in _reference(state, grads, optim, clip).items():
        for name, (exact, terms) in ref.items():
            # a few float32 roundings of the summed terms (the relative error of the moments' sums of products)
            tol = 6 * EPS32 * terms + 1e-30
            assert np.all(np.abs(ours[k][name] - exact) <= tol), (k, name)
            assert np.all(np.abs(theirs[k][name] - exact) <= tol), (k, name)  # optax meets the same bound


def test_state_keeps_optax_structure_counts_and_lr():
    optim = OptimConfig(lr=2e-3, weight_decay=0.0, warmup_steps=3)
    optimizer = make_optimizer(optim, 1.0)
    state, grads = _state(optimizer, seed=1, count=2)
    ours = _fused_step(fused_update_for(optim, 1.0, state.params, None), optim)(state, grads)
    theirs = jax.jit(functools.partial(apply_update, optimizer=optimizer, optim=optim))(state, grads)[0]
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        assert a.dtype == b.dtype and a.shape == b.shape
        if a.ndim == 0:  # counts, the step, the injected learning rate: exactly optax's
            assert a == b


def test_train_step_with_fused_update_follows_optax_over_updates_and_skips_nan():
    optim = OptimConfig(lr=1e-2, weight_decay=0.01)
    optimizer = make_optimizer(optim, 0.5)
    rs = np.random.RandomState(3)
    params = {"w": jnp.asarray(rs.randn(8, 5), jnp.float32), "b": jnp.zeros((5,), jnp.float32)}
    x = jnp.asarray(rs.randn(2, 4, 8), jnp.float32)  # 2 micro-batches of 4 rows
    y = jnp.asarray(rs.randn(2, 4, 5), jnp.float32)

    def loss_fn(p, micro, _):
        return jnp.sum((micro["x"] @ p["w"] + p["b"] - micro["y"]) ** 2), {}

    fused = fused_update_for(optim, 0.5, params, None)
    steps = {name: make_train_step(loss_fn, optim, optimizer=optimizer, fused=f)
             for name, f in (("optax", None), ("fused", fused))}
    states = {name: init_train_state(jax.tree.map(jnp.copy, params), optimizer) for name in steps}
    for _ in range(4):
        for name, step in steps.items():
            states[name], metrics = step(states[name], {"x": x, "y": y})
    for a, b in zip(jax.tree.leaves(states["fused"]), jax.tree.leaves(states["optax"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
    assert float(metrics["skipped"]) == 0.0
    before = [np.asarray(a).copy() for a in jax.tree.leaves(states["fused"])]
    state, metrics = steps["fused"](states["fused"], {"x": x * jnp.nan, "y": y})
    assert float(metrics["skipped"]) == 1.0
    for a, b in zip(jax.tree.leaves(state), before):
        np.testing.assert_array_equal(np.asarray(a), b)


def test_compiled_step_runs_the_kernel_in_place():
    optim = OptimConfig(lr=1e-3)
    optimizer = make_optimizer(optim, 1.0)
    state, grads = _state(optimizer)
    fused = fused_update_for(optim, 1.0, state.params, None)
    step = jax.jit(functools.partial(apply_update, optimizer=optimizer, optim=optim, fused=fused),
                   donate_argnums=(0,))
    text = step.lower(state, grads).compile().as_text()
    assert text.count(f'custom_call_target="{TARGET}"') == 1
    assert "output_to_operand_aliasing" in text  # p, m and v are updated in their operands' buffers


def test_where_it_applies():
    optim = OptimConfig()
    f32 = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    assert fused_update_for(optim, 1.0, f32, None) is not None
    assert fused_update_for(optim, 1.0, {"w": jax.ShapeDtypeStruct((4, 4), jnp.bfloat16)}, None) is None
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("dp",))
    assert fused_update_for(optim, 1.0, f32, one) is not None
    if len(jax.devices()) > 1:  # a sharded layout keeps optax's update (the kernel sees one device's buffers)
        many = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("dp",))
        assert fused_update_for(optim, 1.0, f32, many) is None


def test_refuses_mismatched_leaves_naming_the_leaf():
    w = jnp.zeros((3, 2), jnp.float32)
    hyper = jnp.zeros((10,), jnp.float32)
    with pytest.raises(ValueError, match="second moment leaf 1 is bfloat16"):
        clip_adamw([w, w], [w, w], [w, w], [w, w.astype(jnp.bfloat16)], hyper)
    with pytest.raises(ValueError, match="1 gradients, 2 params"):
        clip_adamw([w], [w, w], [w, w], [w, w], hyper)
    with pytest.raises(ValueError, match=r"gradient leaf 0 is \['float32\[2, 2\]'\]; needs float32 with 6 elements"):
        clip_adamw([w[:2]], [w], [w], [w], hyper)


def test_a_leaf_updated_from_gradient_pieces_equals_the_whole_gradient():
    optim = OptimConfig(lr=1e-3, weight_decay=0.01, warmup_steps=0)
    optimizer = make_optimizer(optim, 1.0)
    state, grads = _state(optimizer)
    leaves = jax.tree.leaves(state.params)
    adam = state.opt_state[1].inner_state[0]
    mu, nu, g = jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu), jax.tree.leaves(grads)
    hyper = jnp.asarray([0.7, 0.1, 0.9, 0.001, 0.999, 2.0, 3.0, 1e-8, 0.01, -1e-3], jnp.float32)
    whole = jax.jit(clip_adamw)(g, leaves, mu, nu, hyper)
    # every leaf in three pieces of its elements (any shapes: the counts add up; some empty), the 0-size one whole
    pieces = [[*jnp.split(x.reshape(-1), [x.size // 3, x.size // 2])[:2], x.reshape(-1)[x.size // 2:].reshape(-1, 1)]
              if x.size else [x] for x in g]
    split = jax.jit(clip_adamw)(pieces, leaves, mu, nu, hyper)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unrolled_layers_take_per_layer_gradients_with_the_same_updates():
    from _models_helpers import random_params, tiny_config
    from jaxrl_hf.workers.losses import response_log_probs

    config = tiny_config(num_hidden_layers=3, scan_layers=False)
    params = random_params(config, seed=2)
    ids = jnp.asarray(np.random.RandomState(0).randint(3, config.vocab_size, (2, 9)), jnp.int32)
    micro = {"ids": ids[None], "weight": jnp.linspace(-1.0, 1.0, 2 * 4).reshape(1, 2, 4)}

    def loss_fn(p, mb, _):
        logp, _ = response_log_probs(p, config, mb["ids"], jnp.ones_like(mb["ids"]),
                                     jnp.broadcast_to(jnp.arange(9), mb["ids"].shape), 4)
        return jnp.sum(logp * mb["weight"]), {}

    optim = OptimConfig(lr=1e-2, weight_decay=0.01, warmup_steps=0)
    optimizer = make_optimizer(optim, 1.0)
    fused = {"stacked": fused_update_for(optim, 1.0, params, None),
             "per_layer": fused_update_for(optim, 1.0, params, None, unrolled_layers=3)}
    assert fused["stacked"].layers == 0 and fused["per_layer"].layers == 3
    assert fused_update_for(optim, 1.0, {"w": params["model"]["embed_tokens"]["embedding"]}, None, 3).layers == 0
    steps = {k: make_train_step(loss_fn, optim, optimizer=optimizer, fused=f, donate=False) for k, f in fused.items()}
    text = steps["per_layer"].lower(init_train_state(params, optimizer), micro).compile().as_text()
    stacked_grads = [line for line in text.splitlines() if " concatenate(" in line and "f32[3," in line]
    assert not stacked_grads, stacked_grads[:2]  # each layer's gradient goes to the kernel as it was made
    states = {k: init_train_state(jax.tree.map(jnp.copy, params), optimizer) for k in steps}
    for _ in range(2):
        for k, step in steps.items():
            states[k], metrics = step(states[k], micro)
    assert float(metrics["grad_norm"]) > 0
    # The two programs may sum each float32 gradient in another order (per CPU's code generation): a relative
    # difference up to ~n·eps (n ≤ 2·9·64 products, eps 6e-8: ~1e-4) in a gradient, which Adam's normalised step
    # turns into at most lr·1e-4 per step and weight: 2 steps × 1e-2 × 1e-4 = 2e-6 (seen: 1.3e-7 on an Intel Xeon)
    for a, b in zip(jax.tree.leaves(states["per_layer"]), jax.tree.leaves(states["stacked"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)
