"""PRM reward manager: the rule score plus a process reward model's aggregated step scores.

A response is split into steps exactly as the PRM was trained (`jaxrl_hf.rewards.prm_data.split_steps` on the
step tag, each ``step + tag`` tokenised on its own after the chat-templated prompt); the PRM's probability
``p_k = sigmoid(v)`` at each step's boundary token is that step's score. The per-step scores are aggregated
into one outcome-style reward, or kept per step (``reward_model.prm.aggregation``; Lightman et al. 2023 §3 use
the product/min, Wang et al. 2024 the min):

* ``min``:  ``r = min_k p_k``  (a solution is as good as its worst step);
* ``last``: ``r = p_K``       (the PRM's judgement after the final step);
* ``per_step``: ``r_t = w · Σ_{k: t_k = t} p_k`` on the response token ``t_k`` that ends step ``k`` (its text and
  step tag; `jaxrl_hf.rewards.prm_placement`), so token-level estimators (GAE, REINFORCE++) credit each step;
  an outcome estimator (GRPO) sees the sum ``Σ_t r_t = w · Σ_k p_k`` (``prm_score`` is ``r = Σ_k p_k``).

For ``min``/``last``, ``r · prm_weight`` (``w``) is added to the rule score on the response's last valid token
(``naive`` manager layout); a response with no step scores 0 from the PRM. ``per_step`` maps text offsets to the
response's own tokens, so the scored text must be the decoded ``response_mask`` tokens (single-turn rollouts: a
multi-turn rollout's tool tokens are refused at config time). The prompt of each response is, in this order:
``prompt_ids`` (the policy's chat-templated prompt tokens, what the trainer passes: the PRM must share the policy's
tokenizer), the ``prompts`` argument (messages or text, templated here), ``extra_info['prompt']``,
``extra_info['question']``. Without ``responses`` or a manager ``tokenizer``, responses are decoded with the PRM's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrl_hf.rewards.managers import NaiveRewardManager, RewardOutput, response_decoder
from jaxrl_hf.rewards.prm_data import STEP_TAG, encode_steps, split_steps, step_end_offsets
from jaxrl_hf.rewards.prm_placement import place_step_scores, step_end_tokens
from jaxrl_hf.rewards.prm_training import make_step_score_fn
from jaxrl_hf.rewards.rm_data import pad_right
from jaxrl_hf.rewards.rm_io import RewardModel, load_reward_model

PRM_AGGREGATIONS = ("min", "last", "per_step")


def aggregate_step_scores(step_scores: np.ndarray, step_mask: np.ndarray, how: str) -> np.ndarray:
    """``[B]`` reward from per-step scores ``[B, S]`` where ``step_mask`` is 1 (``min``, ``last``, or the sum
    ``Σ_k p_k`` for ``per_step``: what an outcome estimator sees); 0 for a row with no steps."""
    if how not in PRM_AGGREGATIONS:
        raise ValueError(f"reward_model.prm.aggregation={how!r}: valid values are {list(PRM_AGGREGATIONS)}")
    scores = np.asarray(step_scores, np.float64)
    mask = np.asarray(step_mask).astype(bool)
    has = mask.any(axis=1)
    if how == "min":
        out = np.where(mask, scores, np.inf).min(axis=1)
    elif how == "per_step":
        out = np.where(mask, scores, 0.0).sum(axis=1)
    else:
        last = scores.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
        out = scores[np.arange(scores.shape[0]), last]
    return np.where(has, out, 0.0)


@dataclass
class ProcessRewardModel:
    """A PRM directory (`launch/train_prm.py` output, `rm_io` layout) and its step tag."""

    model: RewardModel
    step_tag: str = STEP_TAG

    @cached_property
    def _score_fn(self) -> Any:
        return make_step_score_fn(self.model.config)

    def encode(self, prompt: Sequence[Mapping[str, Any]] | Sequence[int] | str, response: str) -> tuple[list[int], list[int]]:
        """Token ids and step boundaries of ``response`` to ``prompt`` (the training layout)."""
        return encode_steps(self.model.tokenizer, prompt, split_steps(response, self.step_tag), self.step_tag)

    def step_scores(self, items: Sequence[tuple[Sequence[Mapping[str, Any]] | str, str]],
                    bucket: int = 64) -> tuple[np.ndarray, np.ndarray]:
        """``(scores [N, S], mask [N, S])``: each response's step probabilities, padded to the most steps."""
        encoded = [self.encode(p, r) for p, r in items]
        most = max([len(b) for _, b in encoded] + [1])
        scores, mask = np.zeros((len(items), most)), np.zeros((len(items), most), np.int32)
        with_steps = [i for i, (_, b) in enumerate(encoded) if b]
        if not with_steps:
            return scores, mask
        seqs = [encoded[i][0] for i in with_steps]
        length = -(-max(len(s) for s in seqs) // bucket) * bucket
        ids, attn = pad_right(seqs, length, self.model.pad_id)
        probs = np.asarray(self._score_fn(self.model.params, jnp.asarray(ids), jnp.asarray(attn)))
        for row, i in enumerate(with_steps):
            b = encoded[i][1]
            scores[i, :len(b)] = probs[row, b]
            mask[i, :len(b)] = 1
        return scores, mask


def load_process_reward_model(path: str, dtype: str = "float32") -> ProcessRewardModel:
    """Load a PRM directory; its ``reward_model.json`` names the step tag it was trained with."""
    model = load_reward_model(path, dtype=dtype)
    return ProcessRewardModel(model, model.metadata.get("step_tag", STEP_TAG))


class PRMRewardManager(NaiveRewardManager):
    """``naive`` rule scores + ``prm_weight`` x the PRM's aggregated step score (see the module docstring)."""

    wants_prompt_ids = True

    def __init__(self, *, prm: ProcessRewardModel, aggregation: str = "min", prm_weight: float = 1.0,
                 **kwargs: Any) -> None:
        if aggregation not in PRM_AGGREGATIONS:
            raise ValueError(f"reward_model.prm.aggregation={aggregation!r}: valid values are {list(PRM_AGGREGATIONS)}")
        super().__init__(**kwargs)
        self.prm, self.aggregation, self.prm_weight = prm, aggregation, float(prm_weight)
        self._prm_decode: Any = None

    @staticmethod
    def _prompt(i: int, prompts: Sequence[Any] | None, extra_infos: Sequence[Mapping | None] | None,
                prompt_ids: Sequence[Sequence[int]] | None = None) -> Any:
        if prompt_ids is not None:
            return [int(t) for t in prompt_ids[i]]
        if prompts is not None:
            return prompts[i]
        info = (extra_infos or [None] * (i + 1))[i] or {}
        for key in ("prompt", "question"):
            if key in info:
                return info[key]
        raise ValueError(f"prm reward manager: sample {i} has no prompt (pass prompts= or extra_info['prompt'] / "
                         "extra_info['question'])")

    def __call__(self, response_ids: np.ndarray, response_mask: np.ndarray, data_sources: Sequence[str],
                 ground_truths: Sequence[Any], extra_infos: Sequence[Mapping | None] | None = None,
                 responses: Sequence[str] | None = None, prompts: Sequence[Any] | None = None,
                 prompt_ids: Sequence[Sequence[int]] | None = None) -> RewardOutput:
        mask = np.asarray(response_mask).astype(bool)
        ids = np.asarray(response_ids)
        if responses is None and self._decode is None:  # the PRM shares the policy's tokenizer
            responses = [self._decode_tokens(ids[i][mask[i]].tolist()) for i in range(mask.shape[0])]
        out = super().__call__(response_ids, response_mask, data_sources, ground_truths, extra_infos, responses)
        texts = self._response_texts(ids, mask, responses)
        items = [(self._prompt(i, prompts, extra_infos, prompt_ids), t) for i, t in enumerate(texts)]
        step_scores, step_mask = self.prm.step_scores(items)
        prm = aggregate_step_scores(step_scores, step_mask, self.aggregation)
        scores = out.token_level_scores.copy()
        if self.aggregation == "per_step":
            positions = [self._step_positions(i, ids, mask, texts[i]) for i in range(mask.shape[0])]
            scores += place_step_scores(step_scores, step_mask, positions, mask.shape[1],
                                        self.prm_weight).astype(np.float32)
        else:
            lengths = mask.sum(axis=1)
            last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
            rows = np.nonzero(lengths > 0)[0]
            scores[rows, last[rows]] += (self.prm_weight * prm[rows]).astype(np.float32)
        extras = {**out.extras, "prm_score": prm.tolist(), "prm_steps": step_mask.sum(axis=1).tolist()}
        metrics = {**out.metrics, "reward/prm_score_mean": float(prm.mean()) if len(prm) else 0.0,
                   "reward/prm_steps_mean": float(step_mask.sum(axis=1).mean()) if len(prm) else 0.0}
        return RewardOutput(token_level_scores=scores, extras=extras, metrics=metrics)

    def _decode_tokens(self, token_ids: list[int]) -> str:
        if self._prm_decode is None:
            self._prm_decode = self._decode or response_decoder(self.prm.model.tokenizer)
        return self._prm_decode(token_ids)

    def _step_positions(self, i: int, ids: np.ndarray, mask: np.ndarray, text: str) -> list[int]:
        """Response columns of row ``i`` that end its steps (`prm_placement.step_end_tokens`)."""
        valid = np.flatnonzero(mask[i])
        tokens = ids[i][valid].tolist()
        if self._decode_tokens(tokens) != text:
            raise ValueError(
                f"reward_model.prm.aggregation='per_step': response {i}'s scored text is not the decoding of its "
                f"response_mask tokens (a multi-turn rollout's tool tokens?), so its steps cannot be placed on "
                f"tokens; use aggregation 'min' or 'last' for such rollouts")
        ends = step_end_offsets(text, self.prm.step_tag)
        return valid[step_end_tokens(self._decode_tokens, tokens, ends)].tolist()
