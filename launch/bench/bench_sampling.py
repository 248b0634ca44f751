"""Token sampling per decode step: the project's sampler vs the sort-based top-p and Gumbel-max draw it replaced.

    python launch/bench/bench_sampling.py [--batches 32,128] [--vocab 49152] [--repeats 7] [--json OUT]

For each batch size and two kinds of logits it times one jitted ``sample_tokens`` call (temperature 1, the log-prob
of the drawn token included) with top-p 1.0 and with top-p 0.7, best of ``--repeats``:
* ``peaked``: N(0, 2) logits with 40 tokens raised by 12 (a language model's next-token distribution: the 0.7
  nucleus is a few tokens), so the nucleus is found among the top-k candidates;
* ``flat``: N(0, 0.2) logits, whose nucleus spans most of the vocabulary: the sampler falls back to a full sort.
The baseline (``naive``) is the previous implementation, kept here: ``jnp.sort`` of every row for top-p and
``jax.random.categorical`` (one Gumbel draw per vocabulary entry). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrl_hf.rollout.sampling import sample_tokens  # noqa: E402


def naive_sample(keys: jax.Array, logits: jnp.ndarray, top_p: float) -> tuple[jnp.ndarray, jnp.ndarray]:
    """The replaced sampler: sort-based nucleus filter, Gumbel-max draw, tempered log-prob (temperature 1)."""
    z = logits.astype(jnp.float32)
    if top_p < 1.0:
        sorted_z = jnp.sort(z, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_z, axis=-1)
        keep = jnp.cumsum(probs, axis=-1) - probs < top_p
        cutoff = jnp.min(jnp.where(keep, sorted_z, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(z >= cutoff, z, -jnp.inf)
    tokens = jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logp


def make_logits(kind: str, batch: int, vocab: int) -> jnp.ndarray:
    key = jax.random.key(0)
    if kind == "flat":
        return jax.random.normal(key, (batch, vocab)) * 0.2
    return (jax.random.normal(key, (batch, vocab)) * 2.0).at[:, :40].add(12.0)


def best_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t)
    return best


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="32,128")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(1), jnp.arange(batch))
        for kind in ("peaked", "flat"):
            logits = make_logits(kind, batch, args.vocab)
            for top_p in (1.0, 0.7):
                ours = jax.jit(lambda k, z, p=top_p: sample_tokens(k, z, 1.0, top_p=p, use_top_p=p < 1.0))
                naive = jax.jit(lambda k, z, p=top_p: naive_sample(k, z, p))
                t_ours = best_time(ours, keys, logits, repeats=args.repeats)
                t_naive = best_time(naive, keys, logits, repeats=args.repeats)
                rows.append({"batch": batch, "vocab": args.vocab, "logits": kind, "top_p": top_p,
                             "ours_ms": 1e3 * t_ours, "naive_ms": 1e3 * t_naive, "speedup": t_naive / t_ours})
    print("| batch | logits | top_p | naive ms | ours ms | naive / ours |\n|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['logits']} | {r['top_p']} | {r['naive_ms']:.1f} | {r['ours_ms']:.1f} | "
              f"{r['speedup']:.1f}x |")
    result = {"rows": rows, "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                                        "load_avg": os.getloadavg(), "jax": jax.__version__,
                                        "backend": jax.default_backend()}}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
    return result


if __name__ == "__main__":
    main()
