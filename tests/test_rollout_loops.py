"""Rollout loops (``rollout.loop``): the registry, the single-turn loop moved out of the actor worker, the engine
protocol, and a test-local two-turn loop proving the seam carries a multi-turn loop (generate -> observation
tokens with ``response_mask`` 0 -> generate again) through the real JAX engine and the real worker."""

from __future__ import annotations

import copy
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import TINY_WORKER_MODEL, random_params, random_prompts, tiny_config, tiny_worker_config
from jaxrl_hf.controller import Batch
from jaxrl_hf.controller.worker import WorkerContext
from jaxrl_hf.models import token_log_probs_and_entropy
from jaxrl_hf.rollout import JaxGenerationEngine, RolloutEngine, SamplingParams
from jaxrl_hf.rollout.loops import (ROLLOUT_LOOPS, RolloutLoop, RolloutRequest, SingleTurnLoop, follow_up_sampling,
                                    make_rollout_loop, register_rollout_loop, sequence_columns)
from jaxrl_hf.workers import ActorRolloutRefWorker
from jaxrl_hf.workers.common import WorkerConfigError

CONFIG = tiny_config(vocab_size=61, eos_token_ids=(2,))
PAD, EOS = 0, 2
OBSERVATION = (5, 6, 7)  # the "tool output" the two-turn loop appends between its two generate calls
TWO_TURN = "test_two_turn_observation"
GENERATED = ("responses", "response_mask", "input_ids", "attention_mask", "position_ids", "rollout_log_probs")


@register_rollout_loop(TWO_TURN)
class TwoTurnLoop(RolloutLoop):
    """generate -> append `OBSERVATION` (response_mask 0, attended) -> generate again from the whole context."""

    def run(self, engine, request):
        first = engine.generate(request.prompt_token_lists(), request.sampling)
        prompts = [p for p in request.prompt_token_lists() for _ in range(request.n)]
        sampled = [row[m > 0].tolist() for row, m in zip(first.response_ids, first.response_mask)]
        second = engine.generate([p + s + list(OBSERVATION) for p, s in zip(prompts, sampled)],
                                 follow_up_sampling(request.sampling, 1))
        width = 2 * request.sampling.max_new_tokens + len(OBSERVATION)
        rows = len(prompts)
        tokens, mask = np.full((rows, width), engine.pad_token_id), np.zeros((rows, width), np.int32)
        attended, logp = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.float32)
        for r in range(rows):
            m1, m2 = first.response_mask[r] > 0, second.response_mask[r] > 0
            row_tokens = [*first.response_ids[r][m1], *OBSERVATION, *second.response_ids[r][m2]]
            row_mask = [1] * int(m1.sum()) + [0] * len(OBSERVATION) + [1] * int(m2.sum())
            row_logp = [*first.log_probs[r][m1], *[0.0] * len(OBSERVATION), *second.log_probs[r][m2]]
            k = len(row_tokens)
            tokens[r, :k], mask[r, :k], attended[r, :k], logp[r, :k] = row_tokens, row_mask, 1, row_logp
        return sequence_columns(request, tokens, mask, logp, attended, meta_info={"loop_turns": 2})


@pytest.fixture(scope="module")
def engine():
    return JaxGenerationEngine(CONFIG, random_params(CONFIG, seed=5), pad_token_id=PAD, eos_token_ids=(EOS,),
                               length_buckets=(8, 16, 32), batch_buckets=(8, 16))


def prompt_batch(seed=0, rows=3, width=7, uid=False):
    prompts, mask = random_prompts(seed, rows, width, CONFIG.vocab_size)
    columns = {"prompts": prompts, "prompt_mask": mask, "score_weight": np.arange(rows, dtype=np.float32) + 0.5,
               "ground_truth": [f"answer {i}" for i in range(rows)]}
    if uid:
        columns["uid"] = [f"prompt-{i}" for i in range(rows)]
    return Batch.from_dict(columns)


def request_of(batch, sampling, first_uid=0):
    return RolloutRequest(batch.arrays, batch.objects, sampling, first_uid=first_uid)


