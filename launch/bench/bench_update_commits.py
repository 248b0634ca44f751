"""The default DAPO run's actor update at two commits, side by side: the A/B for a change that has no switch.

    python launch/bench/bench_update_commits.py --before REV [--after REV] [--pairs 3] [--calls 8]
        [--prompt 64] [--response 32] [--groups-per-update 1] [--trace] [--json OUT]

``--before`` (and ``--after``; default: this checkout as it is) are checked out into temporary git worktrees. Each
pair runs one process per side, before then after, each timing ``--calls`` ``update_actor`` calls after a first
(compiling) one. The update is the default run's: SmolLM2-135M's dimensions (random weights), bfloat16 compute over
float32 master weights, layers unrolled, the shared prompt packed (``model.use_remove_padding``), one group of
n = 4 samples per optimizer update and 4 updates a call, prompts of 48-58 tokens left-padded to ``--prompt``
columns and responses of 4-28 tokens right-padded to ``--response``. The table gives each process's median and
fastest call and the ratio before / after of each pair (> 1: after is faster), and the last call's ``pg_loss``.
Processes, not threads: the two sides' modules cannot share one interpreter.

``--groups-per-update G``: G groups per optimizer update, all in one micro-batch (``actor.ppo_mini_batch_size`` G,
``ppo_micro_batch_size_per_device`` 4·G), so 4 / G updates a call. ``--trace``: one more call per process under
``jax.profiler``, its XLA op time summed by kind (`profile_update.device_op_times`); the table adds each side's op
time, which a process's load shifts less than its wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))


def time_updates(calls: int, prompt: int, response: int, groups_per_update: int = 1, trace: bool = False) -> dict:
    """In the child: ``update_actor`` times of the tree on ``sys.path`` (its first call left out); with ``trace``,
    one more call's XLA op time in all and by kind."""
    import collections
    import time

    import jax
    from _default_update import update_batch, update_worker
    from profile_update import device_op_times, kind_of

    worker, _ = update_worker(prompt, response, groups_per_update, peak=963e9)
    batch = update_batch(prompt, response)
    times, metrics = [], {}
    for _ in range(calls + 1):
        start = time.perf_counter()
        metrics = worker.update_actor(batch).meta_info["metrics"]
        jax.block_until_ready(worker.state)
        times.append(time.perf_counter() - start)
    out = {"first_s": times[0], "calls_s": times[1:], "pg_loss": float(metrics["actor/pg_loss"])}
    if trace:
        with tempfile.TemporaryDirectory(prefix="bench_commits_trace_") as where:
            jax.profiler.start_trace(where)
            worker.update_actor(batch)
            jax.block_until_ready(worker.state)
            jax.profiler.stop_trace()
            ops = device_op_times(where)
        kinds = collections.Counter()
        for name, (micros, _) in ops.items():
            kinds[kind_of(name)] += micros / 1e6
        out.update(op_s=sum(kinds.values()), op_s_by_kind=dict(kinds))
    return out


def run_side(tree: str, args: argparse.Namespace) -> dict:
    code = (f"import sys, json; sys.path[:0] = [{tree!r}, {HERE!r}]; import bench_update_commits as b; "
            f"print('RESULT ' + json.dumps(b.time_updates({args.calls}, {args.prompt}, {args.response}, "
            f"{args.groups_per_update}, {args.trace})))")
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"bench_update_commits: the run in {tree} failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def checkout(rev: str, where: str) -> str:
    path = os.path.join(where, rev.replace("/", "_"))
    proc = subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", path, rev], capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"bench_update_commits: cannot check out {rev!r}: {proc.stderr.strip()}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the baseline commit")
    parser.add_argument("--after", default=None, help="the commit to compare (default: this checkout as it is)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--groups-per-update", type=int, default=1, choices=(1, 2, 4))
    parser.add_argument("--trace", action="store_true", help="also each side's XLA op time of one traced call")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench_commits_") as where:
        trees = {"before": checkout(args.before, where),
                 "after": checkout(args.after, where) if args.after else ROOT}
        try:
            rows = []
            ops = " | op s before | op s after" if args.trace else ""
            print(f"{'pair':>4} | {'before median s':>15} | {'before min s':>12} | {'after median s':>14} | "
                  f"{'after min s':>11} | {'before / after':>14} | pg_loss before / after{ops}")
            for pair in range(1, args.pairs + 1):
                result = {side: run_side(tree, args) for side, tree in trees.items()}
                med = {side: statistics.median(r["calls_s"]) for side, r in result.items()}
                low = {side: min(r["calls_s"]) for side, r in result.items()}
                rows.append({"pair": pair, **{f"{side}_{k}": v for side, r in result.items() for k, v in r.items()},
                             "ratio_median": med["before"] / med["after"]})
                print(f"{pair:>4} | {med['before']:>15.3f} | {low['before']:>12.3f} | {med['after']:>14.3f} | "
                      f"{low['after']:>11.3f} | {med['before'] / med['after']:>13.3f}x | "
                      f"{result['before']['pg_loss']:.6f} / {result['after']['pg_loss']:.6f}"
                      + (f" | {result['before']['op_s']:11.3f} | {result['after']['op_s']:10.3f}" if args.trace else ""),
                      flush=True)
        finally:
            for side, tree in trees.items():
                if tree != ROOT:
                    subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], capture_output=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": args.before, "after": args.after or "working tree", "args": vars(args),
                       "pairs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
