"""Rollout / validation dumps (``trainer.rollout_data_dir``, ``validation_data_dir``, ``log_val_generations``):
the records decode the real tokenizer's ids back to the texts, and the advantage is the loss-token mean."""

from __future__ import annotations

import io
import json

import numpy as np

from jaxrl_hf.controller import Batch
from jaxrl_hf.trainer.data import load_tokenizer
from jaxrl_hf.trainer.generations import dump_generations, generation_records, show_samples


def _batch(tokenizer) -> tuple[Batch, list[str], list[str]]:
    prompts, responses = ["What is 2+3?", "What is 7*6?"], [" 5", " The answer is 42"]
    p_ids = [tokenizer.encode(p) for p in prompts]
    r_ids = [tokenizer.encode(r) for r in responses]
    P, R = max(map(len, p_ids)), max(map(len, r_ids)) + 2
    pad = 0
    prompt = np.full((2, P), pad, np.int32)
    prompt_mask = np.zeros((2, P), np.int32)
    resp = np.full((2, R), pad, np.int32)
    resp_mask = np.zeros((2, R), np.int32)
    for i, (p, r) in enumerate(zip(p_ids, r_ids)):
        prompt[i, P - len(p):], prompt_mask[i, P - len(p):] = p, 1  # left-padded prompts
        resp[i, :len(r)], resp_mask[i, :len(r)] = r, 1
    adv = np.where(resp_mask > 0, np.array([[1.5], [-0.5]], np.float32), 7.0).astype(np.float32)  # 7 on padding
    return Batch.from_dict({"prompts": prompt, "prompt_mask": prompt_mask, "responses": resp,
                            "response_mask": resp_mask, "advantages": adv,
                            "score": np.array([1.0, 0.0], np.float32), "acc": np.array([1.0, 0.0], np.float32),
                            "seq_score": np.array([1.0, -0.25], np.float32), "uid": np.array([3, 4]),
                            "ground_truth": np.array(["5", "42"], dtype=object),
                            "data_source": np.array(["arithmetic", "arithmetic"], dtype=object)}), prompts, responses


def test_records_decode_the_texts_and_average_the_advantage_over_loss_tokens(tmp_path):
    tokenizer = load_tokenizer("tiny-random")  # SmolLM2's real tokenizer
    batch, prompts, responses = _batch(tokenizer)
    records = generation_records(batch, tokenizer, step=7)
    assert [r["input"] for r in records] == prompts
    assert [r["output"] for r in records] == responses
    assert [r["advantage"] for r in records] == [1.5, -0.5]  # padding's 7.0 left out
    assert [r["gts"] for r in records] == ["5", "42"] and [r["reward"] for r in records] == [1.0, -0.25]
    assert records[1]["response_length"] == len(tokenizer.encode(responses[1])) and records[0]["step"] == 7
    path = dump_generations(str(tmp_path / "rollouts"), 7, records)
    assert path.endswith("7.jsonl")
    assert [json.loads(line) for line in open(path)] == records
    stream = io.StringIO()
    shown = show_samples(records, 1, 7, stream=stream)
    assert shown == records[:1] and "[response]  5" in stream.getvalue() and "[ground_truth] 5" in stream.getvalue()
