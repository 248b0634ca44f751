"""Datasets in verl's schema: validation errors, parquet/jsonl round trips, generators, prepare_data."""

from __future__ import annotations

import ast
import json
import operator
import os
import subprocess
import sys

import pytest

from jaxrl_hf.data import DatasetRowError, generate_arithmetic, make_row, read_rows, validate_row, write_rows
from jaxrl_hf.data import gsm8k as gsm8k_data
from jaxrl_hf.data.arithmetic import ArithmeticConfig
from jaxrl_hf.rewards import compute_score
from jaxrl_hf.data.gsm8k import default_gsm8k_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_DIR = default_gsm8k_dir()


def _eval_expression(text: str) -> int:
    """Independent integer evaluation of a generated expression (AST walk; no eval)."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def walk(node):
        if isinstance(node, ast.BinOp):
            return ops[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.Constant):
            return node.value
        raise AssertionError(f"unexpected node {node!r}")

    value = walk(ast.parse(text, mode="eval").body)
    assert value == int(value), text
    return int(value)


def test_arithmetic_generator_is_seeded_and_correct():
    cfg = ArithmeticConfig(min_digits=1, max_digits=3, operators=("+", "-", "*", "/"), num_operands=3)
    rows = generate_arithmetic(300, seed=7, config=cfg)
    assert rows == generate_arithmetic(300, seed=7, config=cfg)
    assert rows != generate_arithmetic(300, seed=8, config=cfg)
    assert generate_arithmetic(5, 7, cfg, split="test") != rows[:5]
    used = set()
    for row in rows:
        validate_row(row)
        expression = row["extra_info"]["expression"]
        used.update(op for op in "+-*/" if f" {op} " in expression)
        assert _eval_expression(expression) == int(row["reward_model"]["ground_truth"])
        assert expression in row["prompt"][0]["content"]
        operands = [int(tok) for tok in expression.replace("(", " ").replace(")", " ").split() if tok.isdigit()]
        assert all(len(str(x)) <= 3 for x in operands)
    assert used == {"+", "-", "*", "/"}


def test_arithmetic_config_errors():
    with pytest.raises(ValueError, match="operators \\['\\^'\\] invalid; choose from"):
        ArithmeticConfig(operators=("^",))
    with pytest.raises(ValueError, match="min_digits <= max_digits"):
        ArithmeticConfig(min_digits=3, max_digits=2)


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_round_trip(tmp_path, ext):
    rows = generate_arithmetic(50, seed=1) + [
        make_row("openai/gsm8k", "Q? Let's think", "18", extra_info={"split": "x", "index": 9, "expression": "é ∑"},
                 system_prompt="be brief")
    ]
    path = write_rows(rows, str(tmp_path / f"d.{ext}"))
    back = read_rows(path)
    assert back == rows


def test_validation_names_file_and_row(tmp_path):
    good = generate_arithmetic(3, seed=0)
    bad = json.loads(json.dumps(good))
    bad[1]["prompt"] = "a bare string"
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(DatasetRowError, match=f"{path}: row 2: prompt must be a list of chat messages"):
        read_rows(str(path))
    path.write_text(json.dumps(good[0]) + "\n{not json\n")
    with pytest.raises(DatasetRowError, match="bad.jsonl: line 2: invalid JSON"):
        read_rows(str(path))
    cases = [
        ({"prompt": [], "data_source": "a", "reward_model": {"ground_truth": "1"}}, "prompt has no messages"),
        ({"prompt": [{"role": "robot", "content": "x"}], "data_source": "a", "reward_model": {"ground_truth": "1"}},
         "role 'robot' is not one of"),
        ({"prompt": [{"role": "user", "content": "x"}], "data_source": "a", "reward_model": {"ground_truth": " "}},
         "ground_truth must be a non-empty string"),
        ({"prompt": [{"role": "user", "content": "x"}], "reward_model": {"ground_truth": "1"}}, "missing keys \\['data_source'\\]"),
        ({"prompt": [{"role": "user", "content": "x"}], "data_source": "a", "reward_model": {"ground_truth": "1"},
          "extra_info": [1]}, "extra_info must be an object"),
    ]
    for row, message in cases:
        with pytest.raises(DatasetRowError, match=message):
            validate_row(row, source="f.parquet", index=4)
    rows = [dict(good[0]), {"data_source": "a"}]
    with pytest.raises(DatasetRowError, match="rows to write to .*: row 1: missing keys"):
        write_rows(rows, str(tmp_path / "out.parquet"))
    assert not (tmp_path / "out.parquet").exists()
    with pytest.raises(ValueError, match="unsupported dataset extension '.csv'"):
        write_rows(good, str(tmp_path / "x.csv"))


def test_gsm8k_rows_and_bad_source_rows(tmp_path):
    rows = gsm8k_data.to_rows(os.path.join(GSM8K_DIR, "test.jsonl"), "test")
    assert len(rows) == 1319
    assert rows[2]["reward_model"]["ground_truth"] == "70000"  # "#### 70,000"-style commas removed
    for row in rows[:50]:
        validate_row(row)
        # the reference solution itself earns full reward from the strict scorer
        assert compute_score("openai/gsm8k", row["extra_info"]["answer"], row["reward_model"]["ground_truth"]) == 1.0
        assert row["prompt"][0]["content"].endswith('output the final answer after "####".')
    src = tmp_path / "broken.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "x\n#### 5"}) + "\n"
                   + json.dumps({"question": "q2", "answer": "no final answer"}) + "\n")
    with pytest.raises(DatasetRowError, match="broken.jsonl: line 2: answer does not end with '#### <number>'"):
        gsm8k_data.to_rows(str(src), "train")


def test_gsm8k_preference_pairs_are_correct_vs_wrong():
    pairs = gsm8k_data.preference_pairs(os.path.join(GSM8K_DIR, "test.jsonl"), seed=0, limit=200)
    assert len(pairs) == 200
    for pair in pairs:
        truth = pair["ground_truth"]
        assert compute_score("openai/gsm8k", pair["chosen"], truth) == 1.0
        assert compute_score("openai/gsm8k", pair["rejected"], truth) == 0.0
        assert compute_score("openai/gsm8k", pair["rejected"], pair["rejected_answer"]) == 1.0
        assert "<<" not in pair["chosen"]
        # the rejected solution differs only in its final result
        assert pair["chosen"].rsplit("\n", 2)[0] == pair["rejected"].rsplit("\n", 2)[0]


def test_prepare_data_cli(tmp_path):
    script = os.path.join(REPO, "launch", "prepare_data.py")
    run = lambda *args: subprocess.run([sys.executable, script, *args], capture_output=True, text=True, cwd=tmp_path)
    result = run("arithmetic", "--n-train", "40", "--n-test", "8", "--operators", "+*", "--max-digits", "3",
                 "--out-dir", "arith", "--format", "jsonl")
    assert result.returncode == 0, result.stderr
    train = read_rows(str(tmp_path / "arith" / "train.jsonl"))
    assert len(train) == 40 and len(read_rows(str(tmp_path / "arith" / "test.jsonl"))) == 8
    assert train == generate_arithmetic(40, 0, ArithmeticConfig(max_digits=3, operators=("+", "*")))
    result = run("gsm8k", "--out-dir", "g")
    assert result.returncode == 0, result.stderr
    assert len(read_rows(str(tmp_path / "g" / "train.parquet"))) == 7473
    result = run("arithmetic", "--operators", "+^", "--out-dir", "bad")
    assert result.returncode != 0 and "choose from" in result.stderr
    result = run("gsm8k", "--input-dir", str(tmp_path / "missing"))
    assert result.returncode != 0 and "GSM8K train file not found" in result.stderr
