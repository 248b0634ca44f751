"""Reward managers: turn a batch of responses into token-level scores.

Inputs are plain arrays and lists (no trainer container): response token ids ``[B, T]``, the response
mask ``[B, T]`` (1 on generated tokens), per-sample ``data_source``, ``ground_truth``, ``extra_info``, and
either the decoded responses or a tokenizer with ``decode(list[int]) -> str``.

* ``naive``: the rule score of each response is placed on its last valid response token (outcome
  reward; every other position is 0).
* ``dapo``: the same, plus DAPO's overlong soft punishment (Yu et al., 2025, eq. 13) computed in tokens
  by ``jaxrl_hf.algos.compute_overlong_penalty``, added to the score; counts of overlong responses are
  returned as metrics.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl_hf.config.schema import OverlongBufferConfig
from jaxrl_hf.errors import NonFiniteError
from jaxrl_hf.rewards.dispatch import ScoreFnSpec
from jaxrl_hf.rewards.pool import ScoreTask, make_scorer



@dataclasses.dataclass
class RewardOutput:
    """What a reward manager returns for a batch of B responses of padded length T."""

    token_level_scores: np.ndarray
    """``[B, T]`` float32: the score on each response's last valid token, 0 elsewhere."""
    extras: dict[str, list]
    """Per-sample lists: ``score``, ``acc``, ``pred``, ``timed_out`` (+ ``overlong_reward``, ``overlong``)."""
    metrics: dict[str, float]
    """Batch summaries, e.g. ``reward/score_mean``, ``reward/overlong_ratio``."""


def overlong_buffer_config(config: OverlongBufferConfig | Mapping[str, Any] | None) -> OverlongBufferConfig:
    """``reward_model.overlong_buffer`` as the schema's `OverlongBufferConfig` (``len`` is L_cache in tokens,
    ``penalty_factor`` scales the penalty; L_max is the manager's ``max_response_length``); a mapping's unknown
    keys raise, listing the valid ones."""
    if isinstance(config, OverlongBufferConfig):
        return config
    config = dict(config or {})
    valid = [f.name for f in dataclasses.fields(OverlongBufferConfig)]
    unknown = sorted(set(config) - set(valid))
    if unknown:
        raise ValueError(f"overlong_buffer: unknown keys {unknown}; valid keys: {valid}")
    return OverlongBufferConfig(**config)


def response_decoder(tokenizer: Any):
    """``ids -> str`` from a tokenizer: special tokens skipped when ``decode`` takes the flag."""
    decode = getattr(tokenizer, "decode", None)
    if not callable(decode):
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no decode(ids) method")
    params = inspect.signature(decode).parameters
    takes_flag = "skip_special_tokens" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    eos = getattr(tokenizer, "eos_token", None)

    def run(ids: list[int]) -> str:
        text = decode(ids, skip_special_tokens=True) if takes_flag else decode(ids)
        if isinstance(eos, str) and eos and text.endswith(eos):
            text = text[: -len(eos)]
        return text

    return run


def _check_batch(name: str, values: Sequence | None, batch: int) -> None:
    if values is not None and len(values) != batch:
        raise ValueError(f"reward manager: {name} has {len(values)} entries for a batch of {batch} responses")


