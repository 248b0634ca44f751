"""The step loop shared by ``launch/train_sft.py`` and ``launch/train_dpo.py``: data order, resume, metrics,
periodic checkpoints.

Each step takes the items `jaxrl_hf.finetune.policy.batch_indices` names for it, runs the jitted step and logs
``{step, <loss metrics>, train/grad_norm, train/lr, train/padding_ratio, perf/tokens_per_s, perf/throughput,
perf/time_per_step}`` (``train/lr`` is the learning rate of that update; tokens are the real, non-padding tokens the
forward ran over; ``train/padding_ratio`` is the share of the batch's computed token slots, ``input_ids.size``, that
hold none, as the RL actor's ``actor/padding_ratio``; ``perf/throughput`` is tokens per second per device, verl's
meaning: the step runs on one device, so it equals ``perf/tokens_per_s``). ``--resume`` restores ``OUT/checkpoint``
and continues at its step with the same data order (same data, ``--max-length`` and ``--group-by-length``); a fresh
run refuses an ``OUT`` that already holds a checkpoint, so one is never overwritten by accident.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf.finetune.policy import CHECKPOINT_DIR, TrainState, batch_indices, restore_checkpoint, save_checkpoint


@dataclass(frozen=True)
class LoopSpec:
    """What the loop needs besides the programs: the run's kind (``sft``/``dpo``), output dir, cadence and data
    order."""

    kind: str
    out_dir: str
    steps: int
    batch_size: int
    num_items: int
    seed: int
    save_every: int
    log_every: int = 1
    resume: bool = False
    lengths: tuple[int, ...] | None = None
    """Item lengths for length-grouped batches (`jaxrl_hf.finetune.policy.batch_indices`); None: plain shuffle."""


def start_state(spec: LoopSpec, fresh: TrainState) -> tuple[TrainState, int]:
    """``(state, first_step)``: ``fresh`` at 0, or with ``resume`` the checkpoint's state, checked to be this kind
    of run over the same number of data items."""
    path = os.path.join(spec.out_dir, CHECKPOINT_DIR)
    if not spec.resume:
        if os.path.exists(path):
            raise ValueError(f"{path} already holds a checkpoint; pass --resume to continue it or choose another --out")
        return fresh, 0
    state, meta = restore_checkpoint(spec.out_dir, fresh)
    if meta.get("kind") != spec.kind or meta.get("num_items") != spec.num_items:
        raise ValueError(f"{path} is a {meta.get('kind')!r} checkpoint over {meta.get('num_items')} items; this run "
                         f"is {spec.kind!r} over {spec.num_items} (same data and --max-length needed to resume)")
    if meta.get("length_grouped", False) != (spec.lengths is not None):
        raise ValueError(f"{path} was written with length_grouped={meta.get('length_grouped', False)}; resume with "
                         f"the same --group-by-length (it sets the data order)")
    return state, int(state.step)


def run_steps(spec: LoopSpec, state: TrainState, frozen: Any, step_fn: Callable[..., Any],
              make_batch: Callable[[list[int]], Mapping[str, np.ndarray]], count_tokens: Callable[[Any], int],
              lr_at: Callable[[int], float], log: Callable[[int, dict[str, float]], None],
              metadata: Mapping[str, Any]) -> tuple[TrainState, list[dict[str, float]]]:
    """Steps ``int(state.step) .. spec.steps - 1``; returns the final state and the per-step metrics. Saves
    ``OUT/checkpoint`` every ``save_every`` steps and after the last."""
    history = []
    meta = {"kind": spec.kind, "num_items": spec.num_items, "length_grouped": spec.lengths is not None, **metadata}
    for step in range(int(state.step), spec.steps):
        batch = make_batch(batch_indices(step, spec.batch_size, spec.num_items, spec.seed, spec.lengths))
        tokens = count_tokens(batch)
        t0 = time.perf_counter()
        state, metrics = step_fn(state, frozen, {k: jnp.asarray(v) for k, v in batch.items()})
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        seconds = time.perf_counter() - t0
        metrics.update({"train/lr": float(lr_at(step)), "train/padding_ratio": 1.0 - tokens / batch["input_ids"].size,
                        "perf/tokens_per_s": tokens / seconds,
                        "perf/throughput": tokens / seconds, "perf/time_per_step": seconds})
        log(step + 1, metrics)
        history.append({"step": step + 1, **metrics})
        if (step + 1) % spec.log_every == 0 or step + 1 == spec.steps:
            print(f"[train_{spec.kind}] step {step + 1:4d}/{spec.steps} loss {metrics['train/loss']:.4f} "
                  f"|g| {metrics['train/grad_norm']:.3f} lr {metrics['train/lr']:.2e} "
                  f"{metrics['perf/tokens_per_s']:.0f} tok/s", flush=True)
        if (step + 1) % spec.save_every == 0 or step + 1 == spec.steps:
            save_checkpoint(spec.out_dir, state, meta)
    return state, history