def assembled_like_the_worker_before(batch, engine, sampling, first_uid):
    """What ``ActorRolloutRefWorker.generate_sequences`` built inline before the loop seam (the reference)."""
    n = sampling.n
    prompts, prompt_mask = np.asarray(batch["prompts"]), np.asarray(batch["prompt_mask"])
    out = engine.generate([row[m.astype(bool)].tolist() for row, m in zip(prompts, prompt_mask)], sampling)
    expanded = batch.repeat(n, interleave=True)
    if "uid" not in batch:
        uid = first_uid + np.arange(len(batch))
        expanded = expanded.union(Batch.from_dict({"uid": np.repeat(uid, n).astype(object)}))
    responses, response_mask = out.response_ids.astype(np.int32), out.response_mask.astype(np.int32)
    attention_mask = np.concatenate([np.repeat(prompt_mask, n, axis=0).astype(np.int32), response_mask], axis=1)
    generated = Batch.from_dict({
        "responses": responses, "response_mask": response_mask,
        "input_ids": np.concatenate([np.repeat(prompts, n, axis=0).astype(np.int32), responses], axis=1),
        "attention_mask": attention_mask,
        "position_ids": np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0).astype(np.int32),
        "rollout_log_probs": out.log_probs.astype(np.float32)})
    return expanded.union(generated)


def rescored_log_probs(engine, columns, temperature):
    """Teacher-forced log softmax(logits / T) of every response token over the assembled sequence, using the
    loop's attention_mask and position_ids (what the trainer recomputes)."""
    ids = columns["input_ids"]
    targets = np.concatenate([ids[:, 1:], np.zeros((ids.shape[0], 1), ids.dtype)], 1)
    fn = jax.jit(token_log_probs_and_entropy, static_argnums=1)
    logp, _ = fn(engine.params, CONFIG, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(columns["attention_mask"]),
                 jnp.asarray(columns["position_ids"]), temperature=temperature)
    p = columns["prompts"].shape[1]
    return np.asarray(logp)[:, p - 1:-1]


# ------------------------------------------------------------------------------------------ registry
def test_registry_names_and_alias():
    assert {"single_turn", "single_turn_agent", TWO_TURN} <= set(ROLLOUT_LOOPS.names())
    assert ROLLOUT_LOOPS.get("single_turn") is SingleTurnLoop
    assert ROLLOUT_LOOPS.get("single_turn_agent") is SingleTurnLoop
    assert isinstance(make_rollout_loop("single_turn_agent"), SingleTurnLoop)


def test_unknown_loop_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown rollout loop 'multi_turn_typo'") as err:
        make_rollout_loop("multi_turn_typo")
    for name in ("single_turn", "single_turn_agent", TWO_TURN):
        assert repr(name) in str(err.value)


def test_a_taken_name_is_not_silently_replaced():
    with pytest.raises(ValueError, match="already registered"):
        register_rollout_loop("single_turn")(TwoTurnLoop)
    assert ROLLOUT_LOOPS.get("single_turn") is SingleTurnLoop


def test_config_validation_checks_the_loop_against_the_registry():
    """``rollout.loop`` is validated with the config (before any worker starts), from the registry's names."""
    from jaxrl_hf.config import ConfigError, load_config

    assert load_config("grpo", preset="smoke", overrides=[f"rollout.loop={TWO_TURN}"]).rollout.loop == TWO_TURN
    with pytest.raises(ConfigError, match=r"config key 'rollout\.loop'='multi_turn_typo'.*single_turn_agent"):
        load_config("grpo", preset="smoke", overrides=["rollout.loop=multi_turn_typo"])


def test_worker_rejects_an_unknown_loop_naming_the_key():
    config = {"rollout": {"name": "jax", "loop": "multi_turn_typo"}, "placement": {"train": {"dp": jax.device_count()}}}
    with pytest.raises(WorkerConfigError, match=r"rollout\.loop='multi_turn_typo'.*single_turn_agent"):
        ActorRolloutRefWorker._instantiate(WorkerContext("actor", "local", 0, 1), (config, "actor_rollout"), {})


# ------------------------------------------------------------------------------------------ engine protocol
def test_both_engines_satisfy_the_protocol(engine):
    """The JAX engine by ``isinstance``; the vLLM engine class by its methods' signatures (building one is slow:
    tests/test_rollout_vllm.py checks a live one with ``isinstance``)."""
    assert isinstance(engine, RolloutEngine)
    assert not isinstance(object(), RolloutEngine)
    from jaxrl_hf.rollout.vllm_engine import VllmRolloutEngine

    assert VllmRolloutEngine.engine_name == "vllm"
    for cls in (JaxGenerationEngine, VllmRolloutEngine):
        for method in ("generate", "set_params", "sleep"):
            mine = inspect.signature(getattr(cls, method))
            protocol = inspect.signature(getattr(RolloutEngine, method))
            assert list(mine.parameters)[:len(protocol.parameters)] == list(protocol.parameters), (cls, method)


