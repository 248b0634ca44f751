"""The actor update on rollout-like rows of varying length: padded rows vs packed sequences
(``model.use_remove_padding``), with attention over each packed row or over the whole packed sequence.

    python launch/bench/bench_packed_update.py [--shape smollm2-135m|qwen2.5-1.5b] [--rounds 2] [--json OUT]

The real ``ActorRolloutRefWorker.update_actor`` (in-process, no Ray) on a random model of the shape's real
dimensions, bf16 compute with float32 master weights, rows as a rollout lays them out: left-padded prompts of
``P/2 .. P`` tokens, right-padded responses of ``R/4 .. R`` (seeded, the same rows for every variant). Variants,
each in a fresh process, the order rotated every round:

* ``padded``: ``[rows, P + R]`` micro-batches (the baseline);
* ``packed``: each micro-batch's rows packed into one sequence of `packing.static_length` tokens, attention one
  row at a time (`jaxrl_hf.models.attention.per_row_attention`, where it computes no more scores);
* ``packed-whole``: the same packed sequences, attention over the whole sequence (the previous behaviour; on a
  GPU, packed segments keep cuDNN out and run the blockwise kernel);
* ``packed-budget``: packed sequences of a token budget (verl's ``use_dynamic_bsz`` +
  ``ppo_max_token_len_per_gpu`` = ``micro · (P + R)``, the padded micro-batch's size), attention per row.

Per variant: the first call (compile + step), the median of ``--repeats`` more, real (non-padding) tokens per
second, model FLOPs over real tokens per second (`trainer.metrics.actor_update_flops`) and their share of the
measured matmul peak (`workers.peak_flops`), the device's peak memory where it reports one, and the step's
``actor/pg_loss`` (equal across variants up to bf16 summation order).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ("padded", "packed", "packed-whole", "packed-budget")
SHAPES = {  # the default DAPO run's model and rows; a Qwen2.5-1.5B-like model at 1k-token rows (GPU)
    "smollm2-135m": {"model": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                                   num_heads=9, num_kv_heads=3, max_position_embeddings=2048,
                                   tie_word_embeddings=True),
                     "rows": 16, "mini": 4, "micro": 4, "prompt": 64, "response": 32, "scan_layers": False},
    "qwen2.5-1.5b": {"model": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
                                   num_heads=12, num_kv_heads=2, max_position_embeddings=4096,
                                   tie_word_embeddings=True),
                     "rows": 16, "mini": 16, "micro": 4, "prompt": 512, "response": 512, "scan_layers": True},
}


def rollout_rows(shape: dict, vocab: int, seed: int = 0):
    """Left-padded prompts of P/2..P tokens, right-padded responses of R/4..R, advantages +-1 per row."""
    import numpy as np

    from jaxrl_hf.controller import Batch

    rows, p, r = shape["rows"], shape["prompt"], shape["response"]
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(p // 2, p + 1, rows)
    response_len = rng.integers(max(r // 4, 1), r + 1, rows)
    cols = np.arange(p + r)[None]
    mask = ((cols >= p - prompt_len[:, None]) & (cols < p + response_len[:, None])).astype(np.int32)
    ids = np.where(mask, rng.integers(3, vocab, (rows, p + r)), 0).astype(np.int32)
    response_mask = mask[:, p:].astype(np.float32)
    adv = np.where(np.arange(rows)[:, None] % 2 == 0, 1.0, -1.0).astype(np.float32) * response_mask
    return Batch.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32),
        "responses": ids[:, p:], "response_mask": response_mask,
        "old_log_probs": np.full((rows, r), -float(np.log(vocab)), np.float32), "advantages": adv,
    }, meta_info={"global_step": 0}), mask.sum(1)


def build(shape_name: str, variant: str):
    """``(worker, batch, real lengths [rows], init info)``: the actor worker of ``variant`` and its rows."""
    from _gpu_update import worker_config
    from jaxrl_hf.controller.worker import WorkerContext
    from jaxrl_hf.workers import ActorRolloutRefWorker, packed_forward

    if variant == "packed-whole":
        packed_forward.per_row_attention_pays = lambda rows, width, length: False
    shape = SHAPES[shape_name]
    config = worker_config(shape, "bf16-auto-none", None)
    config["model"].update(use_remove_padding=variant != "padded", scan_layers=shape["scan_layers"])
    config["actor"]["ppo_mini_batch_size"] = shape["mini"]
    if variant == "packed-budget":
        budget = shape["micro"] * (shape["prompt"] + shape["response"])
        config["actor"].update(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget)
    worker = ActorRolloutRefWorker._instantiate(WorkerContext("actor", "bench_packed_update", 0, 1),
                                                (copy.deepcopy(config), "actor_rollout"), {})
    info = worker.init_model()
    return (worker, *rollout_rows(shape, worker.model.config.vocab_size), info)


def run_variant(shape_name: str, variant: str, repeats: int) -> dict:
    import jax
    import numpy as np

    from _gpu_update import device_memory
    from jaxrl_hf.trainer.metrics import actor_update_flops

    worker, batch, lengths, info = build(shape_name, variant)
    metrics: dict = {}

    def update() -> float:
        t = time.perf_counter()
        result = worker.update_actor(batch)
        jax.block_until_ready(worker.state)
        metrics.update({k: float(v) for k, v in result.meta_info["metrics"].items()
                        if isinstance(v, (int, float, np.floating))})
        return time.perf_counter() - t

    first = update()
    times = [update() for _ in range(repeats)]
    step = statistics.median(times)
    flops = actor_update_flops(lengths, int(info["model_params"]), int(info["num_layers"]), int(info["attn_dim"]), 1)
    peak = info.get("peak_flops_per_device")
    return {"variant": variant, "first_call_s": first, "step_s": times, "step_s_median": step,
            "real_tokens": int(lengths.sum()), "padded_tokens": int(batch["attention_mask"].size),
            "real_tokens_per_s": float(lengths.sum()) / step, "model_flops_per_s": flops / step,
            "mfu": flops / step / peak if peak else None, "peak_flops_per_device": peak,
            "pg_loss": metrics.get("actor/pg_loss"), "padding_ratio": metrics.get("actor/padding_ratio"),
            "memory": device_memory(), "device": str(jax.devices()[0].device_kind)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_variant(args.shape, args.child, args.repeats)), flush=True)
        return 0
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; valid: {', '.join(VARIANTS)}")
    results = []
    for round_ in range(args.rounds):
        for variant in variants[round_ % len(variants):] + variants[:round_ % len(variants)]:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--shape", args.shape, "--repeats",
                                   str(args.repeats), "--child", variant], capture_output=True, text=True)
            lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode or not lines:
                print(f"{variant} (round {round_ + 1}) failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            results.append({"round": round_ + 1, **json.loads(lines[-1][len("RESULT "):])})
            r = results[-1]
            print(f"round {r['round']} {variant:13s} first {r['first_call_s']:6.1f}s  step {r['step_s_median']:.3f}s  "
                  f"real tok/s {r['real_tokens_per_s']:9.0f}  mfu {r['mfu'] or float('nan'):.3f}  "
                  f"pg_loss {r['pg_loss']:.6f}", flush=True)
    base = {r["round"]: r["step_s_median"] for r in results if r["variant"] == "padded"}
    print(f"\n{'variant':13s} round  step s  vs padded  real tok/s   mfu   padding_ratio")
    for r in results:
        ratio = base[r["round"]] / r["step_s_median"] if r["round"] in base else float("nan")
        pad = r["padding_ratio"] if r["padding_ratio"] is not None else 1 - r["real_tokens"] / r["padded_tokens"]
        print(f"{r['variant']:13s} {r['round']:5d}  {r['step_s_median']:6.3f}  {ratio:8.2f}x  {r['real_tokens_per_s']:10.0f}  "
              f"{r['mfu'] or float('nan'):.3f}  {pad:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shape": args.shape, "config": SHAPES[args.shape], "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
