"""The bf16 training projections' weight gradient: XLA:CPU's dot against the pair kernel (`models.pair_matmul`), by
row count:

    python launch/bench/bench_pair_matmul.py [--rows 64,128,256] [--layers 30] [--repeats 5] [--json OUT]

For each ``K x N`` of SmolLM2-135M's projections, ``--layers`` distinct layers in one jitted program, as the
update's layers:

* ``dW``: the weight gradients alone, ``xᵀ · ∂y`` of bf16 ``[M, K]`` and ``[M, N]`` into float32 (``xla``:
  ``dot_general`` with float32 accumulation, which XLA:CPU upcasts to a float32 dot; ``pair``:
  `pair_matmul.weight_gradient`);
* ``fwd+bwd``: the gradient of a chain ``x <- x + tanh(x · W_i)[:, :K] / 1000`` over float32 master weights
  (`models.matmul.matmul_f32_accumulate`, ``pair_kernel`` off / on: the same forward and ∂x, ∂W in the kernel).

Both sides alternate, best of ``--repeats`` calls each; GFLOP/s counts 2·M·K·N per product (1 for ``dW``, 3 for
``fwd+bwd``), and ``xla / pair`` > 1 means the kernel is faster. The gradients are checked against each other
(relative 1e-2: bf16 activations, float32 sums in another order).
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
from jaxrl_hf.models import pair_matmul as pm  # noqa: E402
from jaxrl_hf.models.matmul import matmul_f32_accumulate  # noqa: E402

SHAPES = {"q_proj / o_proj": (576, 576), "k_proj / v_proj": (576, 192), "gate_proj / up_proj": (576, 1536),
          "down_proj": (1536, 576)}
SIDES = ("xla", "pair")
TN = (((0,), (0,)), ((), ()))


def chain(pair: bool, x: jax.Array, weights: list[jax.Array]) -> jax.Array:
    h = x
    for w in weights:
        y = matmul_f32_accumulate(h, w, False, pair)[:, :h.shape[1]].astype(jnp.float32)
        h = h + (jnp.tanh(jnp.pad(y, ((0, 0), (0, h.shape[1] - y.shape[1])))) * 1e-3).astype(h.dtype)
    return h


def programs(pair: bool):
    """``(dW alone, fwd+bwd)`` of one side."""
    if pair:
        dw = jax.jit(lambda xs, dys: [pm.weight_gradient(x, dy) for x, dy in zip(xs, dys)])
    else:
        dw = jax.jit(lambda xs, dys: [jax.lax.dot_general(x, dy, TN, preferred_element_type=jnp.float32)
                                      for x, dy in zip(xs, dys)])
    grad = jax.jit(jax.grad(lambda x, ws: chain(pair, x, ws).astype(jnp.float32).sum(), argnums=(0, 1)))
    return dw, grad


def best(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="64,128,256")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not cpu_kernels.bf16_pairs():
        sys.exit("the pair kernel does not run here (needs x86-64 AVX512-BF16 and g++; JAXRL_HF_CPU_KERNELS not 0)")
    rs = np.random.RandomState(0)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{'projection':20s} {'rows':>5s} {'pass':8s} {'xla ms':>8s} {'pair ms':>8s} {'xla GF/s':>9s} "
          f"{'pair GF/s':>9s} {'xla/pair':>8s}")
    progs = {side: programs(side == "pair") for side in SIDES}
    for name, (k, n) in SHAPES.items():
        weights = [jnp.asarray(rs.randn(k, n) * k ** -0.5, jnp.float32) for _ in range(args.layers)]
        for m in rows_list:
            x = jnp.asarray(rs.randn(m, k), jnp.bfloat16)
            xs = [jnp.asarray(rs.randn(m, k), jnp.bfloat16) for _ in range(args.layers)]
            dys = [jnp.asarray(rs.randn(m, n), jnp.bfloat16) for _ in range(args.layers)]
            inputs = {"dW": (xs, dys), "fwd+bwd": (x, weights)}
            for which, index, products in (("dW", 0, 1), ("fwd+bwd", 1, 3)):
                outs = [jax.tree.leaves(progs[side][index](*inputs[which])) for side in SIDES]
                for ref, got in zip(*outs):
                    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
                    if np.abs(got - ref).max() > 1e-2 * max(np.abs(ref).max(), 1e-6):
                        sys.exit(f"{name} at {m} rows ({which}): the pair kernel's result differs from XLA's")
                times = {side: [] for side in SIDES}
                for _ in range(2):  # alternate the sides
                    for side in SIDES:
                        times[side].append(best(progs[side][index], *inputs[which], repeats=args.repeats))
                t = {side: min(v) for side, v in times.items()}
                flops = 2.0 * m * k * n * products * args.layers
                row = {"projection": name, "k": k, "n": n, "rows": m, "pass": which,
                       **{f"{side}_ms": t[side] * 1e3 for side in SIDES},
                       **{f"{side}_gflops": flops / t[side] / 1e9 for side in SIDES},
                       "xla_over_pair": t["xla"] / t["pair"]}
                results.append(row)
                print(f"{name:20s} {m:5d} {which:8s} {row['xla_ms']:8.2f} {row['pair_ms']:8.2f} "
                      f"{row['xla_gflops']:9.0f} {row['pair_gflops']:9.0f} {row['xla_over_pair']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "repeats": args.repeats, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
