"""A bf16 projection's time by row count, XLA:CPU's plain dot against `models/matmul.matmul_f32_accumulate`:

    python launch/bench/bench_matmul_rows.py [--rows 32,48,49,56,63,64,65,96,128] [--repeats 200] [--json OUT]

For ``x [M, K] · W [K, N]`` in bfloat16 with float32 accumulation (the decode step's projections: ``M`` = the
rows decoded together; the ``K x N`` pairs of SmolLM2-135M and Qwen2.5-0.5B's MLPs), each row count is timed
- ``plain``: ``dot_general(x, W, preferred_element_type=float32)`` jitted alone, as XLA:CPU runs it;
- ``ours``: ``matmul_f32_accumulate(x, W, f32_out=True)``, which on a CPU backend computes a row count in one
  of `CPU_DOT_ROW_PADDING`'s bands with ``K >= SLOW_CPU_MIN_K`` as that band's row count (zero rows appended);
alternately, best of ``--repeats`` calls each, in microseconds; ``plain / ours`` > 1 means ours is faster. The
two outputs are checked equal bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sampling import best_time  # noqa: E402
from jaxrl_hf.models.matmul import CPU_DOT_ROW_PADDING, SLOW_CPU_MIN_K, matmul_f32_accumulate  # noqa: E402

SHAPES = {"smollm2-135m down_proj": (1536, 576), "smollm2-135m gate_proj": (576, 1536),
          "qwen2.5-0.5b down_proj": (4864, 896)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="32,40,44,46,48,49,52,56,60,61,64,65,96,128")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    plain = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                                     preferred_element_type=jnp.float32))
    ours = jax.jit(lambda x, w: matmul_f32_accumulate(x, w, True))
    rng = np.random.default_rng(0)
    bands = ", ".join(f"{lo}-{hi} -> {to}" for lo, hi, to in CPU_DOT_ROW_PADDING)
    print(f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, jax {jax.__version__}; rows padded "
          f"{bands} when K >= {SLOW_CPU_MIN_K}")
    print("| projection (K x N) | rows | plain us | ours us | plain / ours | plain GFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|")
    results = []
    for name, (k, n) in SHAPES.items():
        w = jnp.asarray(rng.normal(0, 0.05, (k, n)), jnp.bfloat16)
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.normal(0, 1, (m, k)), jnp.bfloat16)
            if not np.array_equal(np.asarray(plain(x, w)), np.asarray(ours(x, w))):
                raise SystemExit(f"bench_matmul_rows: {name} at {m} rows: outputs differ")
            t_plain = t_ours = float("inf")
            for _ in range(2):  # alternate, keep each side's best
                t_plain = min(t_plain, best_time(plain, x, w, repeats=args.repeats))
                t_ours = min(t_ours, best_time(ours, x, w, repeats=args.repeats))
            row = {"projection": name, "k": k, "n": n, "rows": m, "plain_us": t_plain * 1e6,
                   "ours_us": t_ours * 1e6, "plain_over_ours": t_plain / t_ours,
                   "plain_gflops": 2 * m * k * n / t_plain / 1e9}
            results.append(row)
            print(f"| {name} ({k} x {n}) | {m} | {row['plain_us']:.0f} | {row['ours_us']:.0f} | "
                  f"{row['plain_over_ours']:.2f} | {row['plain_gflops']:.0f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "cpus": os.cpu_count(), "jax": jax.__version__,
                       "repeats": args.repeats, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
