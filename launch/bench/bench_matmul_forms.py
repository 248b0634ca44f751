"""The three matmul forms of one projection in a training step, at the update's shapes, float32 vs bfloat16:

    python launch/bench/bench_matmul_forms.py [--tokens 1536] [--repeats 10] [--json OUT]

For ``x [M, K] · W [K, N]`` (M = rows × tokens of a micro-batch; the ``K, N`` pairs of SmolLM2-135M's projections):
- ``forward``  ``x · W``        (contracts x's last dimension),
- ``input grad`` ``∂y · Wᵀ``     (contracts both last dimensions),
- ``weight grad`` ``xᵀ · ∂y``    (contracts both *first* dimensions),
each jitted alone with f32 accumulation (``preferred_element_type=float32``, as `models/matmul.py`), best of
``--repeats`` calls, in GFLOP/s. ``upcast`` says whether XLA converted the bf16 operands to float32 before the dot
(a ``convert`` of an operand in the compiled HLO): then the bf16 form runs at the float32 rate.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

FORMS = {
    "forward": ((((1,), (0,)), ((), ())), lambda m, k, n: ((m, k), (k, n))),
    "input grad": ((((1,), (1,)), ((), ())), lambda m, k, n: ((m, n), (k, n))),
    "weight grad": ((((0,), (0,)), ((), ())), lambda m, k, n: ((m, k), (m, n))),
}
SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576))


def rate(dims, shapes, dtype, repeats: int) -> tuple[float, bool]:
    """GFLOP/s of the best call, and whether the compiled program converts an operand to float32."""
    a, b = (jnp.ones(s, dtype) for s in shapes)
    fn = jax.jit(lambda a, b: jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32))
    upcast = dtype != jnp.float32 and "convert" in fn.lower(a, b).compile().as_text()
    jax.block_until_ready(fn(a, b))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(a, b))
        best = min(best, time.perf_counter() - start)
    out = jax.eval_shape(fn, a, b).shape
    contracted = shapes[0][dims[0][0][0]]
    return 2 * out[0] * out[1] * contracted / best / 1e9, upcast


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1536, help="M: rows x tokens of a micro-batch (16 x 96)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    rows = []
    print(f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs, jax {jax.__version__}, M = {args.tokens}")
    print("| K x N | form | float32 GFLOP/s | bfloat16 GFLOP/s | bf16 upcast to f32 |")
    print("|---|---|---:|---:|---|")
    for k, n in SHAPES:
        for form, (dims, make) in FORMS.items():
            shapes = make(args.tokens, k, n)
            f32, _ = rate(dims, shapes, jnp.float32, args.repeats)
            bf16, upcast = rate(dims, shapes, jnp.bfloat16, args.repeats)
            rows.append({"k": k, "n": n, "form": form, "float32": f32, "bfloat16": bf16, "upcast": upcast})
            print(f"| {k} x {n} | {form} | {f32:.0f} | {bf16:.0f} | {'yes' if upcast else 'no'} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "jax": jax.__version__, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