# ------------------------------------------------------------------------------------------ single turn
@pytest.mark.parametrize("uid", [False, True])
def test_single_turn_loop_equals_the_former_worker_assembly(engine, uid):
    batch = prompt_batch(seed=1, uid=uid)
    sampling = SamplingParams(temperature=0.9, top_k=20, n=2, max_new_tokens=6, seed=11)
    result = make_rollout_loop("single_turn").run(engine, request_of(batch, sampling, first_uid=6))
    want = assembled_like_the_worker_before(batch, engine, sampling, first_uid=6)
    assert list(result.arrays) == list(want.arrays) and list(result.objects) == list(want.objects)
    for key in want.keys():
        got = result.arrays.get(key, result.objects.get(key))
        assert got.dtype == want[key].dtype, key
        np.testing.assert_array_equal(got, want[key], err_msg=key)
    assert result.meta_info == {}


def test_single_turn_columns_masks_interleaving_and_uid(engine):
    batch = prompt_batch(seed=2, rows=3, width=7)
    n, max_new = 3, 8
    sampling = SamplingParams(n=n, max_new_tokens=max_new, seed=4)
    result = make_rollout_loop("single_turn").run(engine, request_of(batch, sampling, first_uid=30))
    out, objects = result.arrays, result.objects
    assert set(out) == set(batch.arrays) | set(GENERATED) and set(objects) == {"ground_truth", "uid"}
    rows, width = 3 * n, batch["prompts"].shape[1]
    assert out["responses"].shape == out["response_mask"].shape == out["rollout_log_probs"].shape == (rows, max_new)
    assert out["input_ids"].shape == out["attention_mask"].shape == out["position_ids"].shape == (rows, width + max_new)
    # interleaved: sample j of prompt i is row i*n + j; every input column is repeated the same way
    np.testing.assert_array_equal(out["prompts"], np.repeat(batch["prompts"], n, axis=0))
    np.testing.assert_array_equal(out["score_weight"], np.repeat(batch["score_weight"], n))
    assert list(objects["ground_truth"]) == [f"answer {i}" for i in range(3) for _ in range(n)]
    assert list(objects["uid"]) == [30 + i for i in range(3) for _ in range(n)]
    np.testing.assert_array_equal(out["input_ids"][:, width:], out["responses"])
    # masks: the response mask is a prefix ending at the first EOS (kept) or at max_new; pad after it
    for r in range(rows):
        length = int(out["response_mask"][r].sum())
        assert out["response_mask"][r, :length].all() and not out["response_mask"][r, length:].any()
        assert (out["responses"][r, length:] == PAD).all()
        eos_at = np.flatnonzero(out["responses"][r, :length] == EOS)
        assert eos_at.size == 0 or eos_at[0] == length - 1
    assert (out["rollout_log_probs"][out["response_mask"] == 0] == 0).all()
    assert (out["rollout_log_probs"][out["response_mask"] == 1] < 0).all()
    # positions count the attended tokens: the first real prompt token is 0, responses continue the count
    attention = out["attention_mask"]
    np.testing.assert_array_equal(out["position_ids"], np.maximum(np.cumsum(attention, 1) - 1, 0))
    first_real = attention.argmax(1)
    assert (out["position_ids"][np.arange(rows), first_real] == 0).all()
    np.testing.assert_array_equal(out["position_ids"][:, width], attention[:, :width].sum(1))


# ------------------------------------------------------------------------------------------ the seam's helpers
def test_follow_up_sampling_gives_each_turn_its_own_reproducible_seed():
    base = SamplingParams(temperature=0.7, n=4, max_new_tokens=5, seed=9)
    one, two = follow_up_sampling(base, 1), follow_up_sampling(base, 2)
    assert one.n == two.n == 1 and one.temperature == 0.7 and one.max_new_tokens == 5
    assert len({base.seed, one.seed, two.seed}) == 3 and follow_up_sampling(base, 1) == one
    assert follow_up_sampling(base, 1, max_new_tokens=3).max_new_tokens == 3
    with pytest.raises(ValueError, match="turn must be >= 1"):
        follow_up_sampling(base, 0)


