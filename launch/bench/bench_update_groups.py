"""The default DAPO run's actor update at one, two or four groups per optimizer update, in one process:

    python launch/bench/bench_update_groups.py [--groups 1,2] [--calls 8] [--prompt 64] [--response 32] [--json OUT]

Each ``update_actor`` call takes the same 4 groups of n = 4 samples (`_default_update`: SmolLM2-135M's dimensions,
bf16 compute, float32 master weights, packed group rows) and makes 4 / G optimizer updates of G groups each, the G
groups in one micro-batch (``actor.ppo_mini_batch_size: G``, ``ppo_micro_batch_size_per_device: 4·G``): the rows
of a matmul grow from one packed group (~128 positions) to G. One worker per G lives in this process and their
calls alternate (the first call, the compilation, is left out). The table gives each G's median and fastest call,
the trainer's ``perf/mfu/actor`` of the median call (this machine's measured peak) and the speed-up over the first
G. The optimizer updates differ (fewer, larger), so the losses differ too: this times a recipe choice.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default="1,2", help="groups per optimizer update, comma-separated (1, 2, 4)")
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    groups = [int(g) for g in args.groups.split(",")]
    if any(g not in (1, 2, 4) for g in groups):
        parser.error(f"--groups {args.groups!r}: each must divide the 4 groups of a call (1, 2 or 4)")
    import jax
    from _default_update import update_batch, update_mfu, update_worker

    batch = update_batch(args.prompt, args.response)
    workers = {g: update_worker(args.prompt, args.response, g, name=f"bench_groups_{g}") for g in groups}
    seconds: dict[int, list[float]] = {g: [] for g in groups}

    def call(g: int) -> float:
        worker = workers[g][0]
        start = time.perf_counter()
        worker.update_actor(batch)
        jax.block_until_ready(worker.state)
        return time.perf_counter() - start

    first = {g: call(g) for g in groups}
    for i in range(args.calls):
        for g in (groups if i % 2 == 0 else groups[::-1]):
            seconds[g].append(call(g))
    median = {g: statistics.median(s) for g, s in seconds.items()}
    mfu = {g: update_mfu(batch, workers[g][1], median[g]) for g in groups}
    peak = workers[groups[0]][1].get("peak_flops_per_device", 0.0)
    print(f"update_actor (4 groups of 4 samples a call), SmolLM2-135M dims, bf16, P={args.prompt}, R={args.response}, "
          f"{os.cpu_count()} CPUs, peak {peak / 1e9:.0f} GFLOP/s; {args.calls} alternating calls each")
    print("| groups per update | updates a call | first call s | median s | fastest s | perf/mfu/actor | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for g in groups:
        print(f"| {g} | {4 // g} | {first[g]:.1f} | {median[g]:.3f} | {min(seconds[g]):.3f} | {mfu[g]:.3f} | "
              f"{median[groups[0]] / median[g]:.2f}x |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpus": os.cpu_count(), "peak_flops_per_device": peak, "args": vars(args),
                       "first_call_s": first, "seconds": seconds, "median_s": median, "mfu": mfu}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
