"""Native generation with bf16 compute and the scanned layer loop: its stacked KV cache as bf16 bit patterns (that
loop's CPU default), as a plain bf16 array, and as float32, in the same process.

    python launch/bench/bench_kv_cache_dtype.py [--batches 32,64] [--max-new 96] [--repeats 3] [--json OUT]

SmolLM2-135M-Instruct with ``model.dtype=bfloat16`` (float32 master weights, as the trainer's rollout holds them),
greedy decoding of exactly ``--max-new`` tokens from B chat prompts, no stop ids. For each batch the engines are
compiled first, then their timed ``generate`` calls alternate (``--repeats`` each) so load drifts hit all alike;
the table gives the best and the median. The tokens and log-probs of all three must be identical: the keys and
values are bf16 numbers in each (checked, the run fails otherwise).

Why: XLA:CPU has no in-place bf16 ``dynamic-update-slice`` or ``dynamic-slice`` in the decode loop; it converts
a plain bf16 cache to float32 and back as a whole to write one slot, and slices each layer's through float32. A
float32 cache is written in place but moves twice the bytes; the cache as ``uint16`` bit patterns
(``JaxGenerationEngine(cache_as_bits=None)``: on by default on CPU devices) is written and sliced as integers and
read as bf16 by a bitcast.
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
# the scanned layer loop over a stacked cache (the unrolled loop's per-layer caches: bench_decode_layers.py)
VARIANTS = {"bf16-bits": {"cache_as_bits": True, "unroll_layers": False},
            "bf16": {"cache_as_bits": False, "unroll_layers": False},
            "float32": {"cache_dtype": "float32", "unroll_layers": False}}


def alternate_engines(lm, batch: int, max_new: int, repeats: int, variants: dict) -> tuple[dict, dict]:
    """One engine per ``variants`` entry (name -> `JaxGenerationEngine` options) over ``batch`` chat prompts, greedy
    ``max_new`` tokens: each compiled by a first call, then timed calls alternating ``repeats`` times. Returns the
    first calls' outputs and a row: per engine its seconds and best / median tokens/s."""
    tok = lm.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                            add_generation_prompt=True, tokenize=True)) for i in range(batch)]
    sp = SamplingParams(greedy=True, max_new_tokens=max_new)
    engines = {name: JaxGenerationEngine(lm.config, lm.params, pad_token_id=tok.pad_token_id, eos_token_ids=(),
                                         **options) for name, options in variants.items()}
    first = {name: e.generate(prompts, sp) for name, e in engines.items()}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, engine in engines.items():
            t = time.perf_counter()
            engine.generate(prompts, sp)
            seconds[name].append(time.perf_counter() - t)
    tokens = batch * max_new
    row = {"batch": batch, "max_new": max_new, "prompt_len": int(next(iter(first.values())).prompt_ids.shape[1]),
           "seconds": seconds}
    for name in variants:
        row[f"{name}_tok_per_s_best"] = tokens / min(seconds[name])
        row[f"{name}_tok_per_s_median"] = tokens / statistics.median(seconds[name])
    return first, row


def bench_batch(lm, batch: int, max_new: int, repeats: int) -> dict:
    """Every cache variant at one batch size: compile, check equal outputs, then alternate timed calls."""
    first, row = alternate_engines(lm, batch, max_new, repeats, VARIANTS)
    a = first["bf16-bits"]
    for name, b in first.items():
        if not (np.array_equal(a.response_ids, b.response_ids) and np.array_equal(a.log_probs, b.log_probs)):
            raise RuntimeError(f"batch {batch}: the {name} and bf16-bits caches generated different tokens or "
                               "log-probs")
    seconds = row["seconds"]
    for name in ("bf16", "float32"):
        row[f"bits_over_{name}_median"] = statistics.median(seconds[name]) / statistics.median(seconds["bf16-bits"])
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
    print(machine_line(load_start, load_end, f"{args.model}, bf16 compute, greedy, outputs identical for every cache"))
    print("| batch | prompt | new | " + " | ".join(f"{n} tok/s (best / median)" for n in VARIANTS)
          + " | bits vs bf16 (median) | bits vs float32 (median) |\n|---:|---:|---:|" + "---:|" * (len(VARIANTS) + 2))
    for r in rows:
        print(f"| {r['batch']} | {r['prompt_len']} | {r['max_new']} | " + " | ".join(speed_cells(r, VARIANTS))
              + f" | {r['bits_over_bf16_median']:.2f} | {r['bits_over_float32_median']:.2f} |")
    write_rows(args.json, load_start, load_end, rows)


def machine_line(load_start: tuple, load_end: tuple, what: str) -> str:
    return (f"machine: {platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__} on "
            f"{jax.devices()[0].platform}; load average at start {load_start[0]:.1f}, at end {load_end[0]:.1f}; {what}")


def speed_cells(row: dict, names) -> list[str]:
    """``best / median`` tokens/s of each engine in ``names`` (an `alternate_engines` row)."""
    return [f"{row[f'{n}_tok_per_s_best']:.1f} / {row[f'{n}_tok_per_s_median']:.1f}" for n in names]


def write_rows(path: str | None, load_start: tuple, load_end: tuple, rows: list) -> None:
    if path:
        with open(path, "w") as fh:
            json.dump({"argv": sys.argv[1:], "load_start": load_start, "load_end": load_end, "rows": rows}, fh,
                      indent=2)


if __name__ == "__main__":
    main()
