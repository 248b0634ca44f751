"""Where a native decode step's time goes: one jitted step of ``CausalLM`` at batch B, with no KV cache
(weights + FLOPs only) vs with a static KV cache of S slots (cache donated, updated each call).

The layer scan only reads the cache and returns the step's new keys/values; ``CausalLM.hidden_states``
writes them with one in-place ``dynamic_update_slice`` (as the engine's decode loop does), so the
with-cache overhead is reading the cache once, not copying it per layer.

  python launch/bench/profile_decode_step.py --batch 64 --cache-lens 32,192 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial

import jax
import jax.numpy as jnp

from jaxrl_hf.models import load_pretrained
from jaxrl_hf.models.forward import make_module
from jaxrl_hf.models.llama import CausalLM, init_kv_cache


def best_time(fn, repeats: int = 3) -> float:
    """Best wall time of ``fn()`` (blocked) over ``repeats`` calls after one warm-up call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--cache-lens", default="32,192", help="comma-separated KV cache lengths")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per case (the best is reported)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lm = load_pretrained(args.model)
    module = make_module(lm.config, None, None)
    b = args.batch
    tokens, positions = jnp.ones((b, 1), jnp.int32), jnp.full((b, 1), 40, jnp.int32)

    @jax.jit
    def step_no_cache(params):
        h, _ = module.apply({"params": params}, tokens, positions, jnp.ones((b, 1), jnp.int32), None, 0,
                            method=CausalLM.hidden_states)
        return module.apply({"params": params}, h, method=CausalLM.logits_from_hidden)

    result = {"batch": b, "repeats": args.repeats, "with_cache_s": {},
              "no_cache_s": best_time(lambda: step_no_cache(lm.params), args.repeats)}
    for s_len in (int(x) for x in args.cache_lens.split(",")):
        state = {"cache": init_kv_cache(lm.config, b, s_len, "float32")}
        mask = jnp.ones((b, s_len), jnp.int32)

        @partial(jax.jit, donate_argnums=1)
        def step(params, cache, mask=mask, s_len=s_len):
            h, new_cache = module.apply({"params": params}, tokens, positions, mask, cache, s_len - 2,
                                        method=CausalLM.hidden_states)
            return module.apply({"params": params}, h, method=CausalLM.logits_from_hidden), new_cache

        def run(step=step, state=state):
            logits, state["cache"] = step(lm.params, state["cache"])
            return logits

        result["with_cache_s"][s_len] = best_time(run, args.repeats)
    print(f"batch {b}: step without cache {result['no_cache_s']:.3f} s; with cache: "
          + ", ".join(f"S={s} {t:.3f} s" for s, t in result["with_cache_s"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
