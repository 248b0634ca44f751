"""Asynchronous training (``trainer.max_staleness``): the rollout group generates the next steps' batches while
the actor trains on this one.

Weights versions count actor updates: the rollout group starts with version 0 (the initial policy) and, after
the update of step k, gets version k (`push_weights`). The batch of step k is trained on by update k, so a batch
generated with version v is ``k − 1 − v`` updates stale: 0 for a synchronous step. As soon as step k's first
generation round is back, `AsyncRollout` submits the first round of steps ``k+1 .. k+max_staleness`` (their
staleness is then at most ``max_staleness``), so the rollout group works through them while the driver scores,
computes log-probs and updates. Later rounds of a step (DAPO's dynamic sampling) and every generation with
``max_staleness = 0`` are generated on demand with the newest weights.

The actor recomputes π_old (``old_log_probs``) on each batch, and truncated importance sampling
(``actor.rollout_correction``, on by default when ``max_staleness > 0``) weighs the stale sampler's tokens by
``min(π_old / π_rollout, C)``.

Metrics: ``async/staleness/mean`` (of this step's first round), ``timing_s/wait_rollout`` (the driver blocked on
generation), ``timing_s/wait_train`` (the rollout group idle, waiting for prompts or weights, since the step
before), ``perf/weight_sync_bytes`` and ``timing_s/weight_sync_rollout`` of the last completed weight push,
``timing_s/weight_push`` (the driver's part of a push: submitting it).

A checkpoint records the data loader as it was before the in-flight batches were drawn
(`loader_state_for_checkpoint`), so a resumed run regenerates them with the restored weights.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from jaxrl_hf.controller import Batch


class AsyncRollout:
    """The rollout group's work queue for one run (see the module docstring)."""

    def __init__(self, rollout: Any, actor: Any, max_staleness: int, first_round_prompts: Callable[[int], Batch],
                 loader_state: Callable[[], Any], last_step: int, prefetch: bool = True) -> None:
        self.rollout, self.actor, self.max_staleness = rollout, actor, int(max_staleness)
        self.first_round_prompts = first_round_prompts
        """``step -> Batch``: the step's first-round prompts, seeded (draws from the data loader)."""
        self.loader_state = loader_state
        self.prefetch_enabled = prefetch and self.max_staleness > 0
        self.last_step = int(last_step)
        """``trainer.total_steps``: nothing is generated ahead for steps after it."""
        self.inflight: dict[int, tuple[Any, int, Any]] = {}
        """step -> (generation future, weights version it samples with, loader state before its prompts)"""
        self.version = 0
        self.pending_sync: Any = None
        self.sync_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ generation
    def _submit(self, prompts: Batch) -> Any:
        return self.rollout.generate_sequences.submit(prompts)

    def _wait(self, future: Any, metrics: dict[str, float]) -> Batch:
        start = time.perf_counter()
        out = future.get()
        metrics["timing_s/wait_rollout"] = metrics.get("timing_s/wait_rollout", 0.0) + time.perf_counter() - start
        idle = out.meta_info.get("rollout_idle_s")
        if idle is not None:
            idle = sum(idle) if isinstance(idle, (list, tuple)) else idle
            metrics["timing_s/wait_train"] = metrics.get("timing_s/wait_train", 0.0) + float(idle)
        return out

    def first_round(self, step: int, metrics: dict[str, float]) -> Batch:
        """Step ``step``'s first generation round (prefetched or generated now); then prefetch the next steps."""
        if step in self.inflight:
            future, version, _ = self.inflight.pop(step)
        else:
            future, version = self._submit(self.first_round_prompts(step)), self.version
        out = self._wait(future, metrics)
        metrics["async/staleness/mean"] = float(step - 1 - version)
        if self.prefetch_enabled:
            for ahead in range(step + 1, min(step + self.max_staleness, self.last_step) + 1):
                if ahead not in self.inflight:
                    before = self.loader_state()
                    self.inflight[ahead] = (self._submit(self.first_round_prompts(ahead)), self.version, before)
        return out

    def generate(self, prompts: Batch, metrics: dict[str, float]) -> Batch:
        """Any other generation (later rounds, baselines): now, with the newest weights pushed."""
        return self._wait(self._submit(prompts), metrics)

    # ------------------------------------------------------------------ weights
    def push_weights(self, version: int) -> dict[str, float]:
        """Hand the actor's weights after update ``version`` to the rollout group (object store, no driver
        copy); returns the metrics of the previous push, which has completed by now or is waited for."""
        start = time.perf_counter()
        done = self._finish_sync()
        weights = self.actor.get_weights.submit()
        self.pending_sync = self.rollout.set_weights.submit(weights, version)
        self.version = int(version)
        done["timing_s/weight_push"] = time.perf_counter() - start
        return done

    def _finish_sync(self) -> dict[str, float]:
        if self.pending_sync is None:
            return {}
        results = self.pending_sync.get()
        self.pending_sync = None
        first = results[0] if isinstance(results, (list, tuple)) else results
        return {k: float(v) for k, v in (first or {}).items()}

    def drain(self) -> None:
        """Wait for every submitted call (end of the run, before a checkpoint of the rollout's inputs)."""
        self._finish_sync()
        for future, _, _ in self.inflight.values():
            future.get()

    # ------------------------------------------------------------------ checkpoints
    def loader_state_for_checkpoint(self, current: Any) -> Any:
        """The loader state to save: before the earliest in-flight prefetch (their prompts are drawn again
        after a resume), else ``current``."""
        if not self.inflight:
            return current
        return self.inflight[min(self.inflight)][2]
