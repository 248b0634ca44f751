"""Native generation engine on tiny random models: log-probs, stop handling, seeds, buckets, filters."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import jit_forward, random_params, tiny_config
from jaxrl_hf.backends.cpu import ffi
from jaxrl_hf.models import token_log_probs_and_entropy
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams, top_k_filter, top_p_filter
from jaxrl_hf.rollout.padding import DEFAULT_LENGTH_BUCKETS, bucket

CONFIG = tiny_config(vocab_size=61, eos_token_ids=())
PAD = 0


@pytest.fixture(scope="module")
def engine():
    return JaxGenerationEngine(CONFIG, random_params(CONFIG, seed=11), pad_token_id=PAD, eos_token_ids=(),
                               length_buckets=(8, 16), batch_buckets=(4, 8))


def _prompts(seed=0, lengths=(5, 3, 7)):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, CONFIG.vocab_size, n)) for n in lengths]


def _rescore(engine, out, temperature):
    """Separate teacher-forced forward over prompt + response: log softmax(logits / T) of each response token."""
    ids = np.concatenate([out.prompt_ids, out.response_ids], 1)
    mask = np.concatenate([out.prompt_mask, out.response_mask], 1)
    targets = np.concatenate([ids[:, 1:], np.zeros((ids.shape[0], 1), ids.dtype)], 1)
    fn = jax.jit(token_log_probs_and_entropy, static_argnums=1)
    logp, _ = fn(engine.params, CONFIG, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(mask),
                 temperature=temperature)
    p = out.prompt_ids.shape[1]
    return np.asarray(logp)[:, p - 1:-1]


def test_sampler_log_probs_equal_separate_forward(engine):
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, n=2, max_new_tokens=12, seed=3)
    out = engine.generate(_prompts(), sp)
    assert out.response_ids.shape == (6, 12) and out.log_probs.dtype == np.float32
    ref = _rescore(engine, out, 0.8)
    m = out.response_mask > 0
    assert m.all()  # no stop tokens configured: every row runs to max_new_tokens
    assert np.abs(out.log_probs[m] - ref[m]).max() <= 1e-4
    # n samples per prompt, interleaved: rows 2i and 2i+1 answer prompt i
    assert np.array_equal(out.prompt_ids[0], out.prompt_ids[1])
    assert not np.array_equal(out.prompt_ids[1], out.prompt_ids[2])


def test_processed_logprobs_mode_renormalises(engine):
    base = dict(temperature=1.0, top_k=5, max_new_tokens=6, seed=1)
    tempered = engine.generate(_prompts(), SamplingParams(**base))
    processed = engine.generate(_prompts(), SamplingParams(**base, logprobs_mode="processed"))
    assert np.array_equal(tempered.response_ids, processed.response_ids)
    assert (processed.log_probs >= tempered.log_probs - 1e-6).all()  # top-k renormalisation raises them
    assert (processed.log_probs > tempered.log_probs + 1e-3).any()


def test_greedy_matches_step_by_step_argmax(engine):
    prompts = _prompts(seed=4)
    out = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=6))
    for row, prompt in enumerate(prompts):
        seq = list(prompt)
        for t in range(6):  # full forward without a KV cache, left-padded to one width (one compilation)
            ids = np.zeros((1, 16), np.int32)
            mask = np.zeros((1, 16), np.int32)
            ids[0, 16 - len(seq):], mask[0, 16 - len(seq):] = seq, 1
            logits = np.asarray(jit_forward(engine.params, CONFIG, jnp.asarray(ids), jnp.asarray(mask)))
            nxt = int(np.argmax(logits[0, -1]))
            assert out.response_ids[row, t] == nxt, (row, t)
            seq.append(nxt)


def test_stop_token_mask_ends_exactly_after_it(engine):
    prompts = _prompts(seed=5)
    free = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=9))
    stop = int(free.response_ids[0, 4])  # a token row 0 emits at step 4
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=9, stop_token_ids=(stop,)))
    for row in range(len(prompts)):
        hits = np.flatnonzero(free.response_ids[row] == stop)
        if hits.size == 0:
            assert out.response_mask[row].all() and out.finish_reason[row] == "length"
            assert np.array_equal(out.response_ids[row], free.response_ids[row])
            continue
        first = hits[0]
        expected_mask = (np.arange(16) <= first).astype(np.int32)
        assert np.array_equal(out.response_mask[row], expected_mask)
        assert np.array_equal(out.response_ids[row, :first + 1], free.response_ids[row, :first + 1])
        assert (out.response_ids[row, first + 1:] == PAD).all() and (out.log_probs[row, first + 1:] == 0).all()
        assert out.finish_reason[row] == "stop"
    assert out.response_mask[0].sum() <= 5


def test_same_seed_same_samples(engine):
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=21)
    a = engine.generate(_prompts(), sp)
    b = engine.generate(_prompts(), sp)
    c = engine.generate(_prompts(), SamplingParams(temperature=1.0, max_new_tokens=8, seed=22))
    assert np.array_equal(a.response_ids, b.response_ids) and np.array_equal(a.log_probs, b.log_probs)
    assert not np.array_equal(a.response_ids, c.response_ids)


def test_batch_bucket_avoids_recompilation():
    eng = JaxGenerationEngine(CONFIG, random_params(CONFIG, seed=11), pad_token_id=PAD,
                              length_buckets=(8, 16), batch_buckets=(4, 8))
    sp = SamplingParams(temperature=1.0, max_new_tokens=4, seed=0)
    eng.generate(_prompts(lengths=(5, 3, 7)), sp)
    assert eng.num_compilations == 1
    eng.generate(_prompts(lengths=(2, 6)), SamplingParams(temperature=0.5, top_p=0.9, max_new_tokens=4, seed=1))
    assert eng.num_compilations == 2  # top-p on is a different program (static flag) ...
    eng.generate(_prompts(lengths=(4, 4, 4, 8)), SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=4, seed=2))
    assert eng.num_compilations == 2  # ... but batch 2 vs 4 and new temperature / top_p / seed reuse it
    eng.generate(_prompts(lengths=(3,) * 5), sp)
    assert eng.num_compilations == 3  # batch 5 falls in the next bucket
    with pytest.raises(ValueError, match="prompt length 17 exceeds the largest bucket 16"):
        eng.generate(_prompts(lengths=(17,)), sp)


def test_default_length_buckets_pad_little():
    """The default prompt buckets: multiples of 8 to 64, then 4 per doubling; any prompt length up to the largest
    bucket (from 9 tokens: shorter ones fill the 16 bucket) is padded by at most 7 tokens or under a fifth of its
    bucket."""
    assert DEFAULT_LENGTH_BUCKETS[:12] == (16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160)
    assert DEFAULT_LENGTH_BUCKETS[-1] == 8192 and list(DEFAULT_LENGTH_BUCKETS) == sorted(set(DEFAULT_LENGTH_BUCKETS))
    for n in range(9, DEFAULT_LENGTH_BUCKETS[-1] + 1):
        width = bucket(n, DEFAULT_LENGTH_BUCKETS, "prompt length")
        assert width - n <= max(7, (width - 1) // 5), n


def test_left_padding_does_not_change_greedy_output(engine):
    short = _prompts(seed=6, lengths=(3,))
    alone = engine.generate(short, SamplingParams(greedy=True, max_new_tokens=5))
    batched = engine.generate(short + _prompts(seed=7, lengths=(12, 9)), SamplingParams(greedy=True, max_new_tokens=5))
    assert np.array_equal(alone.response_ids[0], batched.response_ids[0])
    np.testing.assert_allclose(alone.log_probs[0], batched.log_probs[0], atol=1e-5)


def test_top_k_top_p_filters_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 20)).astype(np.float32)
    kept_k = np.isfinite(np.asarray(top_k_filter(jnp.asarray(logits), 4)))
    assert (kept_k.sum(1) == 4).all()
    assert all(set(np.flatnonzero(kept_k[i])) == set(np.argsort(-logits[i])[:4]) for i in range(3))
    kept_p = np.isfinite(np.asarray(top_p_filter(jnp.asarray(logits), 0.6)))
    for i in range(3):
        order = np.argsort(-logits[i].astype(np.float64))
        p = np.exp(logits[i][order] - logits[i].max())
        p /= p.sum()
        n_keep = int(np.searchsorted(np.cumsum(p), 0.6) + 1)  # smallest prefix with mass >= 0.6
        assert set(np.flatnonzero(kept_p[i])) == set(order[:n_keep])
    assert np.isfinite(np.asarray(top_p_filter(jnp.asarray(logits), 1.0))).all()


def test_sampling_invalid_params_raise():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="logprobs_mode.*valid"):
        SamplingParams(logprobs_mode="bogus")
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def _nucleus_reference(row: np.ndarray, p: float) -> set:
    order = np.argsort(-row.astype(np.float64), kind="stable")
    probs = np.exp(row[order].astype(np.float64) - row.max())
    probs /= probs.sum()
    n_keep = int(np.searchsorted(np.cumsum(probs), p) + 1)
    return set(order[:n_keep])


@pytest.mark.parametrize("spread", ["peaked", "flat"])
def test_top_p_filter_candidates_and_full_sort_agree_with_float64(spread):
    """A peaked row's nucleus ends among the top-k candidates; a flat row's does not (the full-sort fallback)."""
    from jaxrl_hf.rollout.sampling import NUCLEUS_CANDIDATES
    rng = np.random.default_rng(1)
    vocab = 4 * NUCLEUS_CANDIDATES + 37
    logits = rng.normal(size=(4, vocab)).astype(np.float32) * (0.2 if spread == "flat" else 2.0)
    if spread == "peaked":
        logits[:, rng.choice(vocab, 30, replace=False)] += 9.0
    kept = np.isfinite(np.asarray(jax.jit(top_p_filter)(jnp.asarray(logits), jnp.float32(0.7))))
    for i in range(4):
        ref = _nucleus_reference(logits[i], 0.7)
        assert set(np.flatnonzero(kept[i])) == ref
        assert (len(ref) < NUCLEUS_CANDIDATES) == (spread == "peaked")


def test_bisected_nucleus_keeps_ties_and_skips_masked_tokens():
    """The bisection fallback (a flat row: the nucleus is larger than the candidates) over a row of few distinct
    values — ties at the cutoff are kept as `_nucleus_cutoff` keeps them — after top-k masked some tokens to -inf,
    and with -0.0 and +0.0 read as one value."""
    from jaxrl_hf.rollout.sampling import NUCLEUS_CANDIDATES, _bisected_cutoff_keys, _ordered_keys
    rng = np.random.default_rng(2)
    vocab = 4 * NUCLEUS_CANDIDATES
    logits = rng.integers(-3, 3, size=(3, vocab)).astype(np.float32) * np.float32(0.05)
    logits[0, :40] = -np.inf
    logits[1, ::2] = -0.0
    logits[1, 1::2] = 0.0
    for p in (0.3, 0.7, 0.95):
        kept = np.isfinite(np.asarray(jax.jit(top_p_filter)(jnp.asarray(logits), jnp.float32(p))))
        for i in range(3):
            row = np.where(np.isfinite(logits[i]), logits[i], -1e30)
            ref = _nucleus_reference(row, p)
            cutoff = row[list(ref)].min()
            assert set(np.flatnonzero(kept[i])) == set(np.flatnonzero(row >= cutoff)), (p, i)
    keys = np.asarray(_ordered_keys(jnp.asarray([-np.inf, -2.0, -0.0, 0.0, 1e-38, 3.0], np.float32)))
    assert (np.diff(keys.astype(np.int64)) >= 0).all() and keys[2] == keys[3]
    log_norm = jax.nn.logsumexp(jnp.asarray(logits), axis=-1, keepdims=True)
    assert np.asarray(_bisected_cutoff_keys(jnp.asarray(logits), log_norm, 0.7)).shape == (3, 1)


def test_inverse_cdf_sampling_matches_the_distribution():
    from jaxrl_hf.rollout.sampling import categorical_by_inverse_cdf
    probs = np.array([0.0, 0.5, 0.0, 0.2, 0.3, 0.0], np.float64)
    logits = np.where(probs > 0, np.log(np.maximum(probs, 1e-300)), -np.inf).astype(np.float32)
    draws = 20000
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(3), jnp.arange(draws))
    tokens = np.asarray(jax.jit(categorical_by_inverse_cdf)(keys, jnp.broadcast_to(jnp.asarray(logits),
                                                                                    (draws, 6))))
    counts = np.bincount(tokens, minlength=6)
    assert counts[probs == 0].sum() == 0  # masked tokens are never drawn
    expected = probs * draws
    chi2 = float(((counts - expected)[probs > 0] ** 2 / expected[probs > 0]).sum())
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001


def test_inverse_cdf_sampling_never_draws_past_the_last_drawable_token(monkeypatch):
    """u * total rounding up to the total must not select a trailing masked token."""
    from jaxrl_hf.rollout import sampling
    logits = jnp.asarray([[0.0, 0.0, -jnp.inf, -jnp.inf]], jnp.float32)
    monkeypatch.setattr(jax.random, "uniform", lambda key, shape=(), dtype=jnp.float32: jnp.asarray(1.0, dtype))
    assert int(sampling.categorical_by_inverse_cdf(jax.random.key(0)[None], logits)[0]) == 1


def test_n_samples_share_one_prefill_with_the_same_results():
    """n > 1: each prompt is prefilled once (the program sees one row per prompt) and its samples equal the
    samples of an engine that prefills every row."""
    eng = JaxGenerationEngine(CONFIG, random_params(CONFIG, seed=11), pad_token_id=PAD, eos_token_ids=(),
                              length_buckets=(8, 16), batch_buckets=(4, 8, 16))
    prefill_rows = []
    program = eng._program

    def spy(params, ids, *args, **kwargs):
        prefill_rows.append((ids.shape[0], kwargs["share"]))
        return program(params, ids, *args, **kwargs)

    eng._program = spy
    sp = SamplingParams(temperature=1.0, top_p=0.8, n=4, max_new_tokens=10, seed=5)
    shared = eng.generate(_prompts(lengths=(5, 3, 7)), sp)  # 12 rows -> batch bucket 16, 4 prompt rows
    eng._prefill_share = lambda n, batch: 1
    every_row = eng.generate(_prompts(lengths=(5, 3, 7)), sp)
    assert prefill_rows == [(4, 4), (16, 1)]
    assert np.array_equal(shared.prompt_ids, every_row.prompt_ids)
    assert np.array_equal(shared.response_ids, every_row.response_ids)
    np.testing.assert_allclose(shared.log_probs, every_row.log_probs, atol=1e-5)
    assert not np.array_equal(shared.response_ids[0], shared.response_ids[1])  # the samples differ


def test_bf16_cache_is_held_as_bit_patterns_on_cpu_with_identical_samples():
    """On CPU a stacked bf16 KV cache (the scanned layer loop) is held as its uint16 bit patterns (XLA:CPU slices and
    writes a 16-bit float array in place only as integers); the samples and log-probs equal those of a float32
    cache and of a plain bf16 one (which hold the same bf16 keys/values) bit for bit."""
    from jaxrl_hf.rollout.jax_engine import cache_storage_dtype, default_cache_dtype

    config = tiny_config(vocab_size=61, eos_token_ids=(), dtype="bfloat16", qk_norm=True)
    params = random_params(config, seed=3)
    assert default_cache_dtype(config) == "bfloat16" and default_cache_dtype(CONFIG) == "float32"
    assert cache_storage_dtype("bfloat16", config, True) == "uint16"
    assert cache_storage_dtype("bfloat16", config, False) == "bfloat16"
    assert cache_storage_dtype("float32", config, True) == "float32"
    assert cache_storage_dtype("float32", CONFIG, True) == "float32"
    sp = SamplingParams(temperature=1.0, top_p=0.9, n=2, max_new_tokens=8, seed=4)
    outs = []
    for cache_dtype in (None, "float32"):
        eng = JaxGenerationEngine(config, params, pad_token_id=PAD, eos_token_ids=(), length_buckets=(8, 16),
                                  batch_buckets=(4, 8), cache_dtype=cache_dtype, unroll_layers=False)
        assert eng._cache_storage == ("uint16" if cache_dtype is None else "float32")
        outs.append(eng.generate(_prompts(), sp))
    plain = JaxGenerationEngine(config, params, pad_token_id=PAD, eos_token_ids=(), length_buckets=(8, 16),
                                batch_buckets=(4, 8), cache_as_bits=False,
                                unroll_layers=False)  # a real bf16 array, as on a GPU
    assert plain._cache_storage == "bfloat16"
    outs.append(plain.generate(_prompts(), sp))
    for other in outs[1:]:
        assert np.array_equal(outs[0].response_ids, other.response_ids)
        assert np.array_equal(outs[0].log_probs, other.log_probs)


@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2 (biases)"])
def test_bf16_decode_weights_cast_once_give_identical_samples(qkv_bias):
    """On CPU the engine casts the float32 master weights to bf16 once per set_params; for the scanned layer loop the
    stacked layers' as uint16 bit patterns (`models.forward.decode_weights`: XLA:CPU would slice and convert them
    in every decode step); the samples and log-probs equal those of the float32 weights cast inside the program,
    bit for bit."""
    config = tiny_config(vocab_size=61, eos_token_ids=(), dtype="bfloat16", qkv_bias=qkv_bias)
    params = random_params(config, seed=5)
    sp = SamplingParams(temperature=1.0, top_p=0.9, n=2, max_new_tokens=8, seed=6)
    outs = {}
    for cast in (None, False):
        eng = JaxGenerationEngine(config, params, pad_token_id=PAD, eos_token_ids=(), length_buckets=(8, 16),
                                  batch_buckets=(4, 8), cast_weights=cast, unroll_layers=False)
        outs[cast] = eng.generate(_prompts(), sp)
        layers = eng.params["model"]["layers"]
        kernels = {str(x.dtype) for x in jax.tree.leaves(layers["self_attn"]) + jax.tree.leaves(layers["mlp"])}
        norms = {str(x.dtype) for x in jax.tree.leaves(layers["input_layernorm"])}
        assert (kernels, norms) == (({"uint16"}, {"float32"}) if cast is None else ({"float32"}, {"float32"}))
        if cast is None:  # the copy the program reads: the bf16 numbers the model would have cast to
            q = jax.lax.bitcast_convert_type(layers["self_attn"]["q_proj"]["kernel"], jnp.bfloat16)
            assert np.array_equal(np.asarray(q), np.asarray(params["model"]["layers"]["self_attn"]["q_proj"]
                                                             ["kernel"].astype(jnp.bfloat16)))
    assert eng.cast_weights is False
    assert np.array_equal(outs[None].response_ids, outs[False].response_ids)
    assert np.array_equal(outs[None].log_probs, outs[False].log_probs)
    # the stored form is an engine detail: a teacher-forced forward over it gives the float32 weights' log-probs
    eng_cast = JaxGenerationEngine(config, params, pad_token_id=PAD, eos_token_ids=(), length_buckets=(8, 16),
                                   batch_buckets=(4, 8))
    ids = jnp.asarray(np.concatenate([outs[None].prompt_ids, outs[None].response_ids], 1))
    mask = jnp.ones_like(ids)
    targets = jnp.concatenate([ids[:, 1:], jnp.zeros_like(ids[:, :1])], 1)
    a, _ = token_log_probs_and_entropy(eng_cast.params, config, ids, targets, mask)
    b, _ = token_log_probs_and_entropy(params, config, ids, targets, mask)
    assert np.array_equal(np.asarray(a), np.asarray(b))


UNROLL_CASES = {
    "float32": dict(),
    "qwen3 (bias, qk-norm, tied)": dict(qkv_bias=True, qk_norm=True, tie_word_embeddings=True),
    "gemma2 (windows, soft-caps)": dict(model_type="gemma2", hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
                                       sliding_window=4, layer_types=("sliding_attention", "full_attention"),
                                       query_pre_attn_scalar=16.0, attn_logit_softcapping=50.0,
                                       final_logit_softcapping=30.0),
}


@pytest.mark.parametrize("overrides", list(UNROLL_CASES.values()), ids=list(UNROLL_CASES))
@pytest.mark.parametrize("n, max_new", [(1, 9), (3, 9), (2, 70)], ids=["n1", "n3", "n2-phases"])
def test_unrolled_layers_give_the_scanned_loops_samples(overrides, n, max_new):
    """The CPU default for a float32 cache: layers unrolled over per-layer weights and caches, each cache written
    before it is read (keys stored transposed). Samples and log-probs equal the scanned loop's over stacked weights and a
    stacked cache (float32: the same tokens, log-probs to float32 summation order), with a shared prefill (n = 3)
    too, and over decode phases whose caches grow (70 new tokens: phases of 32, 64, 70 steps); ``params`` is the tree
    set, and the program slices no stacked weight."""
    config = tiny_config(vocab_size=61, eos_token_ids=(), **overrides)
    params = random_params(config, seed=8)
    sp = SamplingParams(temperature=1.0, top_p=0.9, n=n, max_new_tokens=max_new, seed=2)
    kwargs = dict(pad_token_id=PAD, eos_token_ids=(), length_buckets=(8, 16), batch_buckets=(4, 8, 16))
    unrolled = JaxGenerationEngine(config, params, **kwargs)
    scanned = JaxGenerationEngine(config, params, unroll_layers=False, **kwargs)
    assert unrolled.unroll_layers and unrolled.keys_transposed and not scanned.unroll_layers
    assert unrolled.cpu_kernels == ffi.available() and not scanned.cpu_kernels
    a, b = unrolled.generate(_prompts(lengths=(5, 3, 7)), sp), scanned.generate(_prompts(lengths=(5, 3, 7)), sp)
    assert np.array_equal(a.response_ids, b.response_ids) and np.array_equal(a.response_mask, b.response_mask)
    np.testing.assert_allclose(a.log_probs, b.log_probs, rtol=2e-6, atol=2e-6)  # the products' summation order
    for x, y in zip(jax.tree.leaves(unrolled.params), jax.tree.leaves(params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))
    layer_shapes = {"f32[" + ",".join(map(str, shape)) + "]"  # one layer's weights, with or without a unit axis
                    for x in jax.tree.leaves(params["model"]["layers"]) if x.ndim > 2
                    for shape in (x.shape[1:], (1, *x.shape[1:]))}
    assert _sliced_shapes(scanned, sp) & layer_shapes  # the scanned loop slices each layer's weights per step
    assert not _sliced_shapes(unrolled, sp) & layer_shapes


@pytest.mark.skipif(not ffi.available(), reason="needs the CPU kernels (x86-64, AVX-512, g++)")
@pytest.mark.parametrize("overrides", [dict(qkv_bias=True, o_bias=True, tie_word_embeddings=True),
                                       dict(sliding_window=4, layer_types=("sliding_attention", "full_attention"))],
                         ids=["bias, tied", "windows"])
def test_cpu_kernels_decode_gives_the_plain_unrolled_loops_samples(overrides):
    """The CPU float32 default where the kernels build (`backends.cpu.ffi`): the projections and (untied) LM head
    over weights held in panel order, in the prefill and the decode steps, and the decode steps' attention over the
    stored cache. The same tokens as XLA's ops over the same per-layer weights, log-probs to float32 summation
    order; ``params`` reads back the tree set."""
    config = tiny_config(vocab_size=61, eos_token_ids=(), **overrides)
    params = random_params(config, seed=4)
    sp = SamplingParams(temperature=1.0, n=2, max_new_tokens=9, seed=5)
    kwargs = dict(pad_token_id=PAD, eos_token_ids=(), length_buckets=(8, 16), batch_buckets=(4, 8, 16))
    panels, plain = (JaxGenerationEngine(config, params, cpu_kernels=p, **kwargs) for p in (True, False))
    a, b = panels.generate(_prompts(lengths=(5, 3, 7)), sp), plain.generate(_prompts(lengths=(5, 3, 7)), sp)
    assert np.array_equal(a.response_ids, b.response_ids)
    np.testing.assert_allclose(a.log_probs, b.log_probs, rtol=2e-6, atol=2e-6)
    calls, program = [], panels._program
    panels._program = lambda *args, **kw: calls.append((args, kw)) or program(*args, **kw)
    panels.generate(_prompts(lengths=(5, 3, 7)), sp)
    hlo = program.lower(*calls[0][0], **calls[0][1]).compile().as_text()
    # 7 projections per layer and the LM head, in the prefill and in the decode loop's body; attention: the body
    assert hlo.count('custom_call_target="jaxrl_hf_panel_matmul"') == 2 * (7 * config.num_hidden_layers + 1)
    assert hlo.count('custom_call_target="jaxrl_hf_cache_attention"') == config.num_hidden_layers
    for x, y in zip(jax.tree.leaves(panels.params), jax.tree.leaves(params)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_cpu_kernels_are_refused_where_they_cannot_run():
    config = tiny_config(vocab_size=61, dtype="bfloat16")
    with pytest.raises(ValueError, match=r"cpu_kernels=True\) needs the unrolled float32 decode"):
        JaxGenerationEngine(config, random_params(config), pad_token_id=PAD, cpu_kernels=True)


def test_a_mixture_of_experts_model_decodes_without_the_panel_kernels():
    """The panel-order kernels have no expert path: the engine's own choice leaves them out on any CPU (an AVX-512
    machine included), and asking for them names the reason."""
    config = tiny_config(vocab_size=61, model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32)
    params = random_params(config)
    engine = JaxGenerationEngine(config, params, pad_token_id=PAD)
    assert engine.unroll_layers and not engine.cpu_kernels
    out = engine.generate([[3, 4, 5]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert out.response_ids.shape == (1, 4)
    with pytest.raises(ValueError, match=r"of a dense model .* num_experts 4"):
        JaxGenerationEngine(config, params, pad_token_id=PAD, cpu_kernels=True)


def test_decode_phases_grow_the_unrolled_caches_in_steps_of_at_least_32():
    from jaxrl_hf.rollout.jax_engine import decode_phases

    assert decode_phases(8) == (8,) and decode_phases(63) == (63,)
    assert decode_phases(70) == (32, 64, 70) and decode_phases(128) == (32, 64, 96, 128)
    assert decode_phases(512) == (128, 256, 384, 512)
    assert decode_phases(200) == (56, 112, 168, 200)  # a quarter of 224, not rounded to 32


def _sliced_shapes(engine, sp):
    """The result shapes of the ``dynamic-slice`` ops in the engine's compiled generate program."""
    calls, program = [], engine._program
    engine._program = lambda *args, **kw: calls.append((args, kw)) or program(*args, **kw)
    engine.generate(_prompts(lengths=(5, 3, 7)), sp)
    engine._program = program
    hlo = program.lower(*calls[0][0], **calls[0][1]).compile().as_text()
    return {m.group(1).split("{")[0] for m in re.finditer(r"= (\S+) dynamic-slice\(", hlo)}


