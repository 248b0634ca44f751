"""Native generation with bf16 compute: a bf16 KV cache vs a float32 one, in the same process.

    python launch/bench/bench_kv_cache_dtype.py [--batches 32,64] [--max-new 96] [--repeats 3] [--json OUT]

SmolLM2-135M-Instruct with ``model.dtype=bfloat16`` (float32 master weights, as the trainer's rollout holds them),
greedy decoding of exactly ``--max-new`` tokens from B chat prompts, no stop ids. For each batch both engines are
compiled first, then their timed ``generate`` calls alternate (``--repeats`` each) so load drifts hit both alike;
the table gives the best and the median. The tokens and log-probs of the two must be identical: the keys and values
are bf16 numbers either way, which float32 stores exactly (checked, the run fails otherwise).

Why: XLA:CPU has no in-place bf16 ``dynamic-update-slice`` in the decode loop; it converts the whole bf16 cache to
float32 and back to write one slot, and converts it again to attend. A float32 cache is written in place and read
once. The engine's default (``JaxGenerationEngine(cache_dtype=None)``) is float32 on CPU devices, the compute dtype
elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_hf.models import load_pretrained  # noqa: E402
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams  # noqa: E402

QUESTIONS = ["What is 7+5?", "Name three colors.", "Write a haiku about rain.", "Count from 1 to 10.",
             "Explain what a prime number is.", "What is the capital of France?"]
CACHE_DTYPES = ("bfloat16", "float32")


def bench_batch(lm, batch: int, max_new: int, repeats: int) -> dict:
    """Both cache dtypes at one batch size: compile, check equal outputs, then alternate timed calls."""
    tok = lm.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                            add_generation_prompt=True, tokenize=True)) for i in range(batch)]
    sp = SamplingParams(greedy=True, max_new_tokens=max_new)
    engines = {dt: JaxGenerationEngine(lm.config, lm.params, pad_token_id=tok.pad_token_id, eos_token_ids=(),
                                       cache_dtype=dt) for dt in CACHE_DTYPES}
    first = {dt: e.generate(prompts, sp) for dt, e in engines.items()}
    a, b = (first[dt] for dt in CACHE_DTYPES)
    if not (np.array_equal(a.response_ids, b.response_ids) and np.array_equal(a.log_probs, b.log_probs)):
        raise RuntimeError(f"batch {batch}: the bf16 and float32 caches generated different tokens or log-probs")
    seconds: dict[str, list[float]] = {dt: [] for dt in CACHE_DTYPES}
    for _ in range(repeats):
        for dt, engine in engines.items():
            t = time.perf_counter()
            engine.generate(prompts, sp)
            seconds[dt].append(time.perf_counter() - t)
    tokens = batch * max_new
    row = {"batch": batch, "max_new": max_new, "prompt_len": int(a.prompt_ids.shape[1]), "seconds": seconds}
    for dt in CACHE_DTYPES:
        row[f"{dt}_tok_per_s_best"] = tokens / min(seconds[dt])
        row[f"{dt}_tok_per_s_median"] = tokens / statistics.median(seconds[dt])
    row["f32_over_bf16_best"] = min(seconds["bfloat16"]) / min(seconds["float32"])
    row["f32_over_bf16_median"] = statistics.median(seconds["bfloat16"]) / statistics.median(seconds["float32"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lm = load_pretrained(args.model, dtype="bfloat16")
    load_start = os.getloadavg()
    rows = [bench_batch(lm, int(b), args.max_new, args.repeats) for b in args.batches.split(",")]
    load_end = os.getloadavg()
    print(f"machine: {platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__} on "
          f"{jax.devices()[0].platform}; load average at start {load_start[0]:.1f}, at end {load_end[0]:.1f}; "
          f"{args.model}, bf16 compute, greedy, outputs identical for both caches")
    print("| batch | prompt | new | bf16 cache tok/s (best / median) | f32 cache tok/s (best / median) | "
          "speed-up best | speed-up median |\n|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['prompt_len']} | {r['max_new']} | {r['bfloat16_tok_per_s_best']:.1f} / "
              f"{r['bfloat16_tok_per_s_median']:.1f} | {r['float32_tok_per_s_best']:.1f} / "
              f"{r['float32_tok_per_s_median']:.1f} | {r['f32_over_bf16_best']:.2f} | {r['f32_over_bf16_median']:.2f} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"argv": sys.argv[1:], "load_start": load_start, "load_end": load_end, "rows": rows}, fh,
                      indent=2)


if __name__ == "__main__":
    main()
