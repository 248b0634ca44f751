"""verl-format data end to end where right answers happen: arithmetic problems written as GSM8K rows in verl's
parquet schema (``launch/prepare_data.py arithmetic_gsm8k``: ``data_source='openai/gsm8k'``, verl's ``####``
instruction) validated by the real SmolLM2-135M-Instruct through the trainer. Held-out accuracy is above 0, and
every dumped sample's score equals verl 0.9.1's own ``default_compute_score`` on the same text (the strict GSM8K
rule), so a right answer is scored right on the way through."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("trainer_session")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gsm8k_schema_rows_the_model_can_solve_score_above_zero(tmp_path):
    pytest.importorskip("verl", reason="verl 0.9.1 (scripts/setup.sh installs it) is the reference scorer")
    import pyarrow.parquet as pq
    from verl.utils.reward_score import default_compute_score

    from jaxrl_hf.trainer import run

    sys.path.insert(0, os.path.join(REPO, "launch"))
    from prepare_data import main as prepare_data

    train_file, test_file = prepare_data(["arithmetic_gsm8k", "--out-dir", str(tmp_path / "data"), "--n-train", "8",
                                          "--n-test", "16"])
    rows = pq.read_table(test_file).to_pylist()
    assert {r["data_source"] for r in rows} == {"openai/gsm8k"} and rows[0]["reward_model"]["style"] == "rule"
    assert run("grpo", preset="smoke", overrides=[
        "model.path=smollm2-135m-instruct", f"data.train_files=[{train_file}]", f"data.val_files=[{test_file}]",
        "data.val_size=16", "data.max_prompt_length=128", "data.val_max_prompt_length=128", "trainer.val_only=true",
        "rollout.val.greedy=true", "rollout.val.n=1", "rollout.val.response_length=24",
        f"trainer.validation_data_dir={tmp_path / 'val'}", f"trainer.run_dir={tmp_path / 'run'}"]) == 0
    (record,) = [json.loads(x) for x in (tmp_path / "run" / "validation.jsonl").read_text().splitlines()]
    accuracy = record["val-core/openai/gsm8k/acc/mean@1"]
    assert accuracy > 0, record
    samples = [json.loads(x) for x in (tmp_path / "val" / "0.jsonl").read_text().splitlines()]
    assert len(samples) == 16
    for sample in samples:
        assert sample["score"] == default_compute_score("openai/gsm8k", sample["output"], sample["gts"]), sample
    assert sum(s["score"] for s in samples) / 16 == pytest.approx(accuracy)
