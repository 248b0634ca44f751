"""Rule-scoring throughput: serial (in process) vs the process pool, side by side in one run.

    python launch/bench/bench_rewards.py [--n 2048] [--workers 1 2] [--repeats 3] [--json OUT]

Responses are GSM8K reference solutions (test split) written the ways a model writes them (``#### n``,
``\\boxed{n}``, ``Answer: n``, padded with reasoning to ~1-4k characters); each scorer (gsm8k, MATH,
DAPO math) scores all of them through ``NaiveRewardManager``. The pool is warmed up before timing
(its start-up is reported separately). Prints a table; ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

from jaxrl_hf.rewards import NaiveRewardManager  # noqa: E402
from jaxrl_hf.data.gsm8k import default_gsm8k_dir  # noqa: E402

GSM8K_TEST = os.path.join(default_gsm8k_dir(), "test.jsonl")
SOURCES = {"gsm8k": "openai/gsm8k", "math": "lighteval/MATH", "math_dapo": "math_dapo"}


def make_responses(n: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """n model-style responses and their ground truths, built from GSM8K test solutions."""
    with open(GSM8K_TEST, encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    rng = random.Random(seed)
    texts, truths = [], []
    for i in range(n):
        row = rows[i % len(rows)]
        body, truth = row["answer"].rsplit("#### ", 1)
        truth = truth.replace(",", "")
        answer = truth if rng.random() < 0.5 else str(int(float(truth)) + 1)
        ending = rng.choice([f"#### {answer}", f"\\boxed{{{answer}}}", f"Answer: {answer}"])
        padding = (body + " ") * rng.randint(2, 10)
        texts.append(padding + ending)
        truths.append(truth)
    return texts, truths


def time_manager(manager: NaiveRewardManager, source: str, texts: list[str], truths: list[str], repeats: int) -> float:
    """Median seconds to score all ``texts`` (after one warm-up call)."""
    ids = np.zeros((len(texts), 1), np.int64)
    mask = np.ones((len(texts), 1), np.int64)
    sources = [source] * len(texts)
    manager(ids[:64], mask[:64], sources[:64], truths[:64], responses=texts[:64])  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        manager(ids, mask, sources, truths, responses=texts)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    texts, truths = make_responses(args.n)
    mean_chars = sum(map(len, texts)) / len(texts)
    results = []
    serial = NaiveRewardManager()
    for name, source in SOURCES.items():
        base = time_manager(serial, source, texts, truths, args.repeats)
        results.append({"scorer": name, "mode": "serial", "workers": 0, "seconds": base,
                        "responses_per_s": args.n / base, "speedup_vs_serial": 1.0})
    for workers in args.workers:
        start = time.perf_counter()
        pooled = NaiveRewardManager(num_workers=workers)
        pooled(np.zeros((1, 1)), np.ones((1, 1)), ["openai/gsm8k"], ["1"], responses=["#### 1"])
        startup = time.perf_counter() - start
        for name, source in SOURCES.items():
            seconds = time_manager(pooled, source, texts, truths, args.repeats)
            base = next(r["seconds"] for r in results if r["scorer"] == name and r["mode"] == "serial")
            results.append({"scorer": name, "mode": "pool", "workers": workers, "seconds": seconds,
                            "responses_per_s": args.n / seconds, "speedup_vs_serial": base / seconds,
                            "pool_startup_s": startup})
        pooled.close()

    print(f"{args.n} responses, mean {mean_chars:.0f} chars, median of {args.repeats}")
    print(f"{'scorer':<10} {'mode':<8} {'workers':>7} {'seconds':>9} {'resp/s':>10} {'vs serial':>9}")
    for r in results:
        print(f"{r['scorer']:<10} {r['mode']:<8} {r['workers']:>7} {r['seconds']:>9.4f} "
              f"{r['responses_per_s']:>10.0f} {r['speedup_vs_serial']:>8.2f}x")
    for w in args.workers:
        s = next(r["pool_startup_s"] for r in results if r.get("workers") == w)
        print(f"pool start-up with {w} worker(s): {s:.2f} s")
    report = {"n": args.n, "mean_chars": mean_chars, "repeats": args.repeats, "cpu_count": os.cpu_count(), "results": results}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return report


if __name__ == "__main__":
    main()
