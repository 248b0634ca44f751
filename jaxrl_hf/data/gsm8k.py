"""GSM8K (Cobbe et al., 2021) in verl's schema, and GSM8K preference pairs for reward-model training.

Source files are the original jsonl (``question``, ``answer`` ending in ``#### n``); a copy ships in
``jaxrl_hf/data/assets/gsm8k/{train,test}.jsonl`` (MIT, see its LICENSE) and :func:`default_gsm8k_dir` finds it. The prompt appends verl's instruction
(``Let's think step by step and output the final answer after "####".``) so the ``openai/gsm8k`` rule
scorer's strict mode applies. A source row whose answer has no parseable ``#### n`` is an error naming
the file and line — bad ground truth wrecks RL training, so it is never silently kept or dropped.
"""

from __future__ import annotations

import json
import os
import random
import re

from typing import TYPE_CHECKING

from jaxrl_hf.data.schema import DatasetRowError, make_row

if TYPE_CHECKING:
    from jaxrl_hf.data.arithmetic import ArithmeticConfig

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'

#: Environment variable naming another directory holding ``train.jsonl`` / ``test.jsonl``.
GSM8K_DIR_ENV = "JAXRL_HF_GSM8K_DIR"


def default_gsm8k_dir() -> str:
    """``$JAXRL_HF_GSM8K_DIR`` if set, else the copy shipped inside the package."""
    return os.environ.get(GSM8K_DIR_ENV) or os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "gsm8k")


_FINAL = re.compile(r"#### (-?[0-9.,]+)\s*$")
_CALCULATOR = re.compile(r"<<[^<>]*>>")


def read_source(path: str) -> list[dict]:
    """The raw GSM8K rows (``question``, ``answer``) of a jsonl file, each checked, with ``line`` added."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GSM8K source file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetRowError(f"{path}: line {line_no}: invalid JSON ({exc.msg})") from None
            if not isinstance(raw, dict) or not isinstance(raw.get("question"), str) or not isinstance(raw.get("answer"), str):
                raise DatasetRowError(f"{path}: line {line_no}: expected string fields 'question' and 'answer'")
            rows.append({**raw, "line": line_no})
    return rows


def final_answer(answer: str, *, where: str = "<answer>") -> str:
    """The ground truth of a GSM8K solution: the number after the final ``#### ``, commas removed."""
    match = _FINAL.search(answer)
    if match is None:
        raise DatasetRowError(f"{where}: answer does not end with '#### <number>': ...{answer[-60:]!r}")
    value = match.group(1).replace(",", "")
    if not re.fullmatch(r"-?\d+(\.\d+)?", value):
        raise DatasetRowError(f"{where}: final answer {match.group(1)!r} is not a number")
    return value


def to_rows(path: str, split: str) -> list[dict]:
    """GSM8K rows of ``path`` in verl's schema (``extra_info``: split, index, question, answer)."""
    rows = []
    for index, raw in enumerate(read_source(path)):
        truth = final_answer(raw["answer"], where=f"{path}: line {raw['line']}")
        rows.append(
            make_row(
                DATA_SOURCE,
                raw["question"] + " " + INSTRUCTION,
                truth,
                extra_info={"split": split, "index": index, "question": raw["question"], "answer": raw["answer"]},
            )
        )
    return rows


#: The format demonstration before each `arithmetic_rows` question: one solved problem, answered as GSM8K's
#: solutions end (``#### n``), which the ``openai/gsm8k`` scorer's strict mode requires.
ARITHMETIC_ONE_SHOT = ({"role": "user", "content": f"Compute 3 + 4. {INSTRUCTION}"},
                       {"role": "assistant", "content": "3 + 4 = 7\n#### 7"})


def arithmetic_rows(n: int, seed: int, split: str, config: "ArithmeticConfig | None" = None) -> list[dict]:
    """``n`` arithmetic problems (`jaxrl_hf.data.arithmetic`) as GSM8K rows: ``data_source='openai/gsm8k'``,
    verl's GSM8K instruction after the question, `ARITHMETIC_ONE_SHOT` before it, ``extra_info`` with the
    question and a GSM8K-style answer. Problems a small model can solve, scored by the GSM8K rule scorer."""
    from jaxrl_hf.data.arithmetic import ArithmeticConfig, generate_arithmetic

    cfg = config or ArithmeticConfig(max_digits=1)
    rows = []
    for row in generate_arithmetic(n, seed, cfg, split=split):
        expression, truth = row["extra_info"]["expression"], row["reward_model"]["ground_truth"]
        question = f"Compute {expression}."
        gsm8k_row = make_row(DATA_SOURCE, f"{question} {INSTRUCTION}", truth,
                             extra_info={"split": split, "index": row["extra_info"]["index"], "question": question,
                                         "answer": f"{expression} = {truth}\n#### {truth}"})
        gsm8k_row["prompt"] = [*(dict(m) for m in ARITHMETIC_ONE_SHOT), *gsm8k_row["prompt"]]
        rows.append(gsm8k_row)
    return rows


def clean_solution(answer: str) -> str:
    """A GSM8K solution without the ``<<a*b=c>>`` calculator annotations."""
    return _CALCULATOR.sub("", answer)


def wrong_answer(truth: str, rng: random.Random) -> str:
    """A plausible wrong answer near ``truth``: off by a little, a factor of 10, or digits swapped."""
    value = float(truth) if "." in truth else int(truth)
    candidates = [value + 1, value - 1, value + rng.randint(2, 9), value * 10, value * 2]
    digits = str(abs(int(value)))
    if len(digits) >= 2 and digits[0] != digits[1]:
        candidates.append(int(digits[1] + digits[0] + digits[2:]) * (1 if value >= 0 else -1))
    choice = rng.choice([c for c in candidates if c != value])
    if isinstance(choice, float):
        return f"{choice:.10g}"
    return str(choice)


def corrupt_solution(answer: str, truth: str, wrong: str) -> str:
    """The solution with its final result replaced by ``wrong`` in the last reasoning line and after ####."""
    body, _, _ = clean_solution(answer).rpartition("####")
    lines = body.rstrip("\n").split("\n")
    if lines:
        number = re.escape(f"{int(truth):,}") + "|" + re.escape(truth) if re.fullmatch(r"-?\d+", truth) else re.escape(truth)
        pattern = re.compile(rf"(?<![\d.,])(?:{number})(?![\d,]|\.\d)")
        hits = list(pattern.finditer(lines[-1]))
        if hits:
            last = hits[-1]
            lines[-1] = lines[-1][: last.start()] + wrong + lines[-1][last.end() :]
    return "\n".join(lines) + f"\n#### {wrong}"


def preference_pairs(path: str, seed: int, limit: int | None = None) -> list[dict]:
    """Bradley-Terry pairs from GSM8K: ``prompt`` (chat messages), ``chosen`` (the reference solution),
    ``rejected`` (the same solution made to reach a nearby wrong answer), ``ground_truth``."""
    rng = random.Random(f"jaxrl_hf.gsm8k_prefs:{seed}")
    pairs = []
    for raw in read_source(path)[:limit]:
        truth = final_answer(raw["answer"], where=f"{path}: line {raw['line']}")
        wrong = wrong_answer(truth, rng)
        pairs.append(
            {
                "prompt": [{"role": "user", "content": raw["question"] + " " + INSTRUCTION}],
                "chosen": clean_solution(raw["answer"]),
                "rejected": corrupt_solution(raw["answer"], truth, wrong),
                "ground_truth": truth,
                "rejected_answer": wrong,
            }
        )
    return pairs
