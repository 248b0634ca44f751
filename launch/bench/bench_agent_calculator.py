"""Tool vs no tool on the ``calculator`` dataset at the untrained policy: accuracy and tool use per prompt style.

  python launch/bench/bench_agent_calculator.py [--model smollm2-135m-instruct] [--prompts 8] [--n 2]
      [--response-length 96] [--turns 3] [--out bench_agent_calculator.json]

Samples ``n`` rollouts of ``--prompts`` calculator problems (T=1, the native JAX engine) three ways: ``no_tool``
(the plain prompt, single turn: the baseline), ``tool_zero_shot`` (the tool schema in the system prompt, the
``multi_turn`` loop) and ``tool_one_shot`` (the same plus one worked example exchange: user -> tool call -> tool
answer -> ``Answer:``). Reports accuracy (strict ``Answer: n``), tool calls per sample, malformed/failed calls
and seconds; prints a table and writes JSON. What RL would start from: with accuracy 0 everywhere GRPO has no
signal, so this is the first thing to check before a tool-vs-no-tool training comparison.
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace

import numpy as np

from jaxrl_hf.agent import get_tool
from jaxrl_hf.agent.chat import tools_system_prompt
from jaxrl_hf.config.schema_rollout import MultiTurnConfig
from jaxrl_hf.controller import Batch
from jaxrl_hf.data.calculator import ONE_SHOT_EXAMPLE, TOOL_INSTRUCTIONS, generate_calculator
from jaxrl_hf.models import load_pretrained
from jaxrl_hf.rewards import default_compute_score
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams
from jaxrl_hf.rollout.loops import RolloutRequest, make_rollout_loop

def conversations(rows: list[dict], mode: str) -> list[list[dict]]:
    if mode == "no_tool":
        return [row["prompt"] for row in rows]
    system = {"role": "system", "content": tools_system_prompt([get_tool("calculator").schema], TOOL_INSTRUCTIONS)}
    shots = list(ONE_SHOT_EXAMPLE) if mode == "tool_one_shot" else []
    return [[system, *shots, *row["prompt"][1:]] for row in rows]


def run_mode(mode: str, rows: list[dict], lm, engine, args) -> dict:
    ids = [lm.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)
           for c in conversations(rows, mode)]
    width = max(map(len, ids))
    prompts, mask = np.full((len(ids), width), engine.pad_token_id, np.int32), np.zeros((len(ids), width), np.int32)
    for i, row in enumerate(ids):
        prompts[i, width - len(row):], mask[i, width - len(row):] = row, 1
    loop = make_rollout_loop("single_turn" if mode == "no_tool" else "multi_turn")
    loop.setup(SimpleNamespace(multi_turn=MultiTurnConfig(enable=True, max_assistant_turns=args.turns)), lm.tokenizer)
    batch = Batch.from_dict({"prompts": prompts, "prompt_mask": mask})
    start = time.perf_counter()
    sampling = SamplingParams(n=args.n, max_new_tokens=args.response_length, seed=args.seed)
    out = loop.run(engine, RolloutRequest(batch.arrays, batch.objects, sampling))
    seconds = time.perf_counter() - start
    a = out.arrays
    attended = a["attention_mask"][:, -args.response_length:] > 0
    texts = [lm.tokenizer.decode(a["responses"][i][attended[i]].tolist()) for i in range(len(attended))]
    acc = [default_compute_score("calculator", t, rows[i // args.n]["reward_model"]["ground_truth"])
           for i, t in enumerate(texts)]
    calls = a.get("num_tool_calls", np.zeros(len(texts)))
    return {"mode": mode, "prompt_tokens": width, "acc": float(np.mean(acc)),
            "tool_calls_per_sample": float(np.mean(calls)), "tool_errors": int(np.sum(a.get("num_tool_errors", 0))),
            "model_tokens_mean": float(a["response_mask"].sum(1).mean()), "seconds": round(seconds, 1),
            "example": texts[0][:300]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--response-length", type=int, default=96)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="bench_agent_calculator.json")
    args = parser.parse_args()
    lm = load_pretrained(args.model)
    eos = (lm.tokenizer.eos_token_id,)
    engine = JaxGenerationEngine(lm.config, lm.params, pad_token_id=lm.tokenizer.pad_token_id or eos[0],
                                 eos_token_ids=eos, length_buckets=(256, 512, 1024),
                                 batch_buckets=(args.prompts * args.n,))
    rows = generate_calculator(args.prompts, seed=0, split="test")
    results = [run_mode(mode, rows, lm, engine, args) for mode in ("no_tool", "tool_zero_shot", "tool_one_shot")]
    print(f"{'mode':<16}{'prompt tok':>11}{'acc':>7}{'calls/sample':>14}{'tool errors':>13}{'model tok':>11}{'s':>7}")
    for r in results:
        print(f"{r['mode']:<16}{r['prompt_tokens']:>11}{r['acc']:>7.3f}{r['tool_calls_per_sample']:>14.2f}"
              f"{r['tool_errors']:>13}{r['model_tokens_mean']:>11.1f}{r['seconds']:>7}")
    with open(args.out, "w") as fh:
        json.dump({"args": vars(args), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
