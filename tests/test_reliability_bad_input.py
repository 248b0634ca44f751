"""Bad input ends a run with one clear line naming the key, file or row, and the exit code of its class (config 2,
data 4), never a traceback on the screen: 23 configs, data files and model paths through ``run``, and a user
scorer that raises (in process and on the scoring pool). None of these starts a worker: they fail first."""

from __future__ import annotations

import json
import re

import pytest

from jaxrl_hf.errors import ExitCode, ScorerError
from jaxrl_hf.rewards import NaiveRewardManager, ScoreFnSpec
from jaxrl_hf.trainer import run

GOOD = {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}


def _jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


# name: (overrides with {tmp} for the test's directory, files to write {name: text}, exit code, message regex)
CASES = {
    "unknown key, with the valid ones": (["actor.clip_ratio_hihg=0.3"], {}, ExitCode.CONFIG,
                                         r"unknown config key 'actor.clip_ratio_hihg': did you mean 'actor.clip_ratio_high'\?"),
    "wrong type": (["actor.optim.lr=abc"], {}, ExitCode.CONFIG, r"'actor.optim.lr': expected a number, got 'abc'"),
    "unregistered name": (["algorithm.adv_estimator=nope"], {}, ExitCode.CONFIG,
                          r"'algorithm.adv_estimator'='nope': not a registered advantage estimator; valid names"),
    "inconsistent batch sizes": (["data.train_batch_size=3"], {}, ExitCode.CONFIG,
                                 r"'actor.ppo_mini_batch_size'=2: data.train_batch_size=3 .* multiple"),
    "zero samples": (["rollout.n=0"], {}, ExitCode.CONFIG, r"'rollout.n'=0: must be > 0"),
    "missing scorer file": (["custom_reward_function.path={tmp}/nope.py"], {}, ExitCode.CONFIG,
                            r"'custom_reward_function.path'=.*nope.py': no such file"),
    "missing model path": (["model.path={tmp}/no_model"], {}, ExitCode.CONFIG,
                           r"'model.path'=.*no_model': not 'smollm2-135m-instruct', 'tiny-random', an HF directory"),
    "model dir without config.json": (["model.path={tmp}/empty_model"], {"empty_model/README": "x"}, ExitCode.CONFIG,
                                      r"'model.path'=.*empty_model': an HF model directory needs a config.json"),
    "unsupported architecture": (["model.path={tmp}/gpt2"], {"gpt2/config.json": '{"model_type": "gpt2"}'},
                                 ExitCode.CONFIG, r"config.json: model_type 'gpt2' is not a supported architecture"),
    "config.json not JSON": (["model.path={tmp}/broken"], {"broken/config.json": "{oops"}, ExitCode.CONFIG,
                             r"broken/config.json is not a JSON object"),
    "model dir without tokenizer": (["model.path={tmp}/notok"], {"notok/config.json": '{"model_type": "llama"}'},
                                    ExitCode.CONFIG, r"no tokenizer.json in the model directory"),
    "vLLM and a Qwen3 window on some layers": (["model.path={tmp}/qwen3w", "rollout.name=vllm"], {
        "qwen3w/config.json": json.dumps({"model_type": "qwen3", "vocab_size": 96, "hidden_size": 64,
                                          "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                          "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
        "qwen3w/tokenizer.json": "{}"}, ExitCode.CONFIG,
        r"'model.path'=.*qwen3w': config key 'rollout.name'='vllm' cannot serve this model: model_type 'qwen3' with "
        r"sliding_window=6 on layers \[1\] only"),
    "unknown logger": (["trainer.logger=[console,nope]"], {}, ExitCode.CONFIG, r"'trainer.logger'='nope': valid"),
    "torn list value": (["data.train_files=[a,"], {}, ExitCode.CONFIG,
                        r"'data.train_files'='\[a,': not a built-in dataset .* and no such file"),
    "missing data file": (["data.train_files=[{tmp}/none.parquet]"], {}, ExitCode.CONFIG,
                          r"'data.train_files'=.*none.parquet': not a built-in dataset"),
    "empty jsonl": (["data.train_files=[{tmp}/empty.jsonl]"], {"empty.jsonl": "\n"}, ExitCode.DATA,
                    r"empty.jsonl: the file has no rows"),
    "malformed line": (["data.train_files=[{tmp}/bad.jsonl]"], {"bad.jsonl": _jsonl(GOOD, GOOD, "{oops")},
                       ExitCode.DATA, r"bad.jsonl: line 3: invalid JSON"),
    "row without reward_model": (["data.train_files=[{tmp}/norm.jsonl]"],
                                 {"norm.jsonl": _jsonl(GOOD, {k: v for k, v in GOOD.items() if k != "reward_model"})},
                                 ExitCode.DATA, r"norm.jsonl: row 2: missing keys \['reward_model'\]"),
    "prompt as a string": (["data.train_files=[{tmp}/pstr.jsonl]"], {"pstr.jsonl": _jsonl({**GOOD, "prompt": "hi"})},
                           ExitCode.DATA, r"pstr.jsonl: row 1: prompt must be a list of chat messages"),
    "not a parquet file": (["data.train_files=[{tmp}/x.parquet]"], {"x.parquet": "not parquet"}, ExitCode.DATA,
                           r"x.parquet: not a readable parquet file"),
    "unknown extension": (["data.train_files=[{tmp}/x.csv]"], {"x.csv": "a,b\n"}, ExitCode.DATA,
                          r"x.csv: unsupported dataset extension '.csv'; use one of"),
    "validation row without ground truth": (["data.val_files=[{tmp}/v.jsonl]"],
                                            {"v.jsonl": _jsonl({**GOOD, "reward_model": {}})}, ExitCode.DATA,
                                            r"v.jsonl: row 1: reward_model must be an object with a ground_truth"),
    "every prompt too long": (["data.max_prompt_length=2"], {}, ExitCode.DATA,
                              r"dataset 'arithmetic' has no rows with prompts <= data.max_prompt_length=2 tokens: raise"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_one_clear_line_and_its_exit_code(tmp_path, capfd, name):
    overrides, files, code, pattern = CASES[name]
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    args = [f"trainer.run_dir={tmp_path / 'run'}", *(o.replace("{tmp}", str(tmp_path)) for o in overrides)]
    assert run("grpo", preset="smoke", overrides=args) == int(code), name
    err = capfd.readouterr().err
    assert re.search(pattern, err), f"{name}: {err[-2000:]}"
    assert "Traceback" not in err, f"{name}: a traceback on the screen:\n{err[-3000:]}"
    if code == ExitCode.DATA:  # the traceback is kept, in the run's log
        assert "Traceback" in (tmp_path / "run" / "error.log").read_text()


@pytest.mark.parametrize("num_workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_a_raising_user_scorer_names_the_row_and_keeps_its_traceback(tmp_path, num_workers):
    scorer = tmp_path / "scorer.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if ground_truth == '3':\n        raise KeyError('my_field')\n    return 1.0\n")
    manager = NaiveRewardManager(ScoreFnSpec(path=str(scorer)), num_workers=num_workers)
    try:
        with pytest.raises(ScorerError, match=r"raised KeyError: 'my_field' on row 1 .*data_source='x', "
                                              r"ground_truth='3'") as info:
            manager.score_texts(["a", "b"], ["x", "x"], ["2", "3"])
    finally:
        manager.close()
    assert info.value.exit_code == ExitCode.DATA
    assert "my_field" in repr(info.value.__cause__)  # the scorer's own error (its remote traceback from the pool)
