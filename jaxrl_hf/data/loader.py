"""A prompt loader whose position is part of the checkpoint.

``PromptLoader`` walks a dataset in batches in the order its sampler gives for each epoch. Its
``state_dict()`` (JSON-serialisable: epoch, batch index, sampler state, a dataset fingerprint and, for
adaptive samplers, the current epoch's order) restores a fresh loader so that the batches it yields
next are exactly those an uninterrupted run would have yielded.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_hf.data.samplers import Sampler

STATE_VERSION = 1


def dataset_fingerprint(rows: Sequence[Mapping[str, Any]]) -> str:
    """A short hash of the rows' prompts, sources and ground truths (to refuse resuming on other data)."""
    digest = hashlib.sha256()
    for row in rows:
        key = [row.get("data_source"), row.get("prompt"), (row.get("reward_model") or {}).get("ground_truth")]
        digest.update(json.dumps(key, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:16]


class PromptLoader:
    """Batches of rows (or ``collate_fn(rows)``) in sampler order; ``drop_last`` drops a short final batch.

    Each yielded row carries its dataset index as ``"dataset_index"`` (also in ``last_indices``) so the
    trainer can feed scores back to a curriculum sampler (``sampler.update``).
    """

    def __init__(
        self,
        rows: Sequence[Mapping[str, Any]],
        batch_size: int,
        sampler: Sampler | None = None,
        *,
        drop_last: bool = True,
        collate_fn: Callable[[list[dict]], Any] | None = None,
    ) -> None:
        if batch_size <= 0:
            raise ValueError(f"data.train_batch_size must be > 0, got {batch_size}")
        self.rows = list(rows)
        self.sampler = sampler or Sampler(len(self.rows))
        if self.sampler.num_rows != len(self.rows):
            raise ValueError(f"sampler covers {self.sampler.num_rows} rows but the dataset has {len(self.rows)}")
        if drop_last and len(self.rows) < batch_size:
            raise ValueError(
                f"the dataset has {len(self.rows)} rows, fewer than one batch of {batch_size} (drop_last=True)"
            )
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.collate_fn = collate_fn
        self.fingerprint = dataset_fingerprint(self.rows)
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order: np.ndarray | None = None
        self.last_indices: list[int] = []

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(len(self.rows), self.batch_size)
        return full + (0 if self.drop_last or rest == 0 else 1)

    def _current_order(self) -> np.ndarray:
        if self._order is None:
            self._order = self.sampler.epoch_order(self.epoch)
        return self._order

    def next_batch(self) -> Any:
        """The next batch, moving to the next epoch (and its order) when the current one is exhausted."""
        if self.batch_in_epoch >= len(self):
            self.epoch += 1
            self.batch_in_epoch = 0
            self._order = None
        order = self._current_order()
        start = self.batch_in_epoch * self.batch_size
        indices = order[start : start + self.batch_size].tolist()
        self.batch_in_epoch += 1
        self.last_indices = indices
        batch = [{**self.rows[i], "dataset_index": i} for i in indices]
        return self.collate_fn(batch) if self.collate_fn else batch

    def __iter__(self) -> Iterator[Any]:
        """The remaining batches of the current epoch (all of them for a fresh epoch)."""
        if self.batch_in_epoch >= len(self):
            self.epoch += 1
            self.batch_in_epoch = 0
            self._order = None
        while self.batch_in_epoch < len(self):
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Position and sampler state; JSON-serialisable."""
        state = {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "num_rows": len(self.rows),
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
            "fingerprint": self.fingerprint,
            "sampler": self.sampler.state_dict(),
        }
        if self.sampler.adaptive and self._order is not None:
            state["order"] = self._order.tolist()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()``; refuses a different dataset, batch size or ``drop_last``."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        for key, mine in (("num_rows", len(self.rows)), ("batch_size", self.batch_size), ("drop_last", self.drop_last),
                          ("fingerprint", self.fingerprint)):
            if state.get(key) != mine:
                raise ValueError(f"loader state has {key}={state.get(key)!r} but this loader has {key}={mine!r}")
        self.sampler.load_state_dict(state["sampler"])
        self.epoch = int(state["epoch"])
        self.batch_in_epoch = int(state["batch_in_epoch"])
        order = state.get("order")
        self._order = np.asarray(order, np.int64) if order is not None else None
