"""The default DAPO run's update with this checkout's attention and LM-head forms against the forms they replaced,
in one process:

    python launch/bench/bench_update_forms.py [--forms current,session-start] [--batches 2] [--calls 10] [--json OUT]

One worker per form (`_default_update`: SmolLM2-135M's dimensions, bf16 compute over float32 master weights, the
shared prompt packed, two groups of n = 4 samples per optimizer update in one micro-batch, as ``configs/dapo.yaml``),
each compiled on every batch with its form in place; then the calls alternate over the workers (the order rotating
call by call) over ``--batches`` rollout batches of the default run's lengths. One process cancels the 5-10%
that separate processes differ by on this machine. The forms:

    current          this checkout
    attention-5d     the packed update's attention as 5-d contractions (`attention.masked_attention`), not
                     `attention.head_batched_attention`'s matmuls batched over (row, kv head)
    one-part         `packed_attention.per_row_attention` attends to all row slots in one call (no
                     `concurrent_parts`)
    lm-head-f32      the LM head's backward in float32 (`matmul.matmul_f32_accumulate`), not
                     `matmul.lm_head_matmul`'s cotangent split at the scored token
    session-start    all three (the code before 2026-11-28, late night)

The table gives each form's total, median and fastest call, its calls' median ``perf/mfu/actor``, and the ratio of its
total and median to ``current``'s (> 1: current is faster).
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

FORMS = ("current", "attention-5d", "one-part", "lm-head-f32", "session-start")


def patches(form: str) -> list[tuple[object, str, object]]:
    """``(module, name, replacement)`` of ``form``'s older code."""
    from jaxrl_hf.models import attention, logprobs, packed_attention, shared_prompt_attention
    from jaxrl_hf.models.matmul import matmul_f32_accumulate

    def lm_head_f32(x, w, targets, w_transposed=False):  # noqa: ANN001, ANN202
        return matmul_f32_accumulate(x, w, True, False, w_transposed)
    each = {"attention-5d": [(shared_prompt_attention, "head_batched_attention", attention.masked_attention)],
            "one-part": [(packed_attention, "concurrent_parts", lambda rows: 1)],
            "lm-head-f32": [(logprobs, "lm_head_matmul", lm_head_f32)]}
    if form == "session-start":
        return [p for name in ("attention-5d", "one-part", "lm-head-f32") for p in each[name]]
    return each.get(form, [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forms", default="current,session-start")
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    forms = [f for f in args.forms.split(",") if f]
    unknown = [f for f in forms if f not in FORMS]
    if unknown or "current" not in forms:
        parser.error(f"--forms: {unknown or 'current missing'}; choose from {', '.join(FORMS)}, current included")
    import jax
    from _default_update import update_batch, update_mfu, update_worker

    batches = [update_batch(64, 32, seed=seed) for seed in range(1, args.batches + 1)]

    def call(worker, batch) -> float:  # noqa: ANN001
        start = time.perf_counter()
        worker.update_actor(batch)
        jax.block_until_ready(worker.state)
        return time.perf_counter() - start

    workers, summaries = {}, {}
    for form in forms:  # each compiled on every batch with its form in place, the module restored after
        saved = [(module, name, getattr(module, name)) for module, name, _ in patches(form)]
        for module, name, replacement in patches(form):
            setattr(module, name, replacement)
        try:
            workers[form], summaries[form] = update_worker(64, 32, groups_per_update=2, name=f"bench_forms_{form}")
            for batch in batches:
                call(workers[form], batch)
        finally:
            for module, name, original in saved:
                setattr(module, name, original)
    seconds: dict[str, list[float]] = {form: [] for form in forms}
    for i in range(args.calls):
        for form in forms[i % len(forms):] + forms[:i % len(forms)]:
            seconds[form].append(call(workers[form], batches[i % len(batches)]))
    total = {form: sum(s) for form, s in seconds.items()}
    median = {form: statistics.median(s) for form, s in seconds.items()}
    mfu = {form: statistics.median(update_mfu(batches[i % len(batches)], summaries[form], t)
                                   for i, t in enumerate(seconds[form])) for form in forms}
    print(f"update_actor, 2 groups of 4 samples per update, 2 updates a call, {len(batches)} batches, "
          f"{args.calls} alternating calls a form, {os.cpu_count()} CPUs")
    print("| form | total s | median s | fastest s | perf/mfu/actor median | this / current (total) | "
          "this / current (median) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for form in forms:
        print(f"| {form} | {total[form]:.2f} | {median[form]:.3f} | {min(seconds[form]):.3f} | {mfu[form]:.3f} | "
              f"{total[form] / total['current']:.3f}x | {median[form] / median['current']:.3f}x |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpus": os.cpu_count(), "args": vars(args), "seconds": seconds, "total_s": total,
                       "median_s": median, "mfu": mfu}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
