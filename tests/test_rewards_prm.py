"""Process reward models: step labels of the GSM8K construction, the boundary-token BCE against a float64 reference,
the loss falling on a tiny model, the launch script's smoke preset, the PRM reward manager's aggregation, and
``per_step`` placement (vs a reference on hand-made token sequences, in the manager, and in a REINFORCE++ run)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf.data.schema import DatasetRowError
from jaxrl_hf.models import value_forward
from jaxrl_hf.rewards.manager_registry import make_reward_manager
from jaxrl_hf.rewards.managers import NaiveRewardManager, response_decoder
from jaxrl_hf.rewards.prm_data import (check_annotation, corrupt_step, encode_step_rows, encode_steps, make_step_batch,
                                      read_step_rows, split_steps, step_end_offsets, step_labels)
from jaxrl_hf.rewards.prm_manager import aggregate_step_scores, load_process_reward_model
from jaxrl_hf.rewards.prm_placement import place_step_scores, step_end_tokens
from jaxrl_hf.rewards.prm_training import make_prm_train_step, prm_loss, step_bce
from jaxrl_hf.rewards.rm_training import RMOptimConfig, init_train_state, make_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_step_labels_follow_the_calculator_checks():
    steps = ["She has 48/2 = <<48/2=24>>24 clips.", "Total 48+24 = <<48+24=72>>72.", "#### 72"]
    assert step_labels(steps) == [1, 1, 1]
    assert step_labels([steps[0], "Total 48+24 = <<48+24=70>>70.", "#### 72"]) == [1, 0, 0]
    assert step_labels(["<<2*3=5>>5", steps[1]]) == [0, 0]  # an error poisons the later steps
    assert check_annotation("12/60", "0.2") and check_annotation("1,000*2", "2000")
    assert check_annotation("2*x", "4") is None and check_annotation("2**3", "9") is False
    import random
    bad = corrupt_step(steps[1], random.Random(0))
    assert bad != steps[1] and step_labels([bad]) == [0]
    visible = bad.split(">>")[1].split(".")[0]  # the visible copy after the annotation changed too
    assert visible != "72" and visible == bad.split("=")[2].split(">>")[0]
    assert split_steps("a\n\nb\n c \n") == ["a", "b", " c "]


def test_bad_rows_name_file_and_row(tmp_path):
    path = tmp_path / "steps.jsonl"
    good = {"prompt": "q", "steps": ["a", "b"], "labels": [1, 0]}
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "labels": [1]}) + "\n")
    with pytest.raises(DatasetRowError, match=r"steps.jsonl: row 2: 'labels'"):
        read_step_rows(path)
    path.write_text(json.dumps({**good, "steps": ["a\nb", "c"]}) + "\n")
    with pytest.raises(DatasetRowError, match="row 1: a step contains the step tag"):
        read_step_rows(path)


def test_step_bce_reads_only_boundary_tokens_float64():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (3, 7)).astype(np.float32)
    mask = (rng.random((3, 7)) < 0.4).astype(np.float32)
    labels = (rng.random((3, 7)) < 0.5).astype(np.float32) * mask
    x, y = logits.astype(np.float64), labels.astype(np.float64)
    p = 1 / (1 + np.exp(-x))
    ref = np.sum(-(y * np.log(p) + (1 - y) * np.log(1 - p)) * mask) / mask.sum()
    np.testing.assert_allclose(float(step_bce(jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(mask))), ref,
                               rtol=1e-5)
    changed = np.where(mask > 0, logits, logits + 50.0)  # scores off the boundaries do not matter
    np.testing.assert_allclose(float(step_bce(jnp.asarray(changed), jnp.asarray(labels), jnp.asarray(mask))), ref,
                               rtol=1e-5)


def test_aggregation_matches_hand_computed():
    scores = np.array([[0.9, 0.2, 0.7], [0.4, 0.8, 0.0], [0.3, 0.0, 0.0], [0.5, 0.5, 0.5]])
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    np.testing.assert_allclose(aggregate_step_scores(scores, mask, "min"), [0.2, 0.4, 0.3, 0.0])
    np.testing.assert_allclose(aggregate_step_scores(scores, mask, "last"), [0.7, 0.8, 0.3, 0.0])
    with pytest.raises(ValueError, match="reward_model.prm.aggregation='mean'"):
        aggregate_step_scores(scores, mask, "mean")


@pytest.fixture(scope="module")
def smoke_prm(tmp_path_factory):
    """``launch/train_prm.py --preset smoke`` (tiny random value model, GSM8K step rows), run once."""
    spec = importlib.util.spec_from_file_location("train_prm", os.path.join(REPO, "launch", "train_prm.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_prm"] = module
    spec.loader.exec_module(module)
    out = tmp_path_factory.mktemp("prm")
    try:
        meta = module.main(["--preset", "smoke", "--out", str(out), "--steps", "3", "--train-limit", "12"])
    except SystemExit as exc:  # the tiny model borrows SmolLM2's tokenizer
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")
    return out, meta


def test_smoke_preset_trains_and_prm_loss_falls(smoke_prm):
    out, meta = smoke_prm
    assert [h["step"] for h in meta["history"]] == [1, 2, 3] and np.isfinite(meta["after"]["loss"])
    prm = load_process_reward_model(str(out))
    from jaxrl_hf.data.gsm8k import default_gsm8k_dir
    from jaxrl_hf.rewards.prm_data import gsm8k_step_rows
    rows = gsm8k_step_rows(os.path.join(default_gsm8k_dir(), "test.jsonl"), seed=1, limit=6)
    encoded = encode_step_rows(rows, prm.model.tokenizer, 256)
    assert 0 < len(encoded) and 0 in sum(encoded.labels, []) and 1 in sum(encoded.labels, [])
    batch = {k: jnp.asarray(v) for k, v in make_step_batch(encoded, list(range(len(encoded))), len(encoded),
                                                            prm.model.pad_id).items()}
    config = prm.model.config
    optimizer = make_optimizer(RMOptimConfig(lr=1e-3, warmup_steps=0), prm.model.params)
    state = init_train_state(prm.model.params, optimizer)
    step = make_prm_train_step(config, optimizer, donate=False)
    first = float(prm_loss(state.params, config, batch)[0])
    for _ in range(8):
        state, _ = step(state, batch)
    last = float(prm_loss(state.params, config, batch)[0])
    assert last < 0.8 * first, (first, last)


def test_smoke_run_logs_metrics_to_jsonl_tensorboard_and_the_plot(smoke_prm):
    out, meta = smoke_prm
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert {"train/loss", "train/step_accuracy", "train/prob_good_steps", "train/prob_bad_steps", "train/grad_norm",
            "train/lr"} <= set(records[0])
    assert [r["train/loss"] for r in records] == pytest.approx([h["loss"] for h in meta["history"]])
    assert records[0]["train/lr"] == pytest.approx(3e-4)  # the smoke preset's lr, no warm-up
    assert (out / "tensorboard").is_dir()
    plot = importlib.util.spec_from_file_location("_plot", os.path.join(REPO, "launch", "plot.py"))
    module = importlib.util.module_from_spec(plot)
    plot.loader.exec_module(module)
    assert module.main([str(out)]) == 0 and (out / "curves.png").stat().st_size > 10_000


def test_prm_manager_adds_aggregated_step_scores(smoke_prm):
    out, _ = smoke_prm
    prm = load_process_reward_model(str(out))
    prompt = "Tom has 3 apples and buys 4 more. How many?"
    responses = ["He buys 4 more.\n3+4 = 7 apples.\n#### 7", "3+4 = 8 apples.\n#### 8", "   "]
    # reference: each response alone, unpadded, probabilities read at the hand-split step boundaries
    expected = {}
    for how in ("min", "last"):
        values = []
        for text in responses:
            steps = [s for s in text.split("\n") if s.strip()]
            if not steps:
                values.append(0.0)
                continue
            ids, bounds = encode_steps(prm.model.tokenizer, prompt, steps)
            v = np.asarray(value_forward(prm.model.params, prm.model.config, jnp.asarray([ids], jnp.int32),
                                         jnp.ones((1, len(ids)), jnp.int32)))[0]
            p = 1 / (1 + np.exp(-v[bounds].astype(np.float64)))
            values.append(p.min() if how == "min" else p[-1])
        expected[how] = np.array(values)
    ids = np.full((3, 5), 7, np.int32)
    mask = np.array([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], np.int32)
    args = (ids, mask, ["openai/gsm8k"] * 3, ["7", "7", "7"])
    rule = NaiveRewardManager()(*args, responses=responses).token_level_scores
    for how in ("min", "last"):
        manager = make_reward_manager("prm", prm=prm, aggregation=how, prm_weight=0.5)
        out_ = manager(*args, extra_infos=[{"question": prompt}] * 3, responses=responses)
        np.testing.assert_allclose(out_.extras["prm_score"], expected[how], atol=1e-5)
        want = rule.copy()
        want[[0, 1, 2], [3, 2, 0]] += 0.5 * expected[how]
        np.testing.assert_allclose(out_.token_level_scores, want, atol=1e-5)
    # the trainer's route: the policy's chat-templated prompt tokens (same tokenizer) instead of the text
    templated = prm.model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                        add_generation_prompt=True, tokenize=True)
    by_ids = make_reward_manager("prm", prm=prm, aggregation="min")(*args, responses=responses,
                                                                      prompt_ids=[templated] * 3)
    np.testing.assert_allclose(by_ids.extras["prm_score"], expected["min"], atol=1e-5)
    with pytest.raises(ValueError, match="no prompt"):
        make_reward_manager("prm", prm=prm)(*args, responses=responses)


def test_prm_config_keys(smoke_prm):
    from jaxrl_hf.config.build import ConfigError
    from jaxrl_hf.config.loader import load_config
    with pytest.raises(ConfigError, match="reward_model.prm.path"):
        load_config("grpo", overrides=["reward_model.reward_manager=prm"])
    cfg = load_config("grpo", overrides=["reward_model.reward_manager=prm", f"reward_model.prm.path={smoke_prm[0]}",
                                         "reward_model.prm.aggregation=last"])
    assert (cfg.reward_model.prm.aggregation, cfg.reward_model.prm.weight) == ("last", 1.0)
    with pytest.raises(ConfigError, match="aggregation"):
        load_config("grpo", overrides=["reward_model.prm.aggregation=mean"])


# ------------------------------------------------------------------------------------------ per_step placement
def _reference_positions(tokenizer, ids, text, tag):
    """Reference placement, by other means than `step_end_offsets`/`step_end_tokens`: step ends found by scanning
    the text for the tag, each end's token by a linear scan for the first decoded prefix holding the text up to it."""
    decode = response_decoder(tokenizer)
    ends, start = [], 0
    while start <= len(text):
        cut = text.find(tag, start)
        stop = len(text) if cut < 0 else cut
        if text[start:stop].strip():
            ends.append(stop if cut < 0 else stop + len(tag))
        start = stop + len(tag)
    out = []
    for c in ends:
        hits = [j for j in range(len(ids)) if decode(ids[:j + 1]).startswith(text[:c])]
        out.append(hits[0] if hits else len(ids) - 1)
    return out


