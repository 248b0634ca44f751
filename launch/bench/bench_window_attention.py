"""Blockwise attention with a sliding window: what the compiled program costs, with and without the window.

    python launch/bench/bench_window_attention.py [--tokens 4096 --window 512 --block 512 --repeats 7] [--json OUT]

For the forward and the forward + backward (`jaxrl_hf.models.attention.blockwise_attention`, float32, one row,
2 kv heads x 2 query groups, head_dim 64) at ``window`` 0 (no window: every causal tile) and ``--window``:
- ``cost_analysis`` flops of ``jax.jit(...).lower(...).compile()`` (XLA counts a while loop's body once,
  whatever its trip count, so this number cannot see how many tiles run; reported to show it);
- the tiles computed, counted by a host callback in each tile of the compiled program, and the matmul flops
  they imply (a forward tile: ``q k^T`` and ``p v``; a backward tile: ``q k^T``, ``dp``, ``dv``, ``dk``, ``dq``);
- the best of ``--repeats`` timed calls.
Run from an older checkout (``PYTHONPATH=<checkout> python <this file>``), it measures that checkout's code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_hf.models import attention as attn  # noqa: E402

KV_HEADS, GROUPS, HEAD_DIM = 2, 2, 64


def measure(tokens: int, window: int, block: int, repeats: int) -> dict:
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, tokens, KV_HEADS, GROUPS, HEAD_DIM)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, tokens, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in range(2))
    seg = jnp.ones((1, tokens), jnp.int32)

    def loss(q, k, v, w):
        return jnp.sum(attn.blockwise_attention(q, k, v, seg, HEAD_DIM ** -0.5, block, block, w) ** 2)

    programs = {"forward": lambda q, k, v, w: attn.blockwise_attention(q, k, v, seg, HEAD_DIM ** -0.5, block, block, w),
                "forward+backward": jax.grad(loss, argnums=(0, 1, 2))}
    tile_flops = 2 * block * block * HEAD_DIM * KV_HEADS * GROUPS  # one [block, block, head_dim] matmul, all heads
    out = {}
    for name, fn in programs.items():
        w = jnp.int32(window)
        compiled = jax.jit(fn).lower(q, k, v, w).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        jax.block_until_ready(compiled(q, k, v, w))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v, w))
            times.append(time.perf_counter() - start)
        tiles = count_tiles(fn, q, k, v, w)
        # forward + backward: half the tiles are the forward's (2 matmuls each), half the backward's (5 each)
        matmuls = 2 * tiles if name == "forward" else 7 * tiles // 2
        out[name] = {"cost_analysis_flops": float(cost["flops"]), "tiles": tiles,
                     "tile_matmul_flops": float(matmuls * tile_flops), "best_s": min(times)}
    return out


def count_tiles(fn, *args) -> int:
    """Tiles the compiled ``fn`` computes: one host callback per call of the tile's score function."""
    calls = []
    original = attn._block_scores

    def counting(*a, **kw):
        jax.debug.callback(lambda: calls.append(1))
        return original(*a, **kw)

    attn._block_scores = counting
    try:
        jax.block_until_ready(jax.jit(lambda *a: fn(*a))(*args))  # a fresh trace sees the patched function
    finally:
        attn._block_scores = original
    return len(calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--block", type=int, default=attn.DEFAULT_BLOCK_SIZE)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = {"tokens": args.tokens, "block": args.block, "jax": jax.__version__, "load_average": os.getloadavg(),
              "windows": {}}
    for window in (0, args.window):
        result["windows"][window] = measure(args.tokens, window, args.block, args.repeats)
        for name, row in result["windows"][window].items():
            print(f"window {window:5d} {name:17s} cost_analysis {row['cost_analysis_flops']:.3e} flops | tiles "
                  f"{row['tiles']:4d} ({row['tile_matmul_flops']:.3e} matmul flops) | best {row['best_s']:.3f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
