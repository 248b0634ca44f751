"""The float32 decode step's projections: XLA:CPU's dot against `models.panel_matmul`'s kernel, by row count:

    python launch/bench/bench_panel_matmul.py [--rows 1,4,16,32,64,128] [--layers 30] [--repeats 5] [--json OUT]

For each ``K x N`` of SmolLM2-135M's decode step (its q/o, k/v, gate/up and down projections and its LM head),
a jitted loop of five passes over a chain of ``--layers`` distinct weights (one weight for the LM head) computes
``x <- x + tanh(x · W_i)[:, :K] / 1000`` (zero columns appended where ``N < K``), as a decode step does: each product needs the one before, and the
weights (106 MB for 30 gate projections) stream from memory as the step's weights do. ``xla``: ``jnp.dot(x, W)``;
``panel``: ``panel_matmul(x, to_panel_order(W))`` (the order made once, outside the timing). Both sides alternate
twice, best of ``--repeats`` calls each, as microseconds per product; ``xla / panel`` > 1 means the kernel is
faster. The two loops' results are checked equal to float32 summation error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from jaxrl_hf.models import cpu_kernels  # noqa: E402
from jaxrl_hf.models import panel_matmul as pm  # noqa: E402

SHAPES = {"q_proj / o_proj": (576, 576), "k_proj / v_proj": (576, 192), "gate_proj / up_proj": (576, 1536),
          "down_proj": (1536, 576), "lm_head": (576, 49152)}
PASSES = 5


def chain(matmul):
    def run(x, weights):
        def one_pass(_, h):
            for w in weights:
                y = matmul(h, w)[:, :h.shape[1]]
                h = h + jnp.tanh(jnp.pad(y, ((0, 0), (0, h.shape[1] - y.shape[1])))) * 1e-3
            return h
        return jax.lax.fori_loop(0, PASSES, one_pass, x)
    return jax.jit(run)


def best(fn, x, weights, repeats: int) -> float:
    fn(x, weights).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x, weights).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,32,64,128")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not cpu_kernels.available():
        raise SystemExit("bench_panel_matmul: the panel matmul kernel is unavailable here (x86-64 with AVX-512 and "
                         "g++ needed; JAXRL_HF_CPU_KERNELS=0 switches it off)")
    xla, panel = chain(jnp.dot), chain(pm.panel_matmul)
    rng = np.random.default_rng(0)
    print(f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, jax {jax.__version__}; {args.layers} weights "
          f"per chain ({PASSES} passes)")
    print("| projection (K x N) | rows | xla us | panel us | **xla / panel** | xla GFLOP/s | panel GFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    results = []
    for name, (k, n) in SHAPES.items():
        count = 1 if name == "lm_head" else args.layers
        plain = [jnp.asarray(rng.normal(0, k ** -0.5, (k, n)), jnp.float32) for _ in range(count)]
        ordered = [pm.to_panel_order(w) for w in plain]
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.normal(0, 1, (m, k)), jnp.float32)
            np.testing.assert_allclose(np.asarray(xla(x, plain)), np.asarray(panel(x, ordered)), rtol=1e-4,
                                       atol=1e-4, err_msg=f"bench_panel_matmul: {name} at {m} rows")
            t_xla = t_panel = float("inf")
            for _ in range(2):  # alternate, keep each side's best
                t_xla = min(t_xla, best(xla, x, plain, args.repeats))
                t_panel = min(t_panel, best(panel, x, ordered, args.repeats))
            products = PASSES * count
            flops = 2 * m * k * n
            row = {"projection": name, "k": k, "n": n, "rows": m, "xla_us": t_xla / products * 1e6,
                   "panel_us": t_panel / products * 1e6, "xla_over_panel": t_xla / t_panel,
                   "xla_gflops": flops * products / t_xla / 1e9, "panel_gflops": flops * products / t_panel / 1e9}
            results.append(row)
            print(f"| {name} ({k} x {n}) | {m} | {row['xla_us']:.0f} | {row['panel_us']:.0f} | "
                  f"**{row['xla_over_panel']:.2f}** | {row['xla_gflops']:.0f} | {row['panel_gflops']:.0f} |",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "cpus": os.cpu_count(), "jax": jax.__version__,
                       "layers": args.layers, "passes": PASSES, "repeats": args.repeats, "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
