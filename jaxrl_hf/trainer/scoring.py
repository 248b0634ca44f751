"""Rewards on the driver: the rule reward manager (``jaxrl_hf.rewards``) turned into Batch columns.

``RewardFunction(config, tokenizer)(batch)`` returns a Batch with ``token_level_scores [B, R]`` (the reward on
the last response token; ``reward_model.prm.aggregation=per_step`` also puts step scores on earlier tokens),
``seq_score`` ``[B]`` (that reward summed over tokens: the scorer's score with the overlong penalty and the
reward model's), ``score`` / ``acc`` ``[B]`` (what the scoring function returned, as verl's reward extra info;
dynamic sampling filters on them) and, as objects, ``pred`` (the extracted answer, for maj@N); plus reward
metrics in meta_info.
A learned reward model's ``rm_scores`` (from ``RewardModelWorker.compute_rm_score``) are added to the rule
score with weight 1 (the rule score is scaled by ``reward_model.rule_weight``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.controller import Batch
from jaxrl_hf.rewards import ScoreFnSpec, make_reward_manager


def trajectory_texts(batch: Batch, tokenizer: Any) -> list[str] | None:
    """The whole response of each row as text — sampled and tool tokens (a multi-turn rollout's attended
    response tokens) — when it differs from the sampled tokens; ``None`` (the manager decodes
    ``response_mask``'s tokens) for single-turn rows."""
    if "attention_mask" not in batch or tokenizer is None:
        return None
    mask = np.asarray(batch["response_mask"])
    attended = np.asarray(batch["attention_mask"])[:, -mask.shape[1]:]
    if np.array_equal(attended != 0, mask != 0):
        return None
    ids = np.asarray(batch["responses"])
    return [tokenizer.decode(ids[i][attended[i] != 0].tolist()) for i in range(len(ids))]


class RewardFunction:
    """Scores generated responses with the configured reward manager (in-process or a process pool)."""

    def __init__(self, config: RunConfig, tokenizer: Any, *, validation: bool = False) -> None:
        """``validation=True``: the plain rule score (no overlong shaping, no reward-model mix)."""
        rm = config.reward_model
        crf = config.custom_reward_function
        spec = dataclasses.replace(
            ScoreFnSpec.from_config({"path": crf.path, "name": crf.name, "reward_kwargs": crf.reward_kwargs}),
            scorer=rm.scorer)
        kwargs: dict[str, Any] = dict(tokenizer=tokenizer, num_workers=rm.num_workers, timeout_s=rm.timeout_s,
                                      num_examine=rm.num_examine)
        manager = "naive" if validation else rm.reward_manager
        if manager == "dapo":
            kwargs.update(max_response_length=config.rollout.response_length,
                          overlong_buffer=rm.overlong_buffer)
        if manager == "prm":
            from jaxrl_hf.rewards.prm_manager import load_process_reward_model
            kwargs.update(prm=load_process_reward_model(rm.prm.path), aggregation=rm.prm.aggregation,
                          prm_weight=rm.prm.weight)
        self.manager = make_reward_manager(manager, score_fn=spec, **kwargs)
        self.tokenizer = tokenizer
        self.rule_weight = rm.rule_weight if (rm.enable and not validation) else 1.0

    def __call__(self, batch: Batch) -> Batch:
        """Rule scores of ``batch`` (needs ``responses``, ``response_mask``, ``data_source``, ``ground_truth``)."""
        kwargs = {"responses": trajectory_texts(batch, self.tokenizer)}
        if getattr(self.manager, "wants_prompt_ids", False) and "prompts" in batch:  # the PRM scores prompt + steps
            kwargs["prompt_ids"] = [row[m > 0].tolist() for row, m in zip(np.asarray(batch["prompts"]),
                                                                          np.asarray(batch["prompt_mask"]))]
        out = self.manager(
            batch["responses"], batch["response_mask"], list(batch["data_source"]), list(batch["ground_truth"]),
            list(batch["extra_info"]) if "extra_info" in batch else None, **kwargs,
        )
        scores = out.token_level_scores.astype(np.float32) * np.float32(self.rule_weight)
        if "rm_scores" in batch:
            scores = scores + np.asarray(batch["rm_scores"], np.float32)
        acc, raw = ([float(a) if a is not None else 0.0 for a in out.extras[key]] for key in ("acc", "score"))
        preds = [None if p is None else str(p) for p in out.extras.get("pred", [None] * len(batch))]
        return Batch.from_dict(
            {"token_level_scores": scores, "seq_score": scores.sum(-1), "score": np.asarray(raw, np.float32),
             "acc": np.asarray(acc, np.float32), "pred": preds},
            meta_info={"reward_metrics": dict(out.metrics)},
        )

    def close(self) -> None:
        """Stop the scoring processes (if any)."""
        self.manager.close()
