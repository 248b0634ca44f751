"""Orders in which a prompt dataset is visited, epoch by epoch, reproducibly and resumably.

Every sampler gives ``epoch_order(epoch)``, a permutation of the row indices, as a pure function of
its seed, the epoch and its ``state_dict()``; ``update(indices, scores)`` is the curriculum hook the
trainer calls after scoring a batch (a no-op for the static samplers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


class Sampler:
    """Base class: a sequential order; subclasses override ``epoch_order``."""

    kind = "sequential"
    adaptive = False
    """True when the order depends on ``update`` calls (the loader then checkpoints the order itself)."""

    def __init__(self, num_rows: int) -> None:
        if num_rows <= 0:
            raise ValueError(f"sampler: the dataset is empty (num_rows={num_rows})")
        self.num_rows = int(num_rows)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices in visiting order for ``epoch``."""
        return np.arange(self.num_rows, dtype=np.int64)

    def update(self, indices: Sequence[int], scores: Sequence[float]) -> None:
        """Curriculum hook: the rows ``indices`` earned ``scores`` (e.g. mean accuracy); ignored here."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {"kind": self.kind, "num_rows": self.num_rows}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``; the kind and dataset size must match."""
        if state.get("kind") != self.kind:
            raise ValueError(f"sampler state is for {state.get('kind')!r}, this sampler is {self.kind!r}")
        if int(state.get("num_rows", -1)) != self.num_rows:
            raise ValueError(f"sampler state is for {state.get('num_rows')} rows, this dataset has {self.num_rows}")


SequentialSampler = Sampler


class RandomSampler(Sampler):
    """A fresh permutation each epoch, drawn from ``(seed, epoch)``: epoch e's order never depends on
    how many batches earlier epochs produced."""

    kind = "random"

    def __init__(self, num_rows: int, seed: int) -> None:
        super().__init__(num_rows)
        self.seed = int(seed)

    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows).astype(np.int64)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state has seed {state['seed']}, this sampler has seed {self.seed}")


def informative_priority(successes: np.ndarray, attempts: np.ndarray) -> np.ndarray:
    """Default curriculum priority: p(1-p) of the smoothed success rate p = (s+1)/(n+2).

    Highest for prompts the policy solves about half the time — the groups DAPO's dynamic sampling keeps
    (all-right or all-wrong groups have zero advantage); unseen prompts get p = 0.5.
    """
    p = (successes + 1.0) / (attempts + 2.0)
    return p * (1.0 - p)


class CurriculumSampler(Sampler):
    """Orders each epoch by a priority computed from per-row score statistics (the curriculum hook).

    ``update(indices, scores)`` accumulates each row's attempts and summed scores (scores in [0, 1], e.g.
    accuracy). At the start of an epoch the rows are ordered by a weighted random permutation without
    replacement (Gumbel top-k, seeded by ``(seed, epoch)``) with weights ``priority_fn(successes,
    attempts) + 1e-6``; the default ``informative_priority`` favours rows solved about half the time.
    """

    kind = "curriculum"
    adaptive = True

    def __init__(
        self,
        num_rows: int,
        seed: int,
        priority_fn: Callable[[np.ndarray, np.ndarray], np.ndarray] = informative_priority,
    ) -> None:
        super().__init__(num_rows)
        self.seed = int(seed)
        self.priority_fn = priority_fn
        self.successes = np.zeros(num_rows, np.float64)
        self.attempts = np.zeros(num_rows, np.float64)

    def epoch_order(self, epoch: int) -> np.ndarray:
        weights = np.asarray(self.priority_fn(self.successes, self.attempts), np.float64) + 1e-6
        if weights.shape != (self.num_rows,) or not np.all(np.isfinite(weights)) or np.any(weights <= 0):
            raise ValueError("curriculum priority_fn must return finite non-negative weights, one per row")
        gumbel = np.random.default_rng([self.seed, epoch]).gumbel(size=self.num_rows)
        return np.argsort(-(np.log(weights) + gumbel), kind="stable").astype(np.int64)

    def update(self, indices: Sequence[int], scores: Sequence[float]) -> None:
        idx = np.asarray(indices, np.int64)
        val = np.asarray(scores, np.float64)
        if idx.shape != val.shape:
            raise ValueError(f"curriculum update: {idx.shape[0]} indices but {val.shape[0]} scores")
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_rows):
            raise ValueError(f"curriculum update: row index out of range [0, {self.num_rows})")
        np.add.at(self.attempts, idx, 1.0)
        np.add.at(self.successes, idx, np.clip(val, 0.0, 1.0))

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "seed": self.seed,
            "successes": self.successes.tolist(),
            "attempts": self.attempts.tolist(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.seed = int(state["seed"])
        self.successes = np.asarray(state["successes"], np.float64)
        self.attempts = np.asarray(state["attempts"], np.float64)


def make_sampler(kind: str, num_rows: int, seed: int = 0, **kwargs: Any) -> Sampler:
    """``sequential`` | ``random`` | ``curriculum`` (``data.shuffle`` / ``data.sampler`` in configs)."""
    if kind == "sequential":
        return Sampler(num_rows)
    if kind == "random":
        return RandomSampler(num_rows, seed)
    if kind == "curriculum":
        return CurriculumSampler(num_rows, seed, **kwargs)
    raise ValueError(f"unknown sampler {kind!r}; valid: ['sequential', 'random', 'curriculum']")
