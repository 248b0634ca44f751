"""The actor's update and native generation, with the decoder layers scanned or unrolled, in float32 and bfloat16.

    python launch/bench/bench_layer_loop.py [--rows 16 --tokens 96 --gen-rows 16 --gen-new 64] [--json OUT]

For each of (float32, bfloat16) × (``model.scan_layers`` true, false) on the same weights (SmolLM2-135M by default):
- update: one jitted forward + backward of the token log-likelihood over ``[rows, tokens]`` (the shape of the
  default DAPO run's update micro-batch), compile seconds and the best of ``--repeats`` timed calls, with the
  model FLOPs of ``trainer/metrics.actor_update_flops`` over the measured matmul peak of that dtype
  (``workers/peak_flops.py``): the MFU the run's ``perf/mfu/actor`` would report for a pure update;
- generate: ``JaxGenerationEngine`` greedy decoding of ``gen-new`` tokens for ``gen-rows`` prompts (tok/s).
The peer is the previous default, float32 with the layers scanned: each row's ratio is against it, in this run.
Run from an older checkout (``PYTHONPATH=<checkout> python <this file>``), it times that checkout's model code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def time_update(config, params, rows: int, tokens: int, repeats: int) -> dict:
    from jaxrl_hf.models.forward import next_token_targets, token_log_probs_and_entropy

    ids = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (rows, tokens)), jnp.int32)
    mask = jnp.ones_like(ids)

    def loss(p):
        logp, _ = token_log_probs_and_entropy(p, config, ids, next_token_targets(ids), mask, with_entropy=False)
        return -logp.mean()

    step = jax.jit(jax.value_and_grad(loss))
    start = time.perf_counter()
    compiled = step.lower(params).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(params))
    return {"compile_s": compile_s, "seconds": best_of(lambda: compiled(params), repeats)}


def time_generation(config, params, tokenizer, rows: int, new: int, repeats: int) -> dict:
    from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams

    engine = JaxGenerationEngine(config, params, pad_token_id=tokenizer.pad_token_id or 0,
                                 eos_token_ids=())
    prompts = [list(np.random.RandomState(i).randint(100, 1000, 24)) for i in range(rows)]
    sampling = SamplingParams(max_new_tokens=new, greedy=True)
    start = time.perf_counter()
    engine.generate(prompts, sampling)
    first_s = time.perf_counter() - start
    seconds = best_of(lambda: engine.generate(prompts, sampling).response_ids, repeats)
    return {"first_call_s": first_s, "seconds": seconds, "tok_per_s": rows * new / seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--gen-rows", type=int, default=16)
    parser.add_argument("--gen-new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-generation", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from jaxrl_hf.models import load_pretrained
    from jaxrl_hf.trainer.metrics import actor_update_flops
    from jaxrl_hf.workers.peak_flops import peak_flops_per_device

    rows = []
    for dtype in ("float32", "bfloat16"):
        lm = load_pretrained(args.model, dtype=dtype)
        matmul_params = sum(x.size for x in jax.tree.leaves(lm.params))
        if not lm.config.tie_word_embeddings:
            matmul_params -= lm.config.vocab_size * lm.config.hidden_size
        flops = actor_update_flops(np.full(args.rows, args.tokens), matmul_params, lm.config.num_hidden_layers,
                                   lm.config.num_attention_heads * lm.config.head_dim, 1)
        peak = peak_flops_per_device(dtype=dtype) * jax.local_device_count()
        # a checkout from before model.scan_layers existed (for before/after tables) has only the layer loop
        for scan in ((True, False) if hasattr(lm.config, "scan_layers") else (True,)):
            config = dataclasses.replace(lm.config, scan_layers=scan) if scan is False else lm.config
            row = {"dtype": dtype, "scan_layers": scan, "update": time_update(config, lm.params, args.rows,
                                                                             args.tokens, args.repeats)}
            row["update"]["mfu"] = flops / row["update"]["seconds"] / peak
            row["update"]["peak_flops"] = peak
            if not args.skip_generation:
                row["generate"] = time_generation(config, lm.params, lm.tokenizer, args.gen_rows, args.gen_new,
                                                  args.repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = rows[0]
    print(f"\nmachine: {platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__} {jax.default_backend()}; "
          f"model {args.model}; update [{args.rows},{args.tokens}], generation {args.gen_rows} x {args.gen_new} new")
    print(f"{'dtype':9} {'layers':8} {'compile s':>9} {'update s':>9} {'vs base':>8} {'MFU':>6} "
          f"{'gen tok/s':>10} {'vs base':>8}")
    for r in rows:
        u, g = r["update"], r.get("generate")
        gen = (f"{g['tok_per_s']:10.1f} {g['tok_per_s'] / base['generate']['tok_per_s']:8.2f}" if g else "")
        print(f"{r['dtype']:9} {'scanned' if r['scan_layers'] else 'unrolled':8} {u['compile_s']:9.1f} "
              f"{u['seconds']:9.2f} {base['update']['seconds'] / u['seconds']:8.2f} {u['mfu']:6.3f} {gen}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rows": rows, "jax": jax.__version__, "cpus": os.cpu_count()}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
