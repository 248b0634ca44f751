"""The actor update with each layer's gradient handed to the fused optimizer as it was made (`workers.fused_adamw`,
``FusedClipAdamW.layers``) against the stacked gradients (``JAXRL_HF_PER_LAYER_GRADS=0``: every stacked weight's
``[layers, ...]`` gradient concatenated first), on the default DAPO run's update:

    python launch/bench/bench_update_grads.py [--calls 8] [--prompt 64] [--response 32] [--json OUT]

SmolLM2-135M's dimensions (random weights), bfloat16 compute over float32 master weights, layers unrolled, one group
of 4 samples per optimizer update (``ppo_mini_batch_size: 1``), 4 groups per ``update_actor`` call (4 updates),
prompts left-padded to ``--prompt`` columns and responses right-padded to ``--response`` (lengths drawn per group /
sample as a rollout lays them out). Both workers live in one process and their calls alternate (the first call of
each, the compilation, is left out); the table gives the median and fastest call per variant and the ratio of the
medians (> 1: per-layer gradients are faster), and checks that both end with the same loss.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                    num_kv_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)
VARIANTS = {"stacked": "0", "per_layer": "1"}  # JAXRL_HF_PER_LAYER_GRADS


def actor_worker(prompt: int, response: int, per_layer: str):
    from _gpu_update import worker_config
    from jaxrl_hf.controller.worker import WorkerContext
    from jaxrl_hf.workers import ActorRolloutRefWorker
    from jaxrl_hf.workers.fused_adamw import PER_LAYER_ENV

    config = worker_config({"model": SMOLLM2_135M, "rows": 16, "micro": 4, "prompt": prompt, "response": response},
                           "bf16-auto-none", None)
    config["model"]["scan_layers"] = False
    config["actor"].update(ppo_mini_batch_size=1, clip_ratio_low=0.2, clip_ratio_high=0.28, loss_agg_mode="token-mean")
    config["rollout"]["n"] = 4
    os.environ[PER_LAYER_ENV] = per_layer  # read when the update program is built
    worker = ActorRolloutRefWorker._instantiate(WorkerContext("actor", "bench_update_grads", 0, 1),
                                                (copy.deepcopy(config), "actor_rollout"), {})
    worker.init_model()
    return worker


def rollout_batch(prompt: int, response: int):
    import numpy as np

    from bench_shared_prompt import grouped_rows
    from jaxrl_hf.controller import Batch

    ids, mask, positions, valid = grouped_rows(4, 4, prompt, response, SMOLLM2_135M["vocab_size"], seed=1)
    adv = np.random.default_rng(0).standard_normal((16, 1)).astype(np.float32) * valid
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                            "responses": ids[:, prompt:], "response_mask": valid, "advantages": adv,
                            "old_log_probs": np.full((16, response), -3.0, np.float32)}, meta_info={"global_step": 0})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import jax

    batch = rollout_batch(args.prompt, args.response)
    workers = {name: actor_worker(args.prompt, args.response, flag) for name, flag in VARIANTS.items()}
    seconds: dict[str, list[float]] = {name: [] for name in workers}
    losses: dict[str, float] = {}

    def call(name: str) -> float:
        start = time.perf_counter()
        out = workers[name].update_actor(batch)
        jax.block_until_ready(workers[name].state)
        losses[name] = float(out.meta_info["metrics"]["actor/pg_loss"])
        return time.perf_counter() - start

    first = {name: call(name) for name in workers}
    for i in range(args.calls):
        for name in (list(workers) if i % 2 == 0 else list(workers)[::-1]):
            seconds[name].append(call(name))
    median = {name: statistics.median(s) for name, s in seconds.items()}
    ratio = median["stacked"] / median["per_layer"]
    print(f"actor update_actor (4 optimizer updates), SmolLM2-135M dims, bf16, P={args.prompt}, R={args.response}, "
          f"{jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; {args.calls} alternating calls each")
    print("| gradients | first call s | median s | fastest s | last pg_loss |")
    print("|---|---:|---:|---:|---:|")
    for name in workers:
        print(f"| {name} | {first[name]:.1f} | {median[name]:.3f} | {min(seconds[name]):.3f} | {losses[name]:.6f} |")
    print(f"stacked / per-layer (median): {ratio:.3f}x")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "cpus": os.cpu_count(), "prompt": args.prompt,
                       "response": args.response, "first_call_s": first, "seconds": seconds, "median_s": median,
                       "stacked_over_per_layer": ratio, "pg_loss": losses}, fh, indent=1)
    same = abs(losses["stacked"] - losses["per_layer"]) <= 1e-3 * max(abs(losses["stacked"]), 1e-6)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
