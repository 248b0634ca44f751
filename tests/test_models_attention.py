"""Attention implementations (``jaxrl_hf.models.attention``): blockwise == eager (outputs and gradients) on every
masking case, both against a float64 numpy loop, the full model with each, O(T) compiled memory, the cudnn
selection rules, rematerialisation policies, and the config keys that choose them."""

from __future__ import annotations

import dataclasses
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import random_params, tiny_config
from jaxrl_hf.config import load_config
from jaxrl_hf.config.build import ConfigError
from jaxrl_hf.config.schema import ModelConfig
from jaxrl_hf.models import attention as attn
from jaxrl_hf.models import packed_attention
from jaxrl_hf.models.config import SUPPORTED_REMAT
from jaxrl_hf.models.forward import forward, init_params, next_token_targets, token_log_probs_and_entropy
from jaxrl_hf.models.row_layout import RowLayout
from jaxrl_hf.workers.common import WorkerConfigError, load_model

T = 37  # not a multiple of the 8 / 16 blocks below


def _segments(case: str, batch: int = 2) -> np.ndarray:
    """Segment ids [batch, T] for one masking case (0 = padding)."""
    seg = np.ones((batch, T), np.int32)
    if case == "left_padding":
        seg[0, :9], seg[1, :2] = 0, 0
    elif case == "packed":  # three rows packed into row 0 (with trailing padding), left padding + packing in row 1
        seg[0, 12:25], seg[0, 25:33], seg[0, 33:] = 2, 3, 0
        seg[1, :4], seg[1, 20:] = 0, 2
    elif case == "fully_masked":  # an all-padding row; padded queries in the middle of a row
        seg[0] = 0
        seg[1, :5], seg[1, 17:21], seg[1, 30:] = 0, 0, 0
    return seg


def _qkv(seed: int, kv_heads: int, groups: int, head_dim: int = 8, batch: int = 2) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, T, kv_heads, groups, head_dim))
    k, v = (rng.normal(size=(batch, T, kv_heads, head_dim)) for _ in range(2))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v))


