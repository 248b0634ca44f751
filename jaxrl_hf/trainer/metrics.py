"""Per-step metrics with verl's names, computed from the step's ``Batch`` (numpy, no JAX).

* data: ``critic/score/{mean,max,min}``, ``critic/rewards/...`` (over the rows that are not aborted),
  ``critic/advantages/...``, ``critic/returns/...``, ``critic/values/...`` + ``critic/vf_explained_var`` (with a
  critic), ``response_length/{mean,max,min,clip_ratio}``, ``response_length_non_aborted/...``,
  ``response/aborted_ratio`` (an aborted response has no token), ``prompt_length/...``, ``critic/acc/mean`` (rule
  accuracy).
* timing: ``timing_s/<stage>`` and ``timing_per_token_ms/<stage>`` (``gen`` per response token, every other stage
  per prompt + response token).
* throughput: ``perf/total_num_tokens``, ``perf/time_per_step``, ``perf/throughput`` (tokens/s).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxrl_hf.controller import Batch
from jaxrl_hf import progress


def _stats(prefix: str, values: np.ndarray) -> dict[str, float]:
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return {}
    return {f"{prefix}/mean": float(values.mean()), f"{prefix}/max": float(values.max()), f"{prefix}/min": float(values.min())}


def _stats_or_nan(prefix: str, values: np.ndarray) -> dict[str, float]:
    """`_stats`, or NaN for each statistic of an empty selection (every response aborted)."""
    return _stats(prefix, values) or {f"{prefix}/{k}": float("nan") for k in ("mean", "max", "min")}


def data_metrics(batch: Batch, use_critic: bool) -> dict[str, float]:
    """Score, reward, advantage, return, value and length statistics of a trained batch."""
    mask = np.asarray(batch["response_mask"], bool)
    response_len = mask.sum(-1)
    max_response = mask.shape[-1]
    prompt_len = np.asarray(batch["prompt_mask"]).sum(-1) if "prompt_mask" in batch else None
    kept = response_len > 0  # an aborted response (no token at all) counts in no score or reward statistic
    out: dict[str, float] = {}
    out.update(_stats_or_nan("critic/score", np.asarray(batch["token_level_scores"]).sum(-1)[kept]))
    if "token_level_rewards" in batch:
        out.update(_stats_or_nan("critic/rewards", np.asarray(batch["token_level_rewards"]).sum(-1)[kept]))
    if "acc" in batch:
        out["critic/acc/mean"] = float(np.mean(batch["acc"]))
    for key, name in (("advantages", "critic/advantages"), ("returns", "critic/returns")):
        if key in batch:
            out.update(_stats(name, np.asarray(batch[key])[mask]))
    if use_critic and "values" in batch and "returns" in batch and mask.any():
        values = np.asarray(batch["values"])[mask]
        returns = np.asarray(batch["returns"])[mask]
        out.update(_stats("critic/values", values))
        var_returns = np.var(returns)
        out["critic/vf_explained_var"] = float(1.0 - np.var(returns - values) / (var_returns + 1e-5))
    out.update(agent_metrics(batch))
    out.update(_stats("response_length", response_len))
    out["response_length/clip_ratio"] = float(np.mean(response_len >= max_response))
    out.update(_stats_or_nan("response_length_non_aborted", response_len[kept]))
    out["response_length_non_aborted/clip_ratio"] = (float(np.mean(response_len[kept] >= max_response))
                                                     if kept.any() else float("nan"))
    out["response/aborted_ratio"] = float(np.mean(~kept))
    if prompt_len is not None:
        out.update(_stats("prompt_length", prompt_len))
        out["prompt_length/clip_ratio"] = float(np.mean(prompt_len >= np.asarray(batch["prompt_mask"]).shape[-1]))
    return out


def agent_metrics(batch: Batch) -> dict[str, float]:
    """A multi-turn rollout's ``agent/num_turns/{mean,max,min}``, ``agent/tool_calls/mean`` (per sequence) and
    ``agent/tool_errors`` (malformed or failed calls in the batch); nothing for single-turn rows."""
    if "num_turns" not in batch:
        return {}
    out = _stats("agent/num_turns", np.asarray(batch["num_turns"]))
    out["agent/tool_calls/mean"] = float(np.mean(batch["num_tool_calls"]))
    out["agent/tool_errors"] = float(np.sum(batch["num_tool_errors"]))
    return out


def entropy_metric(batch: Batch) -> dict[str, float]:
    """``actor/entropy``: token-mean policy entropy over valid response tokens (from ``compute_log_prob``)."""
    if "entropys" not in batch:
        return {}
    mask = np.asarray(batch["response_mask"], bool)
    return {"actor/entropy": float(np.asarray(batch["entropys"], np.float64)[mask].mean()) if mask.any() else 0.0}


def throughput_metrics(batch: Batch, timings: dict[str, float], num_devices: int) -> dict[str, float]:
    """Tokens processed per second of step time (prompt + response tokens, per device)."""
    tokens = float(np.asarray(batch["response_mask"]).sum() + (np.asarray(batch["prompt_mask"]).sum() if "prompt_mask" in batch else 0))
    step_time = timings.get("step", 0.0)
    out = {"perf/total_num_tokens": tokens, "perf/time_per_step": step_time}
    out["perf/throughput"] = tokens / (step_time * num_devices) if step_time > 0 else 0.0
    return out


def actor_update_flops(seq_lens: np.ndarray, num_params: int, num_layers: int, attn_dim: int,
                       epochs: int) -> float:
    """Model FLOPs of ``epochs`` passes (forward + backward) over sequences of ``seq_lens`` real tokens:

        epochs · Σ_s (6·N·s + 6·L·a·s·(s+1))

    6·N per token for the dense weights (Kaplan et al. 2020), plus causal attention: the token at position i
    attends to i keys, so QKᵀ and AV cost 2·a·i FLOPs each per layer forward (a = heads × head_dim), summing to
    2·a·s·(s+1) over a row, tripled for the backward (PaLM's 12·L·a per token and key, under the causal mask).
    Padding counts nothing."""
    s = np.asarray(seq_lens, np.float64)
    return float(epochs) * float(6.0 * num_params * s.sum() + 6.0 * num_layers * attn_dim * (s * (s + 1)).sum())


def shared_prompt_flops(batch: Batch, group: int, num_params: int, num_layers: int, attn_dim: int,
                        epochs: int) -> float:
    """The model FLOPs a shared prompt forward does not do (``actor.share_prompt_forward``): each group of ``group``
    rows computes its prompt once, so ``group - 1`` of its rows' prompt tokens (``p`` real ones: 6·N·p) and their
    causal attention among themselves (``p(p+1)/2`` query-key pairs) are counted once, not ``group`` times."""
    prompt_width = np.shape(batch["attention_mask"])[1] - np.shape(batch["responses"])[1]
    p = (np.asarray(batch["attention_mask"])[::group, :prompt_width] > 0).sum(-1).astype(np.float64)
    per_group = 6.0 * num_params * p.sum() + 6.0 * num_layers * attn_dim * (p * (p + 1)).sum()
    return float(epochs) * (group - 1) * float(per_group)


def mfu_metric(batch: Batch, timings: dict[str, float], actor_info: dict[str, Any], ppo_epochs: int,
               num_devices: int, shared_group: int = 1, role: str = "actor") -> dict[str, float]:
    """``perf/mfu/<role>``: model FLOPs of the role's update (``actor_update_flops`` over the real tokens of each
    row; with ``shared_group`` > 1, the update's rows shared each prompt in groups of that many: less
    `shared_prompt_flops`) over the update's wall time (``timing_s/update_<role>``) × the devices' peak FLOP/s;
    for the actor also ``perf/peak_flops_per_device``: that peak (``trainer.peak_flops_per_device``, else measured
    at start: ``workers/peak_flops.py``). ``actor_info``: the role's ``init_model`` summary (`mfu_summary`)."""
    seconds, peak = timings.get(f"update_{role}", 0.0), actor_info.get("peak_flops_per_device") or 0.0
    num_params = int(actor_info.get("model_params") or actor_info.get("num_params") or 0)
    if not peak or not num_params or seconds <= 0 or "attention_mask" not in batch:
        return {}
    seq_lens = (np.asarray(batch["attention_mask"]) > 0).sum(-1)
    layers, attn_dim = int(actor_info.get("num_layers", 0)), int(actor_info.get("attn_dim", 0))
    flops = actor_update_flops(seq_lens, num_params, layers, attn_dim, ppo_epochs)
    if shared_group > 1 and "responses" in batch:
        flops -= shared_prompt_flops(batch, shared_group, num_params, layers, attn_dim, ppo_epochs)
    out = {f"perf/mfu/{role}": flops / (seconds * num_devices * peak)}
    if role == "actor":
        out["perf/peak_flops_per_device"] = float(peak)
    return out


