"""``--preset smoke`` with the agent loop on the built-in ``calculator`` dataset, in-process with real Ray
workers: synchronous, and asynchronous (``trainer.max_staleness=1``, the rollout group runs the same loop)."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("trainer_session")]
AGENT = ["data.train_files=[calculator]", "data.max_prompt_length=320", "data.val_files=[calculator]",
         "data.val_max_prompt_length=320", "actor_rollout_ref.rollout.multi_turn.enable=true",
         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "trainer.save_freq=0"]


def train(run_dir, *overrides: str) -> list[dict]:
    from jaxrl_hf.trainer import run

    assert run("grpo", preset="smoke", overrides=[f"trainer.run_dir={run_dir}", *AGENT, *overrides]) == 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def check_agent_records(records: list[dict]) -> None:
    updates = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in updates] == [1, 2]
    for r in updates:
        assert 1.0 <= r["agent/num_turns/mean"] <= 2.0 and r["agent/num_turns/max"] <= 2
        assert r["agent/tool_calls/mean"] >= 0.0 and r["agent/tool_errors"] >= 0.0
        assert 0 < r["response_length/mean"] <= 16


def test_smoke_multi_turn_on_the_calculator_dataset(tmp_path):
    records = train(tmp_path)
    check_agent_records(records)
    with open(os.path.join(tmp_path, "config.yaml")) as fh:
        saved = fh.read()
    assert "loop: multi_turn" in saved and "enable: true" in saved


def test_smoke_multi_turn_with_max_staleness_one(tmp_path):
    records = train(tmp_path, "trainer.max_staleness=1")
    check_agent_records(records)
    assert [r["async/staleness/mean"] for r in records if "actor/pg_loss" in r] == [0.0, 1.0]