def _numpy_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, seg: np.ndarray, scale: float,
                     window: int = 0) -> np.ndarray:
    """float64 loops: softmax over the keys j <= i of the query's own (non-zero) segment, with j > i - window when
    window > 0; no key -> NaN row."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, t_, kh, g, _ = q.shape
    out = np.full(q.shape, np.nan)
    for b in range(b_):
        for i in range(t_):
            keys = [j for j in range(i + 1) if seg[b, j] != 0 and seg[b, j] == seg[b, i] and (not window or j > i - window)]
            if not keys:
                continue
            for h in range(kh):
                for gg in range(g):
                    s = np.array([q[b, i, h, gg] @ k[b, j, h] * scale for j in keys])
                    w = np.exp(s - s.max())
                    out[b, i, h, gg] = (w / w.sum()) @ v[b, keys, h]
    return out


CASES = [  # (segments case, kv_heads, groups, block_q, block_k, sliding window; 0 = none)
    ("causal", 4, 1, 16, 16, 0),
    ("gqa", 2, 3, 8, 8, 0),
    ("left_padding", 2, 2, 16, 8, 0),
    ("packed", 1, 4, 8, 16, 0),
    ("fully_masked", 2, 2, 5, 7, 0),
    # windows narrower than a block: whole tiles before the window are skipped (forward and backward)
    ("left_padding", 2, 2, 4, 8, 6),
    ("packed", 1, 4, 8, 4, 5),
    ("fully_masked", 2, 2, 5, 7, 3),
    ("causal", 2, 2, 8, 8, 17),
]


@pytest.mark.parametrize("case,kv_heads,groups,block_q,block_k,window", CASES)
def test_blockwise_equals_eager_and_float64_reference(case, kv_heads, groups, block_q, block_k, window):
    q, k, v = _qkv(len(case) + 10 * kv_heads + window, kv_heads, groups)
    seg = _segments(case)
    scale = 8 ** -0.5
    valid = jnp.asarray(seg != 0)[:, :, None, None, None]
    segments = jnp.asarray(seg)
    w = jnp.int32(window) if window else None
    blockwise = lambda q, k, v: attn.blockwise_attention(q, k, v, segments, scale, block_q, block_k, w)  # noqa: E731
    eager = lambda q, k, v: attn.eager_attention(q, k, v, segments, scale, w)  # noqa: E731

    got = np.asarray(jax.jit(blockwise)(q, k, v))
    want = np.asarray(jax.jit(eager)(q, k, v))
    ref = _numpy_attention(q, k, v, seg, scale, window)
    rows = np.asarray(valid)[..., 0, 0, 0].astype(bool)
    np.testing.assert_allclose(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[rows], ref[rows], atol=1e-5, rtol=1e-5)
    assert np.all(got[~rows] == 0.0)  # a query that sees no key gives zeros

    # gradients w.r.t. q, k, v for a random cotangent on the rows that see keys
    cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.float32) * valid
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * cot)  # noqa: E731
    g_block = jax.jit(jax.grad(loss(blockwise), argnums=(0, 1, 2)))(q, k, v)
    g_eager = jax.jit(jax.grad(loss(eager), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", g_block, g_eager):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5, err_msg=f"d{name}")
    if not rows.all():  # a cotangent on fully-masked rows too: still finite, and no gradient flows from them
        full = jax.grad(lambda q, k, v: jnp.sum(blockwise(q, k, v)), argnums=(0, 1, 2))(q, k, v)
        assert all(np.isfinite(np.asarray(g)).all() for g in full)
        assert np.all(np.asarray(full[0])[~rows] == 0.0)


@pytest.mark.parametrize("block_q,block_k", [(8, 8), (4, 8), (8, 4), (5, 7)])
def test_blockwise_skips_exactly_the_tiles_no_query_sees(block_q, block_k):
    """`key_block_range` / `query_block_range` against a brute force over the (query, key) pairs of each tile: every
    tile with a visible pair (causal, inside the window) is computed, every other one skipped."""
    step = math.lcm(block_q, block_k)
    t = step * max(3, -(-40 // step))  # a padded length, as blockwise_attention makes it
    num_q, num_k = t // block_q, t // block_k
    for window in (0, 1, 3, block_k, block_q + 5, t):
        sees = lambda i, j: any(kk <= qq and (not window or kk > qq - window)  # noqa: E731
                                for qq in range(i * block_q, (i + 1) * block_q)
                                for kk in range(j * block_k, (j + 1) * block_k))
        w = jnp.int32(window)
        for i in range(num_q):
            first, last = attn.key_block_range(i, block_q, block_k, num_k, w)
            assert list(range(int(first), int(last))) == [j for j in range(num_k) if sees(i, j)], (window, i)
        for j in range(num_k):
            first, last = attn.query_block_range(j, block_q, block_k, num_q, w)
            assert list(range(int(first), int(last))) == [i for i in range(num_q) if sees(i, j)], (window, j)


def test_window_512_at_4096_tokens_computes_15_of_36_causal_tiles():
    """The saving at T=4096 with 512-token blocks (the default): a window of 512 leaves each query block its own
    diagonal tile and the one before it."""
    def tiles(window):
        ranges = [attn.key_block_range(i, 512, 512, 8, jnp.int32(window)) for i in range(8)]
        return sum(int(last) - int(first) for first, last in ranges)

    backward = sum(int(b) - int(a) for a, b in (attn.query_block_range(j, 512, 512, 8, jnp.int32(512))
                                                  for j in range(8)))
    assert (tiles(0), tiles(512), backward) == (36, 15, 15)


def test_windowed_blockwise_runs_only_the_visible_tiles(monkeypatch):
    """The tiles actually computed (one host callback per tile) by the compiled forward, and by forward + backward:
    T=64 in 8-token blocks, window 8: 15 of the 36 causal tiles each way."""
    computed = []
    block_scores = attn._block_scores

    def counting(*args, **kwargs):
        jax.debug.callback(lambda: computed.append(1))
        return block_scores(*args, **kwargs)

    monkeypatch.setattr(attn, "_block_scores", counting)
    q, k, v = (x[:, :32] for x in _qkv(3, 1, 2, batch=1))
    q, k, v = (jnp.concatenate([x, x], axis=1) for x in (q, k, v))  # T = 64
    seg = jnp.ones((1, 64), jnp.int32)
    fn = lambda q, k, v, w: jnp.sum(attn.blockwise_attention(q, k, v, seg, 0.3, 8, 8, w))  # noqa: E731
    counts = {}
    for window in (0, 8):
        computed.clear()
        jax.block_until_ready(jax.jit(fn)(q, k, v, jnp.int32(window)))
        forward = len(computed)
        computed.clear()
        jax.block_until_ready(jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v, jnp.int32(window)))
        counts[window] = (forward, len(computed))
    assert counts == {0: (36, 72), 8: (15, 30)}, counts


def test_blockwise_bfloat16_tracks_float32():
    """bfloat16 inputs: f32 scores, statistics and accumulators inside, so output and gradients stay within
    bfloat16 rounding of the float32 result."""
    q, k, v = _qkv(7, 2, 2)
    seg = jnp.asarray(_segments("packed"))
    f = lambda q, k, v: attn.blockwise_attention(q, k, v, seg, 0.35, 8, 8)  # noqa: E731
    loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * (seg != 0)[:, :, None, None, None])  # noqa: E731
    want, want_grads = f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    low = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
    got, got_grads = f(*low), jax.grad(loss, argnums=(0, 1, 2))(*low)
    assert got.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in got_grads)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2, rtol=3e-2)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b), atol=5e-2, rtol=5e-2)


def test_model_blockwise_equals_eager_logits_and_param_grads():
    config = tiny_config(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    params = random_params(config)
    rng = np.random.default_rng(3)
    ids = jnp.asarray(rng.integers(3, config.vocab_size, (2, 24)), jnp.int32)
    seg = np.ones((2, 24), np.int32)
    seg[0, :6] = 0  # left padding
    seg[1, 10:], seg[1, 20:] = 2, 0  # two packed rows + right padding
    positions = jnp.asarray(np.concatenate([np.maximum(np.arange(24) - 6, 0)[None],
                                            np.where(np.arange(24) < 10, np.arange(24), np.arange(24) - 10)[None]]))
    mask = jnp.asarray(seg)
    valid = np.asarray(seg != 0)

    def loss(p, cfg):
        lp, ent = token_log_probs_and_entropy(p, cfg, ids, next_token_targets(ids), mask, positions, chunk_size=8)
        return jnp.sum((lp + 0.1 * ent) * mask.astype(bool))

    results = {}
    variants = {"eager": dict(attn_implementation="eager"), "blockwise": dict(attn_implementation="blockwise"),
                # attention one packed row at a time: 2 rows per sequence, the longest 18 tokens (row 0)
                "per-row": dict(attn_implementation="eager", row_layout=RowLayout("packed", (2, 18))),
                "per-row blockwise": dict(attn_implementation="blockwise", row_layout=RowLayout("packed", (2, 20)))}
    for name, options in variants.items():
        cfg = dataclasses.replace(config, **options)
        logits = jax.jit(forward, static_argnums=1)(params, cfg, ids, mask, positions)
        grads = jax.jit(jax.grad(loss), static_argnums=1)(params, cfg)
        results[name] = (np.asarray(logits)[valid], grads)
    for name in ("blockwise", "per-row", "per-row blockwise"):
        np.testing.assert_allclose(results[name][0], results["eager"][0], atol=1e-5, rtol=1e-5, err_msg=name)
        for a, b in zip(jax.tree.leaves(results[name][1]), jax.tree.leaves(results["eager"][1])):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("window,width,inner", [(0, 17, "eager"), (5, 17, "eager"), (0, 24, "blockwise"),
                                                (4, 20, "blockwise")])
def test_per_row_attention_equals_attention_over_the_packed_sequence(window, width, inner):
    """Rows 1..3 of a packed sequence (one slot empty in the second sequence, padding before and after) attended
    one at a time in slots of ``width`` (the longest row is 17) == attention over the whole sequence: outputs
    (padding: 0) and the gradients of q, k, v."""
    q, k, v = _qkv(5 + window, 2, 2)
    seg = _segments("packed")
    segments, scale = jnp.asarray(seg), 8 ** -0.5
    w = jnp.int32(window) if window else None
    impl = {"eager": lambda q, k, v, s: attn.eager_attention(q, k, v, s, scale, w),
            "blockwise": lambda q, k, v, s: attn.blockwise_attention(q, k, v, s, scale, 8, 8, w)}[inner]
    whole = lambda q, k, v: attn.eager_attention(q, k, v, segments, scale, w)  # noqa: E731
    per_row = lambda q, k, v: packed_attention.per_row_attention(q, k, v, segments, 3, width, impl)  # noqa: E731
    valid = seg != 0
    got, want = np.asarray(jax.jit(per_row)(q, k, v)), np.asarray(jax.jit(whole)(q, k, v))
    np.testing.assert_allclose(got[valid], want[valid], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got[valid], _numpy_attention(q, k, v, seg, scale, window)[valid], atol=1e-5, rtol=1e-5)
    assert np.all(got[~valid] == 0.0)
    cot = jnp.asarray(np.random.default_rng(2).normal(size=q.shape), jnp.float32) * valid[:, :, None, None, None]
    grads = [jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v) * cot), argnums=(0, 1, 2)))(q, k, v)
             for f in (per_row, whole)]
    for name, a, b in zip("qkv", *grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_per_row_attention_pays_only_where_it_computes_fewer_scores():
    assert packed_attention.per_row_attention_pays(4, 96, 320)  # the default DAPO run's packed update: 36,864 vs 102,400 scores
    assert packed_attention.per_row_attention_pays(2, 14, 32)
    assert packed_attention.per_row_attention_pays(16, 4096, 16384)  # equal score counts (268 M): per row, where cuDNN can run
    assert not packed_attention.per_row_attention_pays(8, 512, 1024)  # 2.1 M scores in row slots vs 1.05 M over the sequence
    assert not packed_attention.per_row_attention_pays(64, 128, 1024)  # equal scores, but 8x the queries of the sequence
    assert not packed_attention.per_row_attention_pays(1, 16384, 16384)  # one row: the packed sequence is already one run
    with pytest.raises(ValueError, match=r"row layout 'packed': shape=\(0, 5\) must be \(rows, width\)"):
        RowLayout("packed", (0, 5))


def test_blockwise_grad_memory_is_linear_in_length():
    """Compiled (never run) gradient of a one-layer model at T=4096: the eager program holds [T, T] scores, the
    blockwise one only O(T) activations and a few block tiles."""
    b, t = 1, 4096
    config = tiny_config(num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=t)
    params = jax.eval_shape(lambda: init_params(config, 0))
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)
    temp = {}
    for name in ("eager", "blockwise"):
        cfg = dataclasses.replace(config, attn_implementation=name)
        loss = lambda p, i: jnp.sum(forward(p, cfg, i)[..., 0])  # noqa: E731
        temp[name] = jax.jit(jax.grad(loss)).lower(params, ids).compile().memory_analysis().temp_size_in_bytes
    scores_bytes = b * config.num_attention_heads * t * t * 4
    assert temp["eager"] >= scores_bytes  # the reference really materialises the scores
    assert temp["blockwise"] < temp["eager"] / 4 and temp["blockwise"] < scores_bytes / 4, temp


def test_auto_and_cudnn_selection_on_this_backend():
    assert jax.default_backend() != "gpu"
    assert attn.resolve_implementation("auto", attn.AUTO_BLOCKWISE_MIN_KEYS + 1, jnp.bfloat16, 64) == "blockwise"
    assert attn.resolve_implementation("auto", attn.AUTO_BLOCKWISE_MIN_KEYS, jnp.bfloat16, 64) == "eager"
    with pytest.raises(ValueError, match=r"model\.attn_implementation='cudnn'.*GPU"):
        attn.resolve_implementation("cudnn", 16, jnp.bfloat16, 64)
    config = tiny_config(attn_implementation="cudnn")
    with pytest.raises(ValueError, match=r"model\.attn_implementation='cudnn'"):
        forward(random_params(tiny_config()), config, jnp.ones((1, 4), jnp.int32))
    with pytest.raises(WorkerConfigError, match=r"critic\.model\.attn_implementation='cudnn'.*GPU"):
        load_model(ModelConfig(path="tiny-random", attn_implementation="cudnn"), where="critic.model")
    with pytest.raises(ValueError, match=r"model\.attn_implementation"):
        tiny_config(attn_implementation="flash")


def test_prefix_length_path_of_cudnn_equals_eager():
    """The cudnn path's masking (rows rotated so their run starts at 0, lengths as sequence lengths) run with
    jax's ``xla`` implementation of the same API; packed rows and gaps are detected for the blockwise fallback."""
    q, k, v = _qkv(5, 2, 2)
    seg = np.ones((3, T), np.int32)
    seg[0, :11], seg[1, :3], seg[1, 30:], seg[2] = 0, 0, 0, 0
    q, k, v = (jnp.concatenate([x, x[:1]]) for x in (q, k, v))
    got = np.asarray(attn.prefix_length_attention(q, k, v, jnp.asarray(seg), 0.3, implementation="xla"))
    want = np.asarray(attn.eager_attention(q, k, v, jnp.asarray(seg), 0.3))
    rows = seg != 0
    np.testing.assert_allclose(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    assert np.all(got[~rows] == 0.0)
    assert bool(attn._contiguous_runs(jnp.asarray(seg))[2])
    assert not bool(attn._contiguous_runs(jnp.asarray(_segments("packed")))[2])
    assert not bool(attn._contiguous_runs(jnp.asarray(_segments("fully_masked")))[2])  # a gap inside row 1


def _count_primitive(jaxpr, name: str) -> int:
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    count += _count_primitive(inner, name)
    return count


def test_remat_policies_keep_gradients_and_save_attn_out_skips_attention_recompute():
    config = tiny_config(num_hidden_layers=1, attn_implementation="blockwise")
    params = random_params(config)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, config.vocab_size, (2, 12)), jnp.int32)
    mask = jnp.asarray(np.concatenate([np.zeros((2, 3)), np.ones((2, 9))], axis=1).astype(np.int32))

    def grad_fn(cfg):
        return jax.grad(lambda p: jnp.sum(forward(p, cfg, ids, mask) * mask[..., None]))

    # the blockwise forward and its backward each hold one while loop (the key / query blocks a block sees);
    # full remat reruns the forward in the backward pass, save_attn_out-style policies keep its output
    loops = {}
    reference = jax.jit(grad_fn(config))(params)
    for remat in ("full", "save_attn_out", "save_attn_out_mlp_in", "dots_no_batch_attn_out"):
        cfg = dataclasses.replace(config, remat=remat)
        loops[remat] = _count_primitive(jax.make_jaxpr(grad_fn(cfg))(params).jaxpr, "while")
        if remat == "save_attn_out":  # (full remat's gradients: tests/test_models_decoder.py)
            for a, b in zip(jax.tree.leaves(jax.jit(grad_fn(cfg))(params)), jax.tree.leaves(reference)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
    plain = _count_primitive(jax.make_jaxpr(grad_fn(config))(params).jaxpr, "while")
    assert plain == 2 and loops["full"] == 3, (loops, plain)
    assert loops["save_attn_out"] == loops["save_attn_out_mlp_in"] == loops["dots_no_batch_attn_out"] == 2, loops


def test_config_keys():
    # names kept in one place each: the schema's Literal choices equal the model's supported values
    hints = typing.get_type_hints(ModelConfig)
    assert set(typing.get_args(hints["remat"])) == set(SUPPORTED_REMAT)
    assert attn.implementation_names() == ["auto", "blockwise", "cudnn", "eager"]
    with pytest.raises(ConfigError, match=r"model.attn_implementation'='flash'.*attention implementation.*'auto'"):
        load_config("grpo", preset="smoke", overrides=["model.attn_implementation=flash"])

    verl_key = "actor_rollout_ref.model.enable_gradient_checkpointing=true"
    config = load_config("grpo", preset="smoke", overrides=[verl_key, "model.attn_implementation=blockwise"])
    assert (config.model.remat, config.model.attn_implementation) == ("full", "blockwise")
    config = load_config("grpo", preset="smoke", overrides=["model.enable_gradient_checkpointing=true",
                                                          "model.remat=save_attn_out"])
    assert config.model.remat == "save_attn_out"
    assert load_config("grpo", preset="smoke").model.remat == "none"
    config = load_config("ppo", preset="smoke", overrides=["critic.model.path=tiny-random",
                                                         "critic.model.enable_gradient_checkpointing=true"])
    assert config.critic.model.remat == "full"
    with pytest.raises(ConfigError, match=r"model\.attn_implementation"):
        load_config("grpo", preset="smoke", overrides=["model.attn_implementation=flash"])
    with pytest.raises(ConfigError, match=r"model\.remat"):
        load_config("grpo", preset="smoke", overrides=["model.remat=everything"])

    tiny = ModelConfig(path="tiny-random", remat="save_attn_out", attn_implementation="eager")
    loaded = load_model(tiny).config
    assert (loaded.remat, loaded.attn_implementation) == ("save_attn_out", "eager")


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")
def test_blockwise_grads_under_ulysses_tp_sp_mesh_equal_single_device_eager():
    """The custom-VJP loops under the ``sp`` rule set on a (tp=2, dp=2, sp=2) training mesh: the sequence is split
    over sp outside attention and whole inside it (heads over tp·sp), rows over dp."""
    from jaxrl_hf.mesh.device_mesh import build_train_mesh
    from jaxrl_hf.mesh.rule_sets import SP
    from jaxrl_hf.mesh.topology import TrainParallel
    from jaxrl_hf.models import param_shardings

    mesh = build_train_mesh(TrainParallel(1, 2, 4, sp=2))
    config = tiny_config(num_hidden_layers=1, vocab_size=96)
    params = random_params(config)
    ids = jnp.asarray(np.random.default_rng(4).integers(3, config.vocab_size, (4, 20)), jnp.int32)
    mask = jnp.asarray(np.repeat(_segments("packed")[:, :20], 2, axis=0))

    def loss(p, cfg, mesh=None):
        logits = forward(p, cfg, ids, mask, mesh=mesh, rules=SP.activations if mesh is not None else None)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 5] * (mask != 0))

    blockwise = dataclasses.replace(config, attn_implementation="blockwise")
    placed = jax.device_put(params, param_shardings(config, mesh, SP.params))
    got = jax.jit(jax.grad(lambda p: loss(p, blockwise, mesh)))(placed)
    want = jax.jit(jax.grad(lambda p: loss(p, dataclasses.replace(config, attn_implementation="eager"))))(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("t, window, softcap, layout", [(1, None, None, "kt"), (1, 5, None, "k"), (3, None, 30.0, "kt"),
                                                        (3, 4, None, "k")])
def test_stored_attention_equals_cached_attention_over_the_same_keys(t, window, softcap, layout):
    """The unrolled decode's read (`stored_attention`: the new keys already written at ``cache_index``) sees the
    keys `cached_attention` sees (cached slots ++ own keys) and nothing else: masks equal slot by slot, outputs
    equal to float32 rounding; slots after the new ones hold large finite garbage, which must not leak."""
    b, kv, g, d, slots, index = 3, 2, 3, 8, 16, 9
    rng = np.random.default_rng(t)
    q, k_new, v_new = (jnp.asarray(rng.standard_normal(s), jnp.float32)
                       for s in ((b, t, kv, g, d), (b, t, kv, d), (b, t, kv, d)))
    k_cache, v_cache = (rng.standard_normal((b, kv, slots, d)).astype(np.float32) for _ in range(2))
    k_cache[:, :, index + t:], v_cache[:, :, index + t:] = 1e4, -1e4  # not yet written: must stay invisible
    mask = np.ones((b, slots), np.int32)
    mask[0, :4] = 0  # left padding
    mask[1, 6] = 0   # a padded slot in the middle
    mask[2, index + t - 1] = 0  # a finished row's new token: seen by nobody
    old = {"k": jnp.asarray(k_cache), "v": jnp.asarray(v_cache)}
    stored = {"k": old["k"].at[:, :, index:index + t].set(k_new.swapaxes(1, 2)),
              "v": old["v"].at[:, :, index:index + t].set(v_new.swapaxes(1, 2))}
    if layout == "kt":
        old, stored = ({"kt": c["k"].swapaxes(-1, -2), "v": c["v"]} for c in (old, stored))
    idx = jnp.asarray(index)
    cached_mask, new_mask = attn.split_attention_masks(jnp.asarray(mask), idx, slots, t, window)
    full = np.asarray(attn.stored_attention_mask(jnp.asarray(mask), idx, slots, t, window))
    cached_mask, new_mask = (np.broadcast_to(np.asarray(m), (b, 1, 1, t, m.shape[-1])) for m in (cached_mask, new_mask))
    np.testing.assert_array_equal(full[..., :index], cached_mask[..., :index])
    np.testing.assert_array_equal(full[..., index:index + t], new_mask)
    assert not full[..., index + t:].any()
    want = attn.cached_attention(q, k_new, v_new, old, jnp.asarray(mask), idx, 0.3, window, softcap)
    got = attn.stored_attention(q, stored, jnp.asarray(mask), idx, 0.3, window, softcap)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