@pytest.fixture(scope="module")
def policy_tokenizer():
    from jaxrl_hf.trainer.data import load_tokenizer
    try:
        return load_tokenizer("tiny-random")  # SmolLM2's, shared by the smoke PRM
    except (OSError, SystemExit) as exc:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")


def test_per_step_placement_matches_a_float64_reference(policy_tokenizer):
    tok = policy_tokenizer
    decode = response_decoder(tok)
    byte = {b: tok._tok.token_to_id(ch) for b, ch in ((0xC3, "Ã"), (0xA9, "©"))}  # byte-level pieces of 'é'
    nn = tok._tok.token_to_id("ĊĊ")  # one token '\n\n' (a sampled response may hold it before any text)
    a, b3, ans = tok.encode("a."), tok.encode("b = 3.\n"), tok.encode("#### 3")
    no_tag, trunc = tok.encode("The answer is 7"), tok.encode("Step one.\nStep tw")
    with_eos = tok.encode("x = 2.\n#### 2")
    cases = {  # name: (ids, step tag, hand-checked token index of each step's end)
        # step 1 'a.' ends inside the '\n\n' token (its first '\n' is the tag), step 3 has no tag after it
        "mid_token": (a + [nn] + b3 + ans, "\n", [len(a), len(a) + len(b3), len(a) + len(b3) + len(ans)]),
        "two_on_one": (tok.encode("banana"), "a", [0, 1, 1]),  # 'ban'|'ana': steps 'b','n','n'; two end on 'ana'
        "no_tag": (no_tag, "\n", [len(no_tag) - 1]),
        "blank": (tok.encode("  \n \n"), "\n", []),
        "truncated": (trunc, "\n", [trunc.index(198), len(trunc) - 1]),
        "eos": (with_eos + [tok.eos_token_id], "\n", [with_eos.index(198), len(with_eos) - 1]),  # not on EOS
        # step 'x' ends after the tag 'é', whose two bytes are two tokens: on the second, not the half character
        "split_char": (tok.encode("x") + [byte[0xC3], byte[0xA9]] + tok.encode("y"), "é", [2, 3]),
    }
    assert tok.decode([nn]) == "\n\n" and tok.decode([198]) == "\n" and tok.decode(tok.encode("banana")[1:]) == "ana"
    width = 2 + max(len(ids) for ids, _, _ in cases.values())
    rng = np.random.default_rng(0)
    for name, (ids, tag, hand) in cases.items():
        text = decode(ids)
        ends = step_end_offsets(text, tag)
        assert len(ends) == len(split_steps(text, tag)), name
        got = step_end_tokens(decode, ids, ends)
        ref = _reference_positions(tok, ids, text, tag)
        assert got == ref == hand, (name, got, ref, hand)
        # placement into a left-offset row of a batch, float64 reference: one += per step
        shift = 1
        p = rng.random(len(ends))
        step_mask = np.ones((1, len(ends)), np.int32)
        placed = place_step_scores(p[None], step_mask, [[shift + j for j in got]], width, weight=0.5)
        want = np.zeros(width, np.float64)
        for k, j in enumerate(ref):
            want[shift + j] += 0.5 * p[k]
        np.testing.assert_array_equal(placed[0], want)
        np.testing.assert_allclose(placed.sum(), 0.5 * p.sum(), rtol=1e-12)
    np.testing.assert_allclose(aggregate_step_scores(np.array([[0.2, 0.3, 9.0]]), np.array([[1, 1, 0]]), "per_step"),
                               [0.5])


