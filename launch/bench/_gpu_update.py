"""The ``update`` section, one variant per process: the real ``ActorRolloutRefWorker`` (in-process, no Ray) on a
random ``model.path=tiny-random`` model of a real shape, ``model.dtype=bfloat16`` (float32 master weights).

Per variant (``bf16-<model.attn_implementation>-<model.remat>``): the first ``update_actor`` call (compile +
one step) and the median of ``repeats`` more, tokens/s, MFU from the project's FLOP count
(`jaxrl_hf.trainer.metrics.actor_update_flops` with the worker's `mfu_summary`) over the measured bf16 peak
(the ``peak`` section) and over the 989 TFLOP/s datasheet number, the device's ``peak_bytes_in_use`` (this
process only), and, with ``--log-prob``, ``compute_log_prob``'s first call and median time.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from typing import Any

from _gpu_common import DATASHEET_BF16_PEAK, UPDATE_SHAPES, full_shapes, log, read_json, set_at, time_left

ROLE = "actor_rollout"  # no reference copy: the actor's own memory


def variant_options(variant: str) -> dict[str, str]:
    """``bf16-auto-none`` -> model.dtype / attn_implementation / remat."""
    dtype, attn, remat = variant.split("-")
    return {"dtype": {"bf16": "bfloat16", "f32": "float32"}[dtype], "attn_implementation": attn, "remat": remat}


def worker_config(shape: dict[str, Any], variant: str, peak: float | None) -> dict[str, Any]:
    """The worker's config mapping (the schema fills every other default): one optimizer step per call over
    ``rows`` rows in micro-batches of ``micro`` rows, one device."""
    rows, micro = shape["rows"], shape["micro"]
    return {
        "model": {"path": "tiny-random", "tiny": dict(shape["model"]), "seed": 0, **variant_options(variant)},
        "actor": {"ppo_mini_batch_size": rows, "ppo_micro_batch_size_per_device": micro,
                  "log_prob_micro_batch_size_per_device": micro, "ppo_epochs": 1, "use_kl_loss": False,
                  "optim": {"lr": 1e-6}},
        "rollout": {"name": "jax", "n": 1, "response_length": shape["response"],
                    "max_prompt_length": shape["prompt"], "seed": 0},
        "data": {"max_prompt_length": shape["prompt"], "max_response_length": shape["response"]},
        "placement": {"num_processes": 1, "devices_per_process": 1, "train": {"pp": 1, "tp": 1, "dp": 1}},
        "trainer": {"peak_flops_per_device": peak},
    }


def make_batch(shape: dict[str, Any], vocab: int, seed: int = 0):
    """Full-length random rows (no padding): ``prompt + response`` tokens each, advantages +-1 per row, old
    log-probs at the uniform policy's value (ratio ~1, as in a first PPO epoch)."""
    import numpy as np

    from jaxrl_hf.controller import Batch

    rows, p, r = shape["rows"], shape["prompt"], shape["response"]
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (rows, p + r)).astype(np.int32)
    mask = np.ones((rows, p + r), np.int32)
    response_mask = np.ones((rows, r), np.float32)
    adv = np.where(np.arange(rows)[:, None] % 2 == 0, 1.0, -1.0).astype(np.float32) * response_mask
    return Batch.from_dict({
        "input_ids": ids, "attention_mask": mask, "position_ids": np.cumsum(mask, -1).astype(np.int32) - 1,
        "responses": ids[:, p:], "response_mask": response_mask,
        "old_log_probs": np.full((rows, r), -float(np.log(vocab)), np.float32), "advantages": adv,
    }, meta_info={"global_step": 0})


def device_memory() -> dict[str, int] | str:
    import jax

    d = jax.devices()[0]
    stats = d.memory_stats() if hasattr(d, "memory_stats") else None
    if not stats:
        return f"skipped: {d.platform}"
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def timed_calls(fn, repeats: int, deadline: float) -> tuple[float, list[float]]:
    """First call's seconds (compile + run) and up to ``repeats`` more (fewer when the deadline is near)."""
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    times: list[float] = []
    for _ in range(repeats):
        if times and time_left(deadline) < 3 * max(times):
            break
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return first, times