def test_unrolled_bf16_engine_log_probs_match_a_teacher_forced_forward():
    """bf16 compute with the unrolled layers (not the CPU default there; a plain bf16 cache per layer): the
    sampler's log-probs are the training forward's over the same tokens, to bf16 precision."""
    config = tiny_config(vocab_size=61, eos_token_ids=(), dtype="bfloat16")
    params = random_params(config, seed=9)
    assert not JaxGenerationEngine(config, params, pad_token_id=PAD).unroll_layers
    eng = JaxGenerationEngine(config, params, pad_token_id=PAD, eos_token_ids=(), length_buckets=(8, 16),
                              batch_buckets=(4, 8), unroll_layers=True)
    assert eng.unroll_layers and eng._cache_storage == "bfloat16" and not eng.keys_transposed
    out = eng.generate(_prompts(), SamplingParams(temperature=1.0, n=2, max_new_tokens=8, seed=3))
    ids = np.concatenate([out.prompt_ids, out.response_ids], 1)
    mask = np.concatenate([out.prompt_mask, out.response_mask], 1)
    targets = np.concatenate([ids[:, 1:], np.zeros((ids.shape[0], 1), ids.dtype)], 1)
    logp, _ = token_log_probs_and_entropy(params, config, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(mask))
    p = out.prompt_ids.shape[1]
    np.testing.assert_allclose(out.log_probs, np.asarray(logp)[:, p - 1:-1], atol=0.1)