def test_step_end_tokens_when_a_window_decodes_differently_from_the_prefix():
    """A SentencePiece-style decoder drops the leading space of what it decodes, so decoding the tokens after the
    previous step alone undercounts by one character: the full-prefix check catches the guess, bisection fixes it."""
    pieces = ["A", " b", ".", "\n", " c", "d", "\n", " e", " f"]
    def decode(ids):
        return "".join(pieces[i] for i in ids).lstrip(" ")

    ids = list(range(len(pieces)))
    text = decode(ids)
    assert text == "A b.\n cd\n e f"
    ends = step_end_offsets(text)  # 'A b.\n' -> 5, ' cd\n' -> 9, ' e f' -> 13
    assert ends == [5, 9, 13]
    assert step_end_tokens(decode, ids, ends) == [3, 6, 8]
    # the second window starts at ' c' (the first offset's token) and decodes as 'cd': its guess, '\n', is one late
    assert step_end_tokens(decode, ids, [6, 8]) == [4, 5]


def test_prm_manager_per_step_puts_each_step_on_its_token(smoke_prm):
    prm = load_process_reward_model(str(smoke_prm[0]))
    tok = prm.model.tokenizer
    prompt = "Tom has 3 apples and buys 4 more. How many?"
    texts = ["He buys 4 more.\n3+4 = 7 apples.\n\n#### 7", "3+4 = 8 apples", "", " \n"]
    rows = [tok.encode(t) for t in texts]
    rows[0] = rows[0] + [tok.eos_token_id]
    width = max(len(r) for r in rows) + 2
    ids = np.full((len(rows), width), tok.pad_token_id or 0, np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = r, 1
    args = (ids, mask, ["openai/gsm8k"] * len(rows), ["7"] * len(rows))
    infos = [{"question": prompt}] * len(rows)
    rule = NaiveRewardManager(tokenizer=tok)(*args).token_level_scores.astype(np.float64)
    out = make_reward_manager("prm", prm=prm, aggregation="per_step", prm_weight=0.5)(*args, extra_infos=infos)
    want, sums = rule.copy(), []
    for i, r in enumerate(rows):  # reference: each response alone, unpadded, float64 sigmoid at the boundaries
        text = response_decoder(tok)(r)
        steps = split_steps(text)
        if not steps:
            sums.append(0.0)
            continue
        seq, bounds = encode_steps(tok, prompt, steps)
        v = np.asarray(value_forward(prm.model.params, prm.model.config, jnp.asarray([seq], jnp.int32),
                                     jnp.ones((1, len(seq)), jnp.int32)))[0]
        p = 1 / (1 + np.exp(-v[bounds].astype(np.float64)))
        for k, j in enumerate(_reference_positions(tok, r, text, "\n")):
            want[i, j] += 0.5 * p[k]
        sums.append(p.sum())
    np.testing.assert_allclose(out.token_level_scores, want, atol=1e-5)
    np.testing.assert_allclose(out.token_level_scores.sum(1), rule.sum(1) + 0.5 * np.array(sums), atol=1e-5)
    np.testing.assert_allclose(out.extras["prm_score"], sums, atol=1e-5)
    assert out.extras["prm_steps"] == [3, 1, 0, 0]
    assert len(np.flatnonzero(out.token_level_scores[0] != rule[0])) == 3  # one column per step, EOS untouched
    assert out.metrics["reward/prm_score_mean"] == pytest.approx(np.mean(sums), abs=1e-5)
    with pytest.raises(ValueError, match="per_step.*response 0's scored text"):  # e.g. a multi-turn trajectory
        make_reward_manager("prm", prm=prm, aggregation="per_step")(
            *args, extra_infos=infos, responses=[t + " <tool_response>" for t in texts])


def test_per_step_config_is_refused_with_multi_turn(smoke_prm):
    import typing

    from jaxrl_hf.config.build import ConfigError
    from jaxrl_hf.config.loader import load_config
    from jaxrl_hf.config.schema_rewards import PRMConfig
    from jaxrl_hf.rewards.prm_manager import PRM_AGGREGATIONS
    assert typing.get_args(typing.get_type_hints(PRMConfig)["aggregation"]) == PRM_AGGREGATIONS
    prm = ["reward_model.reward_manager=prm", f"reward_model.prm.path={smoke_prm[0]}",
           "reward_model.prm.aggregation=per_step"]
    assert load_config("reinforce_pp", overrides=prm).reward_model.prm.aggregation == "per_step"
    with pytest.raises(ConfigError, match=r"reward_model.prm.aggregation'='per_step'.*multi_turn"):
        load_config("reinforce_pp", overrides=[*prm, "rollout.multi_turn.enable=true", "data.train_files=[calculator]"])


@pytest.mark.usefixtures("trainer_session")
def test_reinforce_pp_smoke_run_with_per_step_prm_rewards(smoke_prm, tmp_path):
    """``launch/train.py --algo reinforce_pp --preset smoke`` for one step with per-step PRM rewards (the smoke
    policy and PRM share SmolLM2's tokenizer): REINFORCE++'s token-level returns see each step's score."""
    from jaxrl_hf.trainer import run
    run_dir = tmp_path / "run"
    overrides = [f"trainer.run_dir={run_dir}", "trainer.total_steps=1", "trainer.val_before_train=false",
                 "reward_model.reward_manager=prm", f"reward_model.prm.path={smoke_prm[0]}",
                 "reward_model.prm.aggregation=per_step", "reward_model.prm.weight=0.5"]
    assert run("reinforce_pp", preset="smoke", overrides=overrides) == 0
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1]
    assert 0 < records[0]["reward/prm_score_mean"] and records[0]["reward/prm_steps_mean"] >= 1
    assert np.isfinite(records[0]["actor/pg_loss"]) and np.isfinite(records[0]["critic/advantages/max"])