def run_variant(path: str, variant: str, quick: bool, deadline: float, log_prob: bool,
                keys: tuple[str, ...] | None = None) -> None:
    """One variant's measurements, stored at ``keys`` (default ``sections/update/variants/<variant>``)."""
    import jax
    import numpy as np

    from jaxrl_hf.controller.worker import WorkerContext
    from jaxrl_hf.models.attention import resolve_implementation
    from jaxrl_hf.trainer.metrics import actor_update_flops
    from jaxrl_hf.workers import ActorRolloutRefWorker

    keys = keys or ("sections", "update", "variants", variant)
    shape = UPDATE_SHAPES["quick"] if quick else full_shapes()[0]
    measured_peak = read_json(path).get("sections", {}).get("peak", {}).get("ours_bfloat16_flops_per_s")
    config = worker_config(shape, variant, measured_peak)
    tokens = shape["rows"] * (shape["prompt"] + shape["response"])
    out: dict[str, Any] = {"status": "running", "options": variant_options(variant), "rows": shape["rows"],
                           "seq_len": shape["prompt"] + shape["response"], "micro_rows": shape["micro"],
                           "tokens_per_update": tokens, "memory_before_init": device_memory(),
                           "xla_mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")}
    set_at(path, keys, out)
    t = time.perf_counter()
    worker = ActorRolloutRefWorker._instantiate(WorkerContext("actor", "bench_gpu", 0, 1),
                                                (copy.deepcopy(config), ROLE), {})
    info = worker.init_model()
    jax.block_until_ready(worker.state)
    model = worker.model.config
    head_dim = model.head_dim
    out.update({"init_s": time.perf_counter() - t, "num_params": info["num_params"],
                "model_params_for_flops": info.get("model_params"), "memory_after_init": device_memory(),
                "attention_resolved": resolve_implementation(model.attn_implementation, out["seq_len"],
                                                             model.dtype, head_dim),
                "peak_flops_per_device_worker": info.get("peak_flops_per_device")})
    set_at(path, keys, out)
    log(f"update {variant}: init {out['init_s']:.1f}s, {info['num_params'] / 1e9:.3f}B params, "
        f"attention {out['attention_resolved']}")

    batch = make_batch(shape, model.vocab_size)
    metrics: dict[str, Any] = {}

    def update():
        result = worker.update_actor(batch)
        jax.block_until_ready(worker.state)
        metrics.update(result.meta_info["metrics"])

    first, times = timed_calls(update, shape["repeats"], deadline)
    step = statistics.median(times) if times else first
    flops = actor_update_flops(np.full(shape["rows"], out["seq_len"]), int(info["model_params"]),
                               int(info["num_layers"]), int(info["attn_dim"]), 1)
    peak = measured_peak or info.get("peak_flops_per_device")
    out.update({"first_call_s": first, "compile_s": max(first - step, 0.0), "step_s": times,
                "step_s_median": step, "tokens_per_s": tokens / step, "model_flops_per_update": flops,
                "achieved_flops_per_s": flops / step, "mfu_vs_measured_peak": flops / step / peak if peak else None,
                "measured_peak_flops_per_s": peak, "mfu_vs_datasheet_989": flops / step / DATASHEET_BF16_PEAK,
                "metrics": {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.floating))},
                "memory_after_update": device_memory()})
    if not times:
        out["note"] = "one call only (deadline): step_s_median is the first call, compile included"
    set_at(path, keys, out)
    log(f"update {variant}: first call {first:.1f}s, step {step:.3f}s (n={len(times)}), "
        f"{tokens / step:.0f} tok/s, MFU {out['mfu_vs_datasheet_989']:.3f} of 989T")

    if not log_prob:
        out["log_prob"] = "skipped: first variant only (--log-prob-all times every variant)"
    elif time_left(deadline) < (10 if quick else 60):
        out["log_prob"] = "skipped: budget"
    else:
        lp_first, lp_times = timed_calls(lambda: worker.compute_log_prob(batch), shape["repeats"], deadline)
        lp = statistics.median(lp_times) if lp_times else lp_first
        out["log_prob"] = {"first_call_s": lp_first, "compile_s": max(lp_first - lp, 0.0), "s": lp_times,
                           "s_median": lp, "tokens_per_s": tokens / lp, "memory_after": device_memory()}
        log(f"update {variant}: compute_log_prob first {lp_first:.1f}s, median {lp:.3f}s")
    out["status"] = "ok"
    set_at(path, keys, out)
