"""Process reward models: step labels of the GSM8K construction, the boundary-token BCE against a float64 reference,
the loss falling on a tiny model, the launch script's smoke preset, and the PRM reward manager's aggregation."""

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
from jaxrl_hf.rewards.managers import NaiveRewardManager, make_reward_manager
from jaxrl_hf.rewards.prm_data import (check_annotation, corrupt_step, encode_step_rows, encode_steps, make_step_batch,
                                      read_step_rows, split_steps, step_labels)
from jaxrl_hf.rewards.prm_manager import aggregate_step_scores, load_process_reward_model
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