class NaiveRewardManager:
    """Outcome reward on the last valid response token (verl's ``naive`` manager).

    ``score_fn``: which scorer (built-in dispatch by default, or a ``custom_reward_function``).
    ``num_workers``: 0 scores in this process; N > 0 scores on N worker processes.
    ``timeout_s``: wall-clock bound for one score; a score that runs past it is 0 (with a warning).
    ``num_examine``: how many responses per data source to print (stdout) per call, as verl's manager does.
    """

    name = "naive"

    def __init__(
        self,
        score_fn: ScoreFnSpec | None = None,
        *,
        tokenizer: Any = None,
        num_workers: int = 0,
        timeout_s: float = 10.0,
        num_examine: int = 0,
    ) -> None:
        self.score_fn = score_fn or ScoreFnSpec()
        self._decode = response_decoder(tokenizer) if tokenizer is not None else None
        self.num_examine = num_examine
        self._scorer = make_scorer(self.score_fn, num_workers, timeout_s)

    # -- scoring -----------------------------------------------------------------------------------
    def score_texts(
        self,
        responses: Sequence[str],
        data_sources: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Mapping | None] | None = None,
    ) -> list[dict]:
        """Score decoded responses; one dict (``score``, ``acc``, ``pred``, ``timed_out``, ...) each."""
        n = len(responses)
        for name, values in (("data_sources", data_sources), ("ground_truths", ground_truths), ("extra_infos", extra_infos)):
            _check_batch(name, values, n)
        infos = extra_infos if extra_infos is not None else [None] * n
        tasks: list[ScoreTask] = [
            (str(data_sources[i]), responses[i], ground_truths[i], infos[i]) for i in range(n)
        ]
        results = self._scorer.score(tasks)
        self._examine(tasks, results)
        return results

    def _examine(self, tasks: Sequence[ScoreTask], results: Sequence[dict]) -> None:
        if self.num_examine <= 0:
            return
        shown: dict[str, int] = defaultdict(int)
        for (source, text, truth, _), result in zip(tasks, results):
            if shown[source] < self.num_examine:
                shown[source] += 1
                print(f"[{source}] [response] {text[-500:]}\n[ground_truth] {truth}\n[score] {result.get('score')} "
                      f"[acc] {result.get('acc')} [pred] {result.get('pred')}", flush=True)

    def _response_texts(self, response_ids: np.ndarray, mask: np.ndarray, responses: Sequence[str] | None) -> list[str]:
        if responses is not None:
            _check_batch("responses", responses, mask.shape[0])
            return [str(r) for r in responses]
        if self._decode is None:
            raise ValueError("reward manager: pass the decoded responses or construct the manager with a tokenizer")
        return [self._decode(response_ids[i][mask[i]].tolist()) for i in range(mask.shape[0])]

    def extra_rewards(self, lengths: np.ndarray) -> tuple[np.ndarray, dict[str, list], dict[str, float]]:
        """Per-sample reward added to the rule score (none for ``naive``), extras and metrics."""
        return np.zeros(lengths.shape, np.float64), {}, {}

    def __call__(
        self,
        response_ids: np.ndarray,
        response_mask: np.ndarray,
        data_sources: Sequence[str],
        ground_truths: Sequence[Any],
        extra_infos: Sequence[Mapping | None] | None = None,
        responses: Sequence[str] | None = None,
    ) -> RewardOutput:
        """Score a batch; see ``RewardOutput``. ``responses`` (decoded texts) skip decoding."""
        mask = np.asarray(response_mask)
        if mask.ndim != 2:
            raise ValueError(f"reward manager: response_mask must be [B, T], got shape {mask.shape}")
        ids = np.asarray(response_ids)
        if ids.shape != mask.shape:
            raise ValueError(f"reward manager: response_ids {ids.shape} and response_mask {mask.shape} differ in shape")
        mask = mask.astype(bool)
        texts = self._response_texts(ids, mask, responses)
        results = self.score_texts(texts, data_sources, ground_truths, extra_infos)

        lengths = mask.sum(axis=1)
        bonus, extra_lists, extra_metrics = self.extra_rewards(lengths)
        rewards = np.array([r["score"] for r in results], np.float64) + bonus
        bad = np.flatnonzero(~np.isfinite(rewards))
        if bad.size:
            i = int(bad[0])
            info = (extra_infos or [None] * len(results))[i] or {}
            where = f", extra_info.index {info['index']}" if isinstance(info, Mapping) and "index" in info else ""
            raise NonFiniteError(
                f"the scorer for data source {data_sources[i]!r} returned {results[i]['score']!r} for row {i} of the "
                f"batch{where} ({bad.size} non-finite in all); response starts {texts[i][:80]!r}: a reward must be "
                f"a finite number")

        batch, width = mask.shape
        scores = np.zeros((batch, width), np.float32)
        has_token = lengths > 0
        last = width - 1 - np.argmax(mask[:, ::-1], axis=1)  # index of the last 1 in each row
        rows = np.nonzero(has_token)[0]
        scores[rows, last[rows]] = rewards[rows]

        keys = {"score", "acc", "pred", "timed_out"}.union(*(r.keys() for r in results))
        extras: dict[str, list] = {key: [r.get(key) for r in results] for key in sorted(keys)}  # aligned per sample
        extras.update(extra_lists)
        acc = np.array([float(a) if a is not None else 0.0 for a in extras["acc"]])
        metrics = {
            "reward/score_mean": float(np.mean(rewards)) if batch else 0.0,
            "reward/acc_mean": float(acc.mean()) if batch else 0.0,
            "reward/timeouts": float(sum(bool(t) for t in extras["timed_out"])),
            "reward/empty_responses": float(batch - has_token.sum()),
            **extra_metrics,
        }
        return RewardOutput(token_level_scores=scores, extras=dict(extras), metrics=metrics)

    def close(self) -> None:
        """Release the worker processes (if any)."""
        self._scorer.close()

    def __enter__(self) -> "NaiveRewardManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DAPORewardManager(NaiveRewardManager):
    """``naive`` plus DAPO's overlong soft punishment (eq. 13) in tokens, with overlong counts logged.

    ``max_response_length`` is L_max; ``overlong_buffer.len`` is L_cache (``0 < L_cache <= L_max``).
    """

    name = "dapo"

    def __init__(
        self,
        score_fn: ScoreFnSpec | None = None,
        *,
        max_response_length: int | None = None,
        overlong_buffer: OverlongBufferConfig | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        buffer = overlong_buffer_config(overlong_buffer)
        if buffer.enable:
            if max_response_length is None:
                raise ValueError("dapo reward manager: overlong_buffer.enable needs max_response_length")
            if buffer.len <= 0:
                raise ValueError(f"dapo reward manager: overlong_buffer.len must be > 0 when enabled, got {buffer.len}")
            if buffer.len > max_response_length:
                raise ValueError(
                    f"dapo reward manager: overlong_buffer.len={buffer.len} exceeds max_response_length={max_response_length}"
                )
        self.overlong_buffer = buffer
        self.max_response_length = max_response_length
        super().__init__(score_fn, **kwargs)

    def extra_rewards(self, lengths: np.ndarray) -> tuple[np.ndarray, dict[str, list], dict[str, float]]:
        """R_len of each response (0 unless the overlong buffer is enabled) and overlong statistics."""
        if not self.overlong_buffer.enable:
            return super().extra_rewards(lengths)
        from jaxrl_hf.algos import compute_overlong_penalty  # imports JAX: only where DAPO shaping is on

        penalty = np.asarray(
            compute_overlong_penalty(
                lengths, self.max_response_length, self.overlong_buffer.len, self.overlong_buffer.penalty_factor
            ),
            np.float64,
        )
        overlong = penalty < 0
        extras = {"overlong_reward": penalty.tolist(), "overlong": overlong.tolist()} if self.overlong_buffer.log else {}
        metrics = {
            "reward/overlong_count": float(overlong.sum()),
            "reward/overlong_ratio": float(overlong.mean()) if len(lengths) else 0.0,
            "reward/overlong_reward_mean": float(penalty.mean()) if len(lengths) else 0.0,
        }
        return penalty, extras, metrics
