"""The ``multi_turn`` rollout loop: tool calls parsed, executed and appended as chat-template tool messages with
``response_mask`` 0; lengths count the model's tokens only; the reward sees the whole trajectory.

A scripted engine (replies chosen from the conversation so far, given log-probs) pins the loop's bookkeeping
exactly; the real JAX engine then continues after a tool message and its log-probs are checked against a
teacher-forced pass over the assembled sequence (so positions and attention around tool tokens are right)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import random_params, tiny_config
from jaxrl_hf.config import ConfigError, load_config
from jaxrl_hf.config.schema import RolloutConfig
from jaxrl_hf.controller import Batch
from jaxrl_hf.models import token_log_probs_and_entropy
from jaxrl_hf.rewards import default_compute_score
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams
from jaxrl_hf.rollout.base import GenerationOutput
from jaxrl_hf.rollout.loops import MultiTurnLoop, RolloutRequest, make_rollout_loop
from jaxrl_hf.rollout.loops.multi_turn import default_tokenizer
from jaxrl_hf.trainer.metrics import data_metrics
from jaxrl_hf.trainer.scoring import trajectory_texts

TOK = default_tokenizer()
EOS = TOK.eos_token_id  # <|im_end|>
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


class ScriptedEngine:
    """A `RolloutEngine` whose reply to a context is ``script(context_text, tool_messages_so_far)`` + EOS,
    every sampled token with log-prob -0.25 (cut at ``max_new_tokens``: then ``finish_reason='length'``)."""

    engine_name, pad_token_id, eos_token_ids = "scripted", 0, (EOS,)

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompts, sampling):
        rows = [list(p) for p in prompts for _ in range(sampling.n)]
        self.calls.append((len(rows), sampling.max_new_tokens))
        width = sampling.max_new_tokens
        ids, mask = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), np.int32)
        logp, finish = np.zeros((len(rows), width), np.float32), []
        for r, context in enumerate(rows):
            text = TOK.decode(context, skip_special_tokens=False)
            reply = (TOK.encode(self.script(text, text.count("<|im_start|>tool"))) + [EOS])[:width]
            ids[r, :len(reply)], mask[r, :len(reply)], logp[r, :len(reply)] = reply, 1, -0.25
            finish.append("stop" if reply[-1] == EOS else "length")
        return GenerationOutput(np.zeros((len(rows), 1), np.int32), np.ones((len(rows), 1), np.int32), ids, mask,
                                logp, finish)

    def set_params(self, params):
        pass

    def sleep(self):
        pass


def loop_with(**multi_turn):
    config = RolloutConfig()
    config.multi_turn = dataclasses.replace(config.multi_turn, enable=True, **multi_turn)
    loop = make_rollout_loop("multi_turn")
    loop.setup(config, TOK)
    return loop


def request(questions, n=1, budget=96, seed=0):
    ids = [TOK.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
           for q in questions]
    width = max(map(len, ids))
    prompts, mask = np.zeros((len(ids), width), np.int32), np.zeros((len(ids), width), np.int32)
    for i, row in enumerate(ids):
        prompts[i, width - len(row):], mask[i, width - len(row):] = row, 1
    batch = Batch.from_dict({"prompts": prompts, "prompt_mask": mask, "data_source": ["calculator"] * len(ids),
                             "ground_truth": [str(eval_truth(q)) for q in questions]})
    return RolloutRequest(batch.arrays, batch.objects, SamplingParams(n=n, max_new_tokens=budget, seed=seed))


def eval_truth(question):
    a, op, b = question.split()[1:4]
    return int(a) * int(b.rstrip(".")) if op == "*" else int(a) + int(b.rstrip("."))


def spans(mask_row):
    """[(start, end, value)] runs of a 0/1 row."""
    out, start = [], 0
    for j in range(1, len(mask_row) + 1):
        if j == len(mask_row) or mask_row[j] != mask_row[start]:
            out.append((start, j, int(mask_row[start])))
            start = j
    return out


def test_tool_call_round_trip_masks_lengths_and_reward_text():
    def script(text, tools_seen):
        expression = text.split("Compute ")[1].split(".")[0]
        if tools_seen == 0:
            return CALL % expression
        return f"Answer: {text.split('<|im_start|>tool')[-1].split('<|im_end|>')[0].strip()}"

    questions = ["Compute 48213 * 9271.", "Compute 123456 + 654321."]
    req = request(questions, n=2)
    result = loop_with().run(ScriptedEngine(script), req)
    out = result.arrays
    turn1 = [TOK.encode(CALL % q.split("Compute ")[1][:-1]) + [EOS] for q in questions]
    turn2 = [TOK.encode(f"Answer: {eval_truth(q)}") + [EOS] for q in questions]
    for r in range(4):
        q = r // 2
        obs = TOK.encode(f"\n<|im_start|>tool\n{eval_truth(questions[q])}<|im_end|>\n<|im_start|>assistant\n")
        want = turn1[q] + obs + turn2[q]
        assert out["responses"][r, :len(want)].tolist() == want
        assert (out["responses"][r, len(want):] == 0).all()
        want_mask = [1] * len(turn1[q]) + [0] * len(obs) + [1] * len(turn2[q])
        assert out["response_mask"][r, :len(want)].tolist() == want_mask and not out["response_mask"][r, len(want):].any()
        assert (out["attention_mask"][r, -96:][:len(want)] == 1).all() and not out["attention_mask"][r, -96:][len(want):].any()
        np.testing.assert_array_equal(out["rollout_log_probs"][r], np.where(out["response_mask"][r] > 0, -0.25, 0.0))
    assert out["num_turns"].tolist() == [2] * 4 and out["num_tool_calls"].tolist() == [1] * 4
    assert out["num_tool_errors"].tolist() == [0] * 4
    batch = Batch(out, result.objects)
    texts = trajectory_texts(batch, TOK)
    for r, text in enumerate(texts):  # the reward reads the whole trajectory: the call, the tool answer, the answer
        truth = str(eval_truth(questions[r // 2]))
        assert "<tool_call>" in text and text.count(truth) == 2
        assert default_compute_score("calculator", text, truth) == 1.0
    # response length counts only the model's tokens
    metrics = data_metrics(Batch.from_dict({**out, "token_level_scores": np.zeros(out["responses"].shape)}), False)
    assert metrics["response_length/mean"] == np.mean([len(turn1[r // 2]) + len(turn2[r // 2]) for r in range(4)])
    assert metrics["agent/num_turns/mean"] == 2 and metrics["agent/tool_calls/mean"] == 1
    assert metrics["agent/tool_errors"] == 0


def test_malformed_and_unknown_calls_answer_with_errors_and_count():
    replies = {0: '<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>',
               1: '<tool_call>{"name": "weather", "arguments": {}}</tool_call>', 2: "Answer: 3"}
    result = loop_with().run(ScriptedEngine(lambda text, k: replies[k]), request(["Compute 1 + 2."], budget=160))
    out = result.arrays
    assert out["num_turns"].tolist() == [3] and out["num_tool_calls"].tolist() == [2]
    assert out["num_tool_errors"].tolist() == [2]
    observed = TOK.decode(out["responses"][0][(out["attention_mask"][0, -160:] == 1) & (out["response_mask"][0] == 0)])
    assert "Error: tool call is not valid JSON" in observed
    assert "Error: unknown tool 'weather'; available: ['calculator']" in observed


def test_turn_limit_and_length_budget_end_a_row():
    engine = ScriptedEngine(lambda text, k: CALL % "2 ** 10")
    out = loop_with(max_assistant_turns=3).run(engine, request(["Compute 1 + 2."], budget=200)).arrays
    assert out["num_turns"].tolist() == [3] and out["num_tool_calls"].tolist() == [2]  # the last turn's call is not run
    assert len(engine.calls) == 3
    out = loop_with(max_assistant_turns=5, max_user_turns=1).run(engine, request(["Compute 1 + 2."], budget=200)).arrays
    assert out["num_turns"].tolist() == [2] and out["num_tool_calls"].tolist() == [1]  # verl: one tool round
    # a budget that ends inside the second turn: tokens stop exactly at the budget, the row's sampled part is cut
    call = len(TOK.encode(CALL % "2 ** 10")) + 1
    budget = 2 * call + 5
    engine = ScriptedEngine(lambda text, k: CALL % "2 ** 10")
    out = loop_with(max_assistant_turns=None).run(engine, request(["Compute 1 + 2."], budget=budget)).arrays
    assert int(out["attention_mask"][0, -budget:].sum()) == budget
    runs = spans(out["response_mask"][0])
    assert [v for _, _, v in runs] == [1, 0, 1] and runs[0][1] == call and runs[2][1] == budget
    assert out["num_turns"].tolist() == [2] and out["num_tool_calls"].tolist() == [1]


def test_python_tool_through_a_tool_config_file(tmp_path):
    config = tmp_path / "tools.yaml"
    config.write_text("tools:\n  - class_name: python\n    config: {type: native, cpu_time_s: 1, wall_timeout_s: 5}\n"
                      "    tool_schema:\n      type: function\n      function:\n        name: run_python\n"
                      "        description: run code\n        parameters: {type: object, properties: {}}\n")
    code = '<tool_call>{"name": "run_python", "arguments": {"code": "print(6 * 7)"}}</tool_call>'
    out = loop_with(tool_config_path=str(config)).run(
        ScriptedEngine(lambda text, k: code if k == 0 else "Answer: 42"), request(["Compute 6 * 7."])).arrays
    observed = TOK.decode(out["responses"][0][(out["attention_mask"][0, -96:] == 1) & (out["response_mask"][0] == 0)])
    assert "42" in observed and out["num_tool_errors"].tolist() == [0]


class FirstTurnScripted:
    """The real JAX engine, except that the first call's reply is a scripted tool call (so the real model
    continues after a real tool message)."""

    def __init__(self, engine):
        self.engine, self.first = engine, ScriptedEngine(lambda text, k: CALL % "1234 * 5678")
        self.engine_name, self.pad_token_id, self.eos_token_ids = "jax", engine.pad_token_id, engine.eos_token_ids
        self.calls = 0

    def generate(self, prompts, sampling):
        self.calls += 1
        return (self.first if self.calls == 1 else self.engine).generate(prompts, sampling)


def test_real_engine_continues_after_the_tool_message():
    config = tiny_config(vocab_size=TOK.vocab_size, eos_token_ids=(EOS,), max_position_embeddings=512)
    engine = JaxGenerationEngine(config, random_params(config, seed=3), pad_token_id=0, eos_token_ids=(EOS,),
                                 length_buckets=(64, 128, 256), batch_buckets=(4,))
    req = request(["Compute 1 + 2.", "Compute 30 * 4."], n=2, budget=64, seed=5)
    out = loop_with(max_assistant_turns=2).run(FirstTurnScripted(engine), req).arrays
    assert_model_continues_after_the_tool(out, engine.params, config, req.prompts.shape[1], atol=1e-4)


def assert_model_continues_after_the_tool(out, params, config, prompt_width, atol):
    """Every row: a scripted call, the calculator's answer (tool tokens), then a model turn whose sampler
    log-probs equal a teacher-forced pass over the assembled sequence."""
    assert out["num_tool_calls"].tolist() == [1] * 4 and out["num_turns"].tolist() == [2] * 4
    ids = out["input_ids"]
    targets = np.concatenate([ids[:, 1:], np.zeros((ids.shape[0], 1), ids.dtype)], 1)
    fn = jax.jit(token_log_probs_and_entropy, static_argnums=1)
    ref, _ = fn(params, config, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(out["attention_mask"]),
                jnp.asarray(out["position_ids"]), temperature=1.0)
    ref = np.asarray(ref)[:, prompt_width - 1:-1]
    for r in range(len(ids)):
        (_, end1, _), (_, end_obs, _), *rest = spans(out["response_mask"][r])
        assert "7006652" in TOK.decode(out["responses"][r, end1:end_obs])
        second = np.arange(end_obs, end_obs + int(out["response_mask"][r, end_obs:].sum()))
        assert second.size > 0
        np.testing.assert_allclose(out["rollout_log_probs"][r, second], ref[r, second], atol=atol)


@pytest.mark.parametrize("side, want", [("left", "0123...(truncated)"), ("right", "(truncated)...6789"),
                                        ("middle", "01...(truncated)...89")])
def test_tool_answers_are_truncated_like_verl(side, want):
    from jaxrl_hf.rollout.loops.multi_turn import truncate

    assert truncate("0123456789", 4, side) == want and truncate("0123", 4, side) == "0123"


def test_config_keys_and_errors(tmp_path):
    config = load_config("grpo", preset="smoke", overrides=[
        "actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"])
    assert config.rollout.loop == "multi_turn" and config.rollout.multi_turn.max_assistant_turns == 2
    assert load_config("grpo", preset="smoke").rollout.loop == "single_turn"
    with pytest.raises(ConfigError, match=r"rollout\.multi_turn\.tool_config_path.*no such file"):
        load_config("grpo", preset="smoke", overrides=["rollout.multi_turn.tool_config_path=/nonexistent.yaml"])
    with pytest.raises(ConfigError, match=r"tool_response_truncate_side"):
        load_config("grpo", preset="smoke", overrides=["rollout.multi_turn.tool_response_truncate_side=top"])
    with pytest.raises(ConfigError, match=r"rollout\.multi_turn\.max_user_turns"):
        load_config("grpo", preset="smoke", overrides=["actor_rollout_ref.rollout.multi_turn.max_user_turns=0"])
    with pytest.raises(ConfigError, match=r"rollout\.multi_turn\.max_assistant_turns"):
        load_config("grpo", preset="smoke", overrides=["rollout.multi_turn.max_assistant_turns=0"])
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n")
    with pytest.raises(ConfigError, match=r"multi_turn\.tool_config_path.*tools\[0\]: class_name 'verl\.tools"):
        load_config("grpo", preset="smoke", overrides=[f"rollout.multi_turn.tool_config_path={bad}"])
    with pytest.raises(ValueError, match=r"tool_config_path: .*tools\[0\]: class_name 'verl.tools.gsm8k_tool.Gsm8kTool'"):
        loop_with(tool_config_path=str(bad))
    with pytest.raises(RuntimeError, match="setup"):
        MultiTurnLoop().run(ScriptedEngine(lambda t, k: ""), request(["Compute 1 + 2."]))


def test_loss_advantages_and_entropy_ignore_tool_tokens():
    """What the trainer does with a multi-turn batch: GAE skips the tool tokens (equal to GAE over the model's
    tokens alone, numpy float64), GRPO leaves them 0, and the actor loss, its gradient and the entropy are the
    same whatever sits in the advantages / old log-probs at tool positions."""
    from jaxrl_hf.algos import compute_gae_advantage_return
    from jaxrl_hf.config.schema import ActorConfig, AlgorithmConfig
    from jaxrl_hf.trainer.advantage import compute_advantage
    from jaxrl_hf.workers.losses import actor_loss, actor_loss_config, lm_log_prob_fn, response_denominator

    replies = {0: CALL % "6 * 7", 1: "Answer: 42"}
    result = loop_with().run(ScriptedEngine(lambda text, k: replies[k]), request(["Compute 6 * 7."], n=2, budget=64))
    out = {k: np.asarray(v) for k, v in result.arrays.items()}
    mask = out["response_mask"].astype(np.float32)
    tool = (out["attention_mask"][:, -64:] == 1) & (mask == 0)
    assert tool.sum(1).min() > 0
    rng = np.random.default_rng(0)
    rewards = np.where(mask > 0, rng.normal(size=mask.shape), 0.0).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    _, returns = compute_gae_advantage_return(jnp.asarray(rewards), jnp.asarray(mask), values=jnp.asarray(values),
                                              gamma=0.9, lam=0.8)
    for r in range(2):  # reference: plain GAE over the model's tokens with the holes removed
        keep = mask[r] > 0
        rw, v = rewards[r][keep].astype(np.float64), values[r][keep].astype(np.float64)
        adv, last = np.zeros_like(rw), 0.0
        for t in reversed(range(len(rw))):
            delta = rw[t] + 0.9 * (v[t + 1] if t + 1 < len(rw) else 0.0) - v[t]
            last = adv[t] = delta + 0.9 * 0.8 * last
        np.testing.assert_allclose(np.asarray(returns)[r][keep], adv + v, atol=1e-5)
    grpo = compute_advantage(Batch.from_dict({"token_level_rewards": rewards, "response_mask": out["response_mask"],
                                              "uid": np.array([0, 0], object)}), AlgorithmConfig(adv_estimator="grpo"))
    assert (grpo["advantages"][tool] == 0).all()

    config = tiny_config(vocab_size=TOK.vocab_size, eos_token_ids=(EOS,), max_position_embeddings=512)
    params = random_params(config, seed=1)
    cfg = actor_loss_config(ActorConfig(entropy_coeff=0.01), temperature=1.0)
    micro = {k: jnp.asarray(out[k]) for k in ("input_ids", "attention_mask", "position_ids", "responses",
                                              "response_mask")}
    micro["old_log_probs"] = jnp.asarray(out["rollout_log_probs"])
    micro["advantages"] = jnp.asarray(np.where(mask > 0, rng.normal(size=mask.shape), 0.0), jnp.float32)
    garbage = dict(micro, advantages=jnp.where(jnp.asarray(tool), 100.0, micro["advantages"]),
                   old_log_probs=jnp.where(jnp.asarray(tool), -50.0, micro["old_log_probs"]))

    def loss(p, m):
        return actor_loss(p, m, response_denominator(cfg.loss_agg_mode)(m), log_prob_fn=lm_log_prob_fn(config), cfg=cfg)

    (clean, clean_metrics), clean_grad = jax.value_and_grad(loss, has_aux=True)(params, micro)
    (dirty, dirty_metrics), dirty_grad = jax.value_and_grad(loss, has_aux=True)(params, garbage)
    assert float(clean) == float(dirty) and float(clean_metrics["entropy"]) == float(dirty_metrics["entropy"])
    for a, b in zip(jax.tree.leaves(clean_grad), jax.tree.leaves(dirty_grad)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_lockstep_engines_get_every_row_and_turn_with_the_same_results():
    """An engine spanning several processes (``multi_process``) must be called equally often with the same
    shapes everywhere: every turn, all rows, the full budget; finished rows' outputs are dropped, so the
    result equals the single-process one."""
    def script(text, k):
        return CALL % "2 * 3" if "Compute 1" in text and k < 2 else "Answer: 6"

    req = request(["Compute 1 + 2.", "Compute 5 + 5."], n=2, budget=160)
    single = loop_with(max_assistant_turns=4).run(ScriptedEngine(script), req).arrays
    engine = ScriptedEngine(script)
    engine.multi_process = True
    lockstep = loop_with(max_assistant_turns=4).run(engine, req).arrays
    assert engine.calls == [(4, 160)] * 4
    for key in ("responses", "response_mask", "attention_mask", "rollout_log_probs", "num_turns", "num_tool_calls"):
        np.testing.assert_array_equal(lockstep[key], single[key], err_msg=key)
    assert single["num_turns"].tolist() == [3, 3, 1, 1]
    with pytest.raises(ValueError, match="needs rollout.multi_turn.max_assistant_turns"):
        loop_with(max_assistant_turns=None).run(engine, req)