def timing_metrics(timings: dict[str, float], batch: Batch) -> dict[str, float]:
    """``timing_s/<stage>`` and ``timing_per_token_ms/<stage>``: milliseconds per response token for ``gen`` (what it
    produced), per prompt + response token for every other stage (what it read), as verl divides them."""
    response = float(np.asarray(batch["response_mask"]).sum())
    overall = response + (float(np.asarray(batch["prompt_mask"]).sum()) if "prompt_mask" in batch else 0.0)
    out = {f"timing_s/{k}": float(v) for k, v in timings.items()}
    for stage, seconds in timings.items():
        tokens = response if stage == "gen" else overall
        if stage != "step":
            out[f"timing_per_token_ms/{stage}"] = 1000.0 * float(seconds) / tokens if tokens > 0 else 0.0
    return out


class StageTimer:
    """Accumulates wall-clock seconds per named stage: ``with timer("gen"): ...``."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with progress.doing(stage):
                yield
        finally:
            self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - start


def is_wall_clock_metric(name: str) -> bool:
    """Metrics that depend on wall-clock time or the machine's state (a role's ``<role>/perf/*`` memory counters):
    excluded from determinism comparisons."""
    return name.startswith(("timing_s/", "timing_per_token_ms/", "perf/")) or "/perf/" in name
