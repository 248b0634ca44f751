"""The float32 decode step's kernels (`backends.cpu.ffi`) against XLA:CPU's ops, by row count:

    python launch/bench/bench_cpu_kernels.py [--rows 1,4,16,32,64,128] [--slots 72,168] [--layers 30]
                                             [--repeats 5] [--json OUT]

**Projections.**
For each ``K x N`` of SmolLM2-135M's decode step (its q/o, k/v, gate/up and down projections and its LM head),
a jitted loop of five passes over a chain of ``--layers`` distinct weights (one weight for the LM head) computes
``x <- x + tanh(x · W_i)[:, :K] / 1000`` (zero columns appended where ``N < K``), as a decode step does: each
product needs the one before, and the weights (106 MB for 30 gate projections) stream from memory as the step's
weights do. ``xla``: ``jnp.dot(x, W)``;
``panel``: ``panel_matmul(x, to_panel_order(W))`` (the order made once, outside the timing). Both sides alternate
twice, best of ``--repeats`` calls each, as microseconds per product; ``xla / panel`` > 1 means the kernel is
faster. The two loops' results are checked equal to float32 summation error.

**Attention** over a stored cache (`attention.stored_attention`: SmolLM2-135M's 3 kv heads of 3 queries, head_dim
64, keys stored transposed), at ``--slots`` cache slots (the decode phases' 72-168 at 64 x 128): a chain over
``--layers`` distinct caches, ``q <- q + attention(q, cache_i) / 100``; ``xla``: the two batched products and the
softmax as XLA runs them, ``kernel``: `ffi.cache_attention`. GB/s: the keys and values read per call
over its time.
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
from jaxrl_hf.backends.cpu import ffi  # noqa: E402
from jaxrl_hf.backends.cpu import panel_matmul as pm  # noqa: E402
from jaxrl_hf.models.attention import NEG_INF, _cache_scores, _cache_weighted_values  # noqa: E402

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


def best(fn, *args, repeats: int) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return min(times)


def attention_table(rng: np.random.Generator, rows: list[int], slots: list[int], layers: int,
                    repeats: int) -> list[dict]:
    k, g, d = 3, 3, 64
    print("\n| attention (rows x slots) | xla us | kernel us | **xla / kernel** | xla GB/s | kernel GB/s |")
    print("|---|---:|---:|---:|---:|---:|")

    def xla(q, cache, mask):
        scores = jnp.where(mask[:, None, None], _cache_scores(q, cache, d ** -0.5, None), NEG_INF)
        return _cache_weighted_values(jax.nn.softmax(scores, axis=-1), cache)

    def kernel(q, cache, mask):
        return ffi.cache_attention(q, cache["kt"], cache["v"], mask, d ** -0.5)

    def chain(attend):
        def run(q, caches, mask):
            def one_pass(_, h):
                for cache in caches:
                    h = h + attend(h, cache, mask) * 1e-2
                return h
            return jax.lax.fori_loop(0, PASSES, one_pass, q)
        return jax.jit(run)

    results = []
    for m in rows:
        for s in slots:
            caches = [{"kt": jnp.asarray(rng.normal(0, 1, (m, k, d, s)), jnp.float32),
                       "v": jnp.asarray(rng.normal(0, 1, (m, k, s, d)), jnp.float32)} for _ in range(layers)]
            mask = jnp.asarray(np.arange(s)[None, None, :] < s - np.arange(m)[:, None, None] % 7)  # left padding
            q = jnp.asarray(rng.normal(0, 1, (m, 1, k, g, d)), jnp.float32)
            np.testing.assert_allclose(np.asarray(chain(xla)(q, caches, mask)),
                                       np.asarray(chain(kernel)(q, caches, mask)), rtol=1e-4, atol=1e-4)
            t_xla = t_kernel = float("inf")
            for _ in range(2):
                t_xla = min(t_xla, best(chain(xla), q, caches, mask, repeats=repeats))
                t_kernel = min(t_kernel, best(chain(kernel), q, caches, mask, repeats=repeats))
            calls, read = PASSES * layers, 2 * m * k * s * d * 4
            row = {"rows": m, "slots": s, "xla_us": t_xla / calls * 1e6, "kernel_us": t_kernel / calls * 1e6,
                   "xla_over_kernel": t_xla / t_kernel, "xla_gbs": read * calls / t_xla / 1e9,
                   "kernel_gbs": read * calls / t_kernel / 1e9}
            results.append(row)
            print(f"| {m} x {s} | {row['xla_us']:.0f} | {row['kernel_us']:.0f} | **{row['xla_over_kernel']:.2f}** | "
                  f"{row['xla_gbs']:.1f} | {row['kernel_gbs']:.1f} |", flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,4,16,32,64,128")
    parser.add_argument("--slots", default="72,168")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not ffi.available():
        raise SystemExit("bench_cpu_kernels: the kernels are unavailable here (x86-64 with AVX-512 and "
                         "g++ needed)")
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
                                       atol=1e-4, err_msg=f"bench_cpu_kernels: {name} at {m} rows")
            t_xla = t_panel = float("inf")
            for _ in range(2):  # alternate, keep each side's best
                t_xla = min(t_xla, best(xla, x, plain, repeats=args.repeats))
                t_panel = min(t_panel, best(panel, x, ordered, repeats=args.repeats))
            products = PASSES * count
            flops = 2 * m * k * n
            row = {"projection": name, "k": k, "n": n, "rows": m, "xla_us": t_xla / products * 1e6,
                   "panel_us": t_panel / products * 1e6, "xla_over_panel": t_xla / t_panel,
                   "xla_gflops": flops * products / t_xla / 1e9, "panel_gflops": flops * products / t_panel / 1e9}
            results.append(row)
            print(f"| {name} ({k} x {n}) | {m} | {row['xla_us']:.0f} | {row['panel_us']:.0f} | "
                  f"**{row['xla_over_panel']:.2f}** | {row['xla_gflops']:.0f} | {row['panel_gflops']:.0f} |",
                  flush=True)
    attention = attention_table(rng, [int(r) for r in args.rows.split(",")], [int(s) for s in args.slots.split(",")],
                                args.layers, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "cpus": os.cpu_count(), "jax": jax.__version__,
                       "layers": args.layers, "passes": PASSES, "repeats": args.repeats, "results": results,
                       "attention": attention}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
