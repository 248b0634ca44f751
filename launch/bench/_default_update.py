"""The default DAPO run's actor update for the benchmarks that time it (`bench_update_commits.py`,
`bench_update_groups.py`): SmolLM2-135M's dimensions (random weights), bfloat16 compute over float32 master weights,
layers unrolled, the shared prompt packed (``model.use_remove_padding``), n = 4 samples a prompt, 4 prompts a call,
prompts of 48-58 tokens left-padded to ``prompt`` columns and responses of 4-28 tokens right-padded to ``response``
(the default run's lengths), and the trainer's ``perf/mfu/actor`` of a call.
"""

from __future__ import annotations

import copy
from typing import Any

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                    num_kv_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)
GROUPS, N = 4, 4


def update_worker(prompt: int, response: int, groups_per_update: int = 1, peak: float | None = None,
                  name: str = "bench") -> tuple[Any, dict[str, Any]]:
    """``(worker, init_model's summary)``: an in-process actor worker making one optimizer update per
    ``groups_per_update`` groups, all in one micro-batch (``actor.ppo_mini_batch_size`` = ``groups_per_update``,
    ``ppo_micro_batch_size_per_device`` = n · ``groups_per_update``). ``peak``: None measures this machine's (cached)."""
    from _gpu_update import worker_config

    from jaxrl_hf.controller.worker import WorkerContext
    from jaxrl_hf.workers import ActorRolloutRefWorker

    config = worker_config({"model": SMOLLM2_135M, "rows": GROUPS * N, "micro": N * groups_per_update,
                            "prompt": prompt, "response": response}, "bf16-auto-none", peak)
    config["model"].update(scan_layers=False, use_remove_padding=True)
    config["actor"].update(ppo_mini_batch_size=groups_per_update, clip_ratio_low=0.2, clip_ratio_high=0.28,
                           loss_agg_mode="token-mean")
    config["rollout"]["n"] = N
    worker = ActorRolloutRefWorker._instantiate(WorkerContext("actor", name, 0, 1),
                                                (copy.deepcopy(config), "actor_rollout"), {})
    return worker, worker.init_model()


def update_batch(prompt: int, response: int, seed: int = 1, response_real: tuple[int, int] = (4, 28)) -> Any:
    """The rollout batch of one call: 4 groups of n = 4 rows at the default run's lengths (responses of
    ``response_real`` tokens, at most ``response``)."""
    import numpy as np
    from bench_shared_prompt import grouped_rows

    from jaxrl_hf.controller import Batch

    rows = GROUPS * N
    ids, mask, positions, valid = grouped_rows(GROUPS, N, prompt, response, SMOLLM2_135M["vocab_size"], seed=seed,
                                               prompt_real=(48, min(58, prompt)),
                                               response_real=(response_real[0], min(response_real[1], response)))
    advantages = np.random.default_rng(0).standard_normal((rows, 1)).astype(np.float32) * valid
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                            "responses": ids[:, prompt:], "response_mask": valid,
                            "old_log_probs": np.full((rows, response), -3.0, np.float32),
                            "advantages": advantages}, meta_info={"global_step": 0})


def update_mfu(batch: Any, summary: dict[str, Any], seconds: float) -> float:
    """The trainer's ``perf/mfu/actor`` of one ``update_actor`` call of ``seconds`` over ``batch``."""
    from jaxrl_hf.trainer.metrics import mfu_metric

    return mfu_metric(batch, {"update_actor": seconds}, summary, 1, 1, shared_group=N).get("perf/mfu/actor", 0.0)
