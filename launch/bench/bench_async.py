"""Asynchronous against synchronous training on the same split placement (``placement.rollout.colocate=false``).

  python launch/bench/bench_async.py [--algo grpo] [--preset smoke] [--steps 8] [--out bench_async.json] [k=v ...]

Runs ``launch/train.py`` twice, one after the other, with the same overrides: ``trainer.max_staleness=0`` (the
rollout group generates, then the actor trains) and ``trainer.max_staleness=1`` (the rollout group generates the
next step's batch while the actor trains). Each run has its own Ray session and worker processes; the first
step (XLA compilation) is left out. Reports per mode the median step time, tokens/s (``perf/total_num_tokens``
/ ``timing_s/step``), the driver's wait for generation (``timing_s/wait_rollout``), the rollout group's idle
time (``timing_s/wait_train``), the weight hand-over (``perf/weight_sync_bytes``, ``timing_s/weight_sync_rollout``),
and the async/sync ratio of the median step time; prints a table and writes the JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = ("timing_s/step", "timing_s/wait_rollout", "timing_s/wait_train", "timing_s/gen", "timing_s/update_actor",
        "timing_s/weight_sync_rollout", "perf/weight_sync_bytes", "async/staleness/mean")


def run_mode(algo: str, preset: str | None, steps: int, staleness: int, overrides: list[str], workdir: str) -> dict:
    run_dir = os.path.join(workdir, f"staleness{staleness}")
    cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "--algo", algo,
           *(["--preset", preset] if preset else []), f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
           "trainer.save_freq=0", "trainer.test_freq=0", "trainer.val_before_train=false",
           "placement.rollout.colocate=false", f"trainer.max_staleness={staleness}", *overrides]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench_async: {' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh if line.strip()][1:]  # step 1 compiles
    step = np.array([r["timing_s/step"] for r in records])
    tokens = np.array([r["perf/total_num_tokens"] for r in records])
    out = {"staleness": staleness, "steps_timed": len(records), "wall_s": wall,
           "median_step_s": float(np.median(step)), "tokens_per_s": float(tokens.sum() / step.sum())}
    out.update({f"median {k}": float(np.median([r.get(k, np.nan) for r in records])) for k in KEYS})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algo", default="grpo")
    parser.add_argument("--preset", default="smoke")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="bench_async.json")
    parser.add_argument("overrides", nargs="*", help="key.path=value, applied to both runs")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error("--steps must be >= 3 (step 1 compiles and is not timed)")
    with tempfile.TemporaryDirectory(prefix="bench_async_") as workdir:
        rows = [run_mode(args.algo, args.preset, args.steps, s, args.overrides, workdir) for s in (0, 1)]
    sync, asyn = rows
    result = {"algo": args.algo, "preset": args.preset, "steps": args.steps, "overrides": args.overrides,
              "cpu_count": os.cpu_count(), "rows": rows,
              "async_over_sync_step_time": asyn["median_step_s"] / sync["median_step_s"],
              "async_over_sync_tokens_per_s": asyn["tokens_per_s"] / sync["tokens_per_s"]}
    header = ["max_staleness", "median step s", "tokens/s", "wait_rollout s", "wait_train s", "gen s", "update s",
              "sync MB", "staleness"]
    print(" | ".join(header))
    for r in rows:
        print(" | ".join([str(r["staleness"]), f"{r['median_step_s']:.2f}", f"{r['tokens_per_s']:.1f}",
                          f"{r['median timing_s/wait_rollout']:.2f}", f"{r['median timing_s/wait_train']:.2f}",
                          f"{r['median timing_s/gen']:.2f}", f"{r['median timing_s/update_actor']:.2f}",
                          f"{r['median perf/weight_sync_bytes'] / 1e6:.1f}", f"{r['median async/staleness/mean']:.0f}"]))
    print(f"async/sync: step time {result['async_over_sync_step_time']:.2f}x, "
          f"tokens/s {result['async_over_sync_tokens_per_s']:.2f}x")
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
