"""Splitting a rank's rows into PPO epochs × mini-batches (one optimizer step each) × micro-batches.

Sizes (verl's meaning): ``ppo_mini_batch_size`` counts *prompts*, so a mini-batch holds
``ppo_mini_batch_size · n`` sequences over all ranks; ``ppo_micro_batch_size_per_device`` sequences run
through one device at a time, so a micro-batch holds ``micro_per_device · dp_devices`` sequences over all
ranks and a mini-batch takes ``mini / micro`` accumulation steps. A process holds ``1/dp_processes`` of each.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np

from jaxrl_hf.workers.common import WorkerConfigError


@dataclasses.dataclass(frozen=True)
class MiniBatchPlan:
    """Per-process row counts: ``num_minibatches`` of ``minibatch_rows`` = ``num_micro`` × ``micro_rows``."""

    rows: int
    minibatch_rows: int
    micro_rows: int
    num_micro: int
    epochs: int
    shuffle: bool

    @property
    def num_minibatches(self) -> int:
        return self.rows // self.minibatch_rows

    @classmethod
    def build(cls, rows: int, *, mini_batch_prompts: int, samples_per_prompt: int, micro_per_device: int,
              dp_devices: int, dp_processes: int, epochs: int = 1, shuffle: bool = False,
              where: str = "actor") -> "MiniBatchPlan":
        """Check the batch arithmetic; errors name the config keys involved."""
        for key, value in (("ppo_mini_batch_size", mini_batch_prompts), ("ppo_micro_batch_size_per_device",
                           micro_per_device), ("ppo_epochs", epochs)):
            if value < 1:
                raise WorkerConfigError(f"{where}.{key} must be >= 1, got {value}")
        mini_global = mini_batch_prompts * samples_per_prompt
        micro_global = micro_per_device * dp_devices
        if mini_global % micro_global:
            raise WorkerConfigError(
                f"{where}.ppo_mini_batch_size·rollout.n = {mini_batch_prompts}·{samples_per_prompt} = {mini_global} "
                f"sequences is not a multiple of {where}.ppo_micro_batch_size_per_device·dp devices = "
                f"{micro_per_device}·{dp_devices} = {micro_global}")
        minibatch_rows, micro_rows = mini_global // dp_processes, micro_global // dp_processes
        if rows % minibatch_rows:
            raise WorkerConfigError(
                f"{where}: this rank holds {rows} sequences, not a multiple of the per-rank mini-batch "
                f"{where}.ppo_mini_batch_size·rollout.n/dp_processes = {mini_global}/{dp_processes} = {minibatch_rows}")
        return cls(rows, minibatch_rows, micro_rows, minibatch_rows // micro_rows, epochs, shuffle)


def iterate_minibatches(arrays: Mapping[str, np.ndarray], plan: MiniBatchPlan,
                        seed: Sequence[int]) -> Iterator[dict[str, np.ndarray]]:
    """Yield one dict per optimizer step, each array shaped ``[num_micro, micro_rows, ...]``.

    With ``plan.shuffle`` the rows are permuted per epoch by a generator seeded with ``(*seed, epoch)``
    (deterministic, so a resumed run replays the same order).
    """
    for epoch in range(plan.epochs):
        order = np.arange(plan.rows)
        if plan.shuffle:
            order = np.random.default_rng([*map(int, seed), epoch]).permutation(plan.rows)
        for k in range(plan.num_minibatches):
            rows = order[k * plan.minibatch_rows:(k + 1) * plan.minibatch_rows]
            yield {name: a[rows].reshape(plan.num_micro, plan.micro_rows, *a.shape[1:]) for name, a in arrays.items()}


def mean_metrics(per_step: Sequence[Mapping[str, Any]], prefix: str, last: Sequence[str] = ()) -> dict[str, float]:
    """Average each metric over the optimizer steps (``last`` keys: the final value), as Python floats."""
    if not per_step:
        raise ValueError("no optimizer steps were taken (empty batch?)")
    host = jax.device_get(list(per_step))
    out = {f"{prefix}{k}": float(host[-1][k]) if k in last else float(np.mean([m[k] for m in host]))
           for k in host[0]}
    out[f"{prefix}num_updates"] = float(len(host))
    return out