def test_request_and_columns_reject_bad_input():
    batch = prompt_batch()
    sampling = SamplingParams(n=2, max_new_tokens=4)
    with pytest.raises(KeyError, match="prompt_mask"):
        RolloutRequest({"prompts": batch["prompts"]}, {}, sampling)
    request = request_of(batch, sampling)
    good = np.ones((6, 4), np.int32)
    with pytest.raises(ValueError, match=r"rollout_log_probs has shape \(3, 4\)"):
        sequence_columns(request, good, good, np.zeros((3, 4)))
    with pytest.raises(ValueError, match="response_attention_mask leaves out"):
        sequence_columns(request, good, good, np.zeros((6, 4)), response_attention_mask=np.zeros((6, 4)))
    clash = request_of(Batch.from_dict({**batch.to_dict(), "responses": np.full((3, 4), 9)}), sampling)
    with pytest.raises(ValueError, match=r"rollout loop: an input column clashes .*column 'responses' differs"):
        sequence_columns(clash, good, good, np.zeros((6, 4)))


# ------------------------------------------------------------------------------------------ multi-turn seam
def test_two_turn_loop_through_the_jax_engine(engine):
    batch = prompt_batch(seed=3, rows=3, width=7)
    sampling = SamplingParams(temperature=1.0, n=2, max_new_tokens=6, seed=21)
    request = request_of(batch, sampling)
    result = make_rollout_loop(TWO_TURN).run(engine, request)
    single = make_rollout_loop("single_turn").run(engine, request).arrays
    out = result.arrays
    assert result.meta_info == {"loop_turns": 2}
    rows, width = 6, 7
    assert out["responses"].shape == (rows, 2 * 6 + len(OBSERVATION))
    for r in range(rows):
        k = int(single["response_mask"][r].sum())  # turn one is the single-turn sample (same seed, same rows)
        np.testing.assert_array_equal(out["responses"][r, :k], single["responses"][r, :k])
        np.testing.assert_array_equal(out["rollout_log_probs"][r, :k], single["rollout_log_probs"][r, :k])
        obs = slice(k, k + len(OBSERVATION))
        assert tuple(out["responses"][r, obs]) == OBSERVATION
        assert not out["response_mask"][r, obs].any() and (out["rollout_log_probs"][r, obs] == 0).all()
        assert out["attention_mask"][r, width:][obs].all()
        assert out["response_mask"][r, k + len(OBSERVATION):].sum() > 0  # the second turn sampled tokens
    # every sampled token of both turns has the log-prob a teacher-forced pass over the assembled sequence gives:
    # attention_mask and position_ids carry the observation tokens correctly
    sampled = out["response_mask"] > 0
    ref = rescored_log_probs(engine, out, 1.0)
    assert np.abs(out["rollout_log_probs"][sampled] - ref[sampled]).max() <= 1e-4
    assert out["response_mask"].sum() < out["attention_mask"][:, width:].sum()  # observations: attended, not trained


WORKER_CONFIG = tiny_worker_config(lr=1e-3, n=2, response_length=6, seed=3, rollout={"loop": TWO_TURN},
                                   placement={"train": {"dp": jax.device_count()}})


def test_worker_runs_the_configured_loop():
    """``rollout.loop`` selects the loop the real worker runs; the trainer's recomputed log-probs of the
    multi-turn sequences equal the sampler's on the sampled tokens."""
    worker = ActorRolloutRefWorker._instantiate(WorkerContext("actor", "local", 0, 1),
                                                (copy.deepcopy(WORKER_CONFIG), "actor_rollout"), {})
    worker.init_model()
    prompts, mask = random_prompts(4, 4, 6, TINY_WORKER_MODEL["vocab_size"])
    gen = worker.generate_sequences(Batch.from_dict({"prompts": prompts, "prompt_mask": mask}))
    assert gen.meta_info["loop_turns"] == 2
    assert gen["responses"].shape == (8, 2 * 6 + len(OBSERVATION))
    assert gen.meta_info["num_generated_tokens"] == int(gen["response_mask"].sum())
    observed = (gen["attention_mask"][:, 6:] == 1) & (gen["response_mask"] == 0)
    assert observed.sum(1).tolist() == [len(OBSERVATION)] * 8
    old = worker.compute_log_prob(gen)["old_log_probs"]
    sampled = gen["response_mask"] > 0
    np.testing.assert_allclose(old[sampled], gen["rollout_log_probs"][sampled], atol=2e-5)
