"""DAPO's overlong filtering (Yu et al. 2025 §3.4) on the driver: the actor's loss mask without the samples
that the length limit cut off.

A sample is truncated when its response fills the whole response width (every position attended: sampled
or, in a multi-turn loop, observed) without a stop token among its sampled tokens (`jaxrl_hf.algos.is_truncated`).
The stop tokens are the rollout engine's, which ``generate_sequences`` reports as ``meta_info["eos_token_ids"]``.
Only the batch sent to ``update_actor`` is filtered: advantages (computed before, over whole groups), the
logged metrics and the critic see every sample.
"""

from __future__ import annotations

import numpy as np

from jaxrl_hf.algos import is_truncated, overlong_filter_mask
from jaxrl_hf.controller import Batch

EOS_META_KEY = "eos_token_ids"


def truncated_samples(batch: Batch) -> np.ndarray:
    """``[B]`` bool: the samples that hit the response length limit without stopping."""
    eos = batch.meta_info.get(EOS_META_KEY)
    if not eos:
        raise KeyError(f"algorithm.overlong_filter needs the rollout's stop tokens (meta_info[{EOS_META_KEY!r}], "
                       f"set by actor.generate_sequences); this batch's meta_info has {sorted(batch.meta_info)}")
    responses = np.asarray(batch["responses"])
    width = responses.shape[1]
    attended = np.asarray(batch["attention_mask"])[:, -width:] != 0
    stops = np.isin(responses, np.asarray(eos)) & (np.asarray(batch["response_mask"]) != 0)
    return np.asarray(is_truncated(attended.astype(np.int32), stops, max_response_length=width))


def overlong_filtered(batch: Batch) -> tuple[Batch, dict[str, float]]:
    """``batch`` with the truncated samples' ``response_mask`` zeroed (`jaxrl_hf.algos.overlong_filter_mask`),
    and the ``overlong_filter/*`` metrics."""
    truncated = truncated_samples(batch)
    mask = np.asarray(batch["response_mask"])
    arrays = dict(batch.arrays)
    arrays["response_mask"] = np.asarray(overlong_filter_mask(mask, truncated)).astype(mask.dtype)
    metrics = {"overlong_filter/num_masked": float(truncated.sum()),
               "overlong_filter/masked_ratio": float(truncated.mean()) if len(truncated) else 0.0}
    return Batch(arrays, dict(batch.objects), dict(batch.meta_info)), metrics