def test_first_argmax_is_argmax_with_ties_infinities_and_nans():
    """`sampling.first_argmax` (two plain reductions) returns `jnp.argmax`'s index: the first maximum, the first
    NaN where a row has one."""
    from jaxrl_hf.rollout.sampling import first_argmax

    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, (64, 97)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2, 5] = np.inf
    x[3, [7, 40]] = np.nan
    x[4, :] = np.nan
    for dtype in (jnp.float32, jnp.bfloat16):
        got = np.asarray(jax.jit(first_argmax)(jnp.asarray(x, dtype)))
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x, dtype), axis=-1)))


def test_cpu_backend_off_keeps_the_core_engine_path():
    """``model.cpu_backend: off`` (`make_rollout_engine`): the scanned layer loop and XLA's ops, where ``auto``
    unrolls the float32 decode on a CPU."""
    from jaxrl_hf.rollout import make_rollout_engine

    params = random_params(CONFIG, seed=11)
    auto = make_rollout_engine("jax", config=CONFIG, params=params, pad_token_id=PAD)
    off = make_rollout_engine("jax", config=CONFIG, params=params, pad_token_id=PAD, cpu_backend="off")
    assert auto.unroll_layers == (jax.devices()[0].platform == "cpu")
    assert not off.unroll_layers and not off.cpu_kernels
