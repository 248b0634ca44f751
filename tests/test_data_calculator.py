"""The built-in ``calculator`` dataset: 4–6 digit products and sums with exact answers, a strict scorer that
reads only an explicit ``Answer:``, and the tool schema in the system prompt only when the agent loop runs."""

from __future__ import annotations

import json

from jaxrl_hf.config import load_config
from jaxrl_hf.data import generate_calculator, validate_row
from jaxrl_hf.data.calculator import MIN_PROMPT_TOKENS, ONE_SHOT_EXAMPLE, PLAIN_INSTRUCTIONS
from jaxrl_hf.rewards import default_compute_score
from jaxrl_hf.trainer.data import load_split, load_tokenizer


def test_rows_are_valid_reproducible_and_exact():
    rows = generate_calculator(50, seed=3)
    assert rows == generate_calculator(50, seed=3) and rows != generate_calculator(50, seed=4)
    for i, row in enumerate(rows):
        validate_row(row, index=i)
        assert row["data_source"] == "calculator" and row["prompt"][0] == {"role": "system", "content": PLAIN_INSTRUCTIONS}
        expression = row["extra_info"]["expression"]
        a, op, b = expression.split()
        assert op in "+*" and all(4 <= len(x) <= 6 for x in (a, b))
        assert int(row["reward_model"]["ground_truth"]) == (int(a) * int(b) if op == "*" else int(a) + int(b))
        assert row["prompt"][1]["content"] == f"Compute {expression}."
    assert {r["extra_info"]["expression"].split()[1] for r in rows} == {"+", "*"}


def test_strict_scoring_reads_only_an_explicit_answer():
    truth = str(48213 * 9271)
    tool_answer = f'<tool_call>{{"name": "calculator"}}</tool_call>\ntool\n{truth}\nassistant\n'
    assert default_compute_score("calculator", tool_answer + f"Answer: {truth}", truth) == 1.0
    assert default_compute_score("calculator", tool_answer, truth) == 0.0  # the tool's number is not an answer
    assert default_compute_score("calculator", tool_answer + "Answer: 12", truth) == 0.0
    assert default_compute_score("arithmetic", tool_answer, truth) == 1.0  # the lenient scorer would take it


def test_trainer_prompts_carry_the_tool_schema_only_with_the_agent_loop():
    base = ["data.train_files=[calculator]", "data.val_files=[calculator]", f"data.max_prompt_length={MIN_PROMPT_TOKENS}",
            f"data.val_max_prompt_length={MIN_PROMPT_TOKENS}", "data.train_size=16"]
    tokenizer = load_tokenizer("tiny-random")
    agent = load_config("grpo", preset="smoke", overrides=[*base, "rollout.multi_turn.enable=true"])
    plain = load_config("grpo", preset="smoke", overrides=base)
    agent_rows = load_split(agent, "train", tokenizer)["calculator"]
    plain_rows = load_split(plain, "train", tokenizer)["calculator"]
    assert len(agent_rows) == len(plain_rows) == 16  # every prompt fits MIN_PROMPT_TOKENS
    system = agent_rows[0]["prompt"][0]["content"]
    assert "<tools>" in system and '"name": "calculator"' in system and "<tool_call>" in system
    assert json.loads(system.split("<tools>\n")[1].split("\n</tools>")[0])["function"]["name"] == "calculator"
    assert plain_rows[0]["prompt"][0]["content"] == PLAIN_INSTRUCTIONS
    assert [r["prompt"][1:] for r in agent_rows] == [r["prompt"][1:] for r in plain_rows]  # the same problems
    # data.calculator_one_shot: a worked exchange between the system prompt and the problem, agent loop only
    shot = ["data.calculator_one_shot=true", "data.max_prompt_length=448"]
    one_shot = load_split(load_config("grpo", preset="smoke", overrides=[*base, *shot, "rollout.multi_turn.enable=true"]),
                          "train", tokenizer)["calculator"]
    assert [r["prompt"][0] for r in one_shot] == [r["prompt"][0] for r in agent_rows]
    assert [r["prompt"][1:5] for r in one_shot] == [list(ONE_SHOT_EXAMPLE)] * 16
    assert [r["prompt"][5:] for r in one_shot] == [r["prompt"][1:] for r in agent_rows]
    unchanged = load_split(load_config("grpo", preset="smoke", overrides=[*base, *shot]), "train", tokenizer)
    assert unchanged["calculator"] == plain_rows
