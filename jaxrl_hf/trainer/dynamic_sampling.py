"""DAPO dynamic sampling (Yu et al. 2025 §3.2, eq.11 constraint 0 < |{o_i correct}| < G).

Groups whose samples all got the same ``metric`` (all right or all wrong) carry zero advantage under a group
baseline and only dilute the gradient. ``collect_informative_groups`` keeps generating new prompt batches,
keeping only the informative groups, until ``target_prompts`` groups are collected (a bar of the groups kept:
`jaxrl_hf.progress.task`); after
``max_num_gen_batches`` rounds without enough it raises ``DynamicSamplingError`` with the counts.

The metric (``algorithm.filter_groups.metric``) is one of verl's per-sample columns: ``acc`` and ``score`` as
the scoring function returned them (``score`` is its raw output: no overlong penalty, no reward-model score),
``seq_reward`` = Σ_t ``token_level_scores`` (the reward as shaped), ``seq_final_reward`` = Σ_t
``token_level_rewards`` (after the KL penalty when ``algorithm.use_kl_in_reward``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxrl_hf import progress
from jaxrl_hf.algos import filter_groups
from jaxrl_hf.controller import Batch

SCORER_COLUMNS = ("acc", "score")
SUMMED_COLUMNS = {"seq_reward": "token_level_scores", "seq_final_reward": "token_level_rewards"}


class DynamicSamplingError(RuntimeError):
    """Not enough informative prompt groups after ``algorithm.filter_groups.max_num_gen_batches`` rounds."""


def group_metric(batch: Batch, metric: str) -> np.ndarray:
    """``[B]`` float32: each sample's ``metric`` (module docstring)."""
    if metric not in SCORER_COLUMNS and metric not in SUMMED_COLUMNS:
        raise ValueError(f"algorithm.filter_groups.metric={metric!r}; valid: {[*SCORER_COLUMNS, *SUMMED_COLUMNS]}")
    column = SUMMED_COLUMNS.get(metric, metric)
    if column not in batch:
        raise KeyError(f"algorithm.filter_groups.metric={metric!r} needs column {column!r}; batch has {batch.keys()}")
    values = np.asarray(batch[column], np.float32)
    return values.sum(-1) if metric in SUMMED_COLUMNS else values


def informative_mask(batch: Batch, metric: str) -> np.ndarray:
    """``keep [B]``: samples whose group (same ``uid``) has a non-constant ``metric``."""
    from jaxrl_hf.trainer.advantage import dense_uid

    values = group_metric(batch, metric)
    return np.asarray(filter_groups(values, dense_uid(np.asarray(batch["uid"])), keep_singletons=False), bool)


def collect_informative_groups(
    generate_round: Callable[[int], Batch],
    target_prompts: int,
    samples_per_prompt: int,
    metric: str,
    max_num_gen_batches: int,
) -> tuple[Batch, dict[str, float]]:
    """Call ``generate_round(i)`` (a scored batch of whole groups, samples of a group adjacent) for
    i = 0, 1, ... until ``target_prompts`` informative groups are kept; returns exactly
    ``target_prompts · samples_per_prompt`` rows (the first groups kept, in generation order) and metrics.
    """
    kept: list[Batch] = []
    num_kept_groups = 0
    generated_groups = 0
    rounds = 0
    with progress.task("dynamic sampling", target_prompts, "informative groups") as groups_done:
        while num_kept_groups < target_prompts:
            if 0 < max_num_gen_batches <= rounds:
                raise DynamicSamplingError(
                    f"dynamic sampling: only {num_kept_groups} of the {target_prompts} prompt groups needed "
                    f"(data.train_batch_size) had non-constant {metric!r} after {rounds} generation rounds "
                    f"({generated_groups} groups generated); raise algorithm.filter_groups.max_num_gen_batches (now "
                    f"{max_num_gen_batches}), increase rollout.n, or use easier prompts"
                )
            with progress.doing(f"round {rounds + 1}"):
                batch = generate_round(rounds)
            rounds += 1
            generated_groups += len(batch) // samples_per_prompt
            keep = informative_mask(batch, metric)
            if keep.any():
                kept.append(batch.take(keep))
                num_kept_groups += int(keep.sum()) // samples_per_prompt
                groups_done.advance(int(keep.sum()) // samples_per_prompt)
    merged = Batch.concat(kept, meta_conflict="first")
    out = merged[: target_prompts * samples_per_prompt]
    metrics = {
        "dynamic_sampling/num_gen_batches": float(rounds),
        "dynamic_sampling/num_prompts_generated": float(generated_groups),
        "dynamic_sampling/num_informative_prompts": float(num_kept_groups),
        "dynamic_sampling/informative_ratio": num_kept_groups / max(generated_groups, 1),
    }
    return out, metrics
