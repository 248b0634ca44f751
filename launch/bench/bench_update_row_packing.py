"""The default DAPO run's update with each group in a packed row of its own, or each device's groups in one row:

    python launch/bench/bench_update_row_packing.py [--batches 4] [--calls 12] [--json OUT]

Two workers in one process (`_default_update`: SmolLM2-135M's dimensions, bf16 compute over float32 master weights,
the shared prompt packed, two groups of n = 4 samples per optimizer update in one micro-batch, as
``configs/dapo.yaml``): ``rows`` packs one group per row (``[2, T]``, each group padded to the longer one's compiled
length), ``grouped`` both groups one after the other in one row (``[1, L]``, `group_packing.pack_group_rows`'s
``per_row``; attention still runs one group at a time). The calls alternate over ``--batches`` rollout batches of
the default run's lengths (prompts of 48-58 tokens, responses of 2-26: the default run's ~14 on average), the
same sequence on both sides, after one compiling call per batch. The table gives each side's total and median
call, the packed positions per real token, and the ratio.
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
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import jax
    import numpy as np
    from _default_update import update_batch, update_worker

    from jaxrl_hf.workers import group_packing

    batches = [update_batch(64, 32, seed=seed, response_real=(2, 26)) for seed in range(1, args.batches + 1)]
    workers = {}
    for side in ("rows", "grouped"):
        worker, _ = update_worker(64, 32, groups_per_update=2, name=f"bench_row_packing_{side}")
        if side == "rows":
            worker.shared_prompt.groups_per_row = lambda rows, devices: 1
        workers[side] = worker
    positions = {"rows": 0, "grouped": 0}
    real = 0
    for batch in batches:
        mask = np.asarray(batch.arrays["attention_mask"])
        for update in range(2):  # the two updates of a call: 8 rows (2 groups) each
            part = mask[update * 8:(update + 1) * 8]
            real += int(group_packing.group_lengths(part, 32, 4).sum())
            positions["rows"] += 2 * group_packing.group_row_length(part, 32, 4)
            positions["grouped"] += group_packing.packed_row_length(part, 32, 4, 2)

    def call(side: str, batch) -> float:  # noqa: ANN001
        start = time.perf_counter()
        workers[side].update_actor(batch)
        jax.block_until_ready(workers[side].state)
        return time.perf_counter() - start

    first = {side: sum(call(side, b) for b in batches) for side in workers}
    seconds: dict[str, list[float]] = {side: [] for side in workers}
    for i in range(args.calls):
        for side in (("rows", "grouped") if i % 2 == 0 else ("grouped", "rows")):
            seconds[side].append(call(side, batches[i % len(batches)]))
    total = {side: sum(s) for side, s in seconds.items()}
    median = {side: statistics.median(s) for side, s in seconds.items()}
    print(f"update_actor, 2 groups of 4 samples per update, 2 updates a call, {len(batches)} batches, "
          f"{args.calls} alternating calls a side, {os.cpu_count()} CPUs")
    print("| packing | positions / real token | compile calls s | total s | median s | fastest s | rows / this |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for side in workers:
        print(f"| {side} | {positions[side] / real:.3f} | {first[side]:.1f} | {total[side]:.2f} | {median[side]:.3f} | "
              f"{min(seconds[side]):.3f} | {total['rows'] / total[side]:.3f}x |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpus": os.cpu_count(), "args": vars(args), "positions_per_real_token":
                       {s: positions[s] / real for s in workers}, "compile_calls_s": first, "seconds": seconds,
                       "total_s": total, "median_s": median}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
