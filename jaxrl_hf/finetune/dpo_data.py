"""DPO data: preference pairs (`jaxrl_hf.rewards.rm_data` rows: ``prompt``, ``chosen``, ``rejected``) tokenised by
`jaxrl_hf.rewards.rm_data.encode_pairs` as ``chat_template(prompt, add_generation_prompt=True) + response + eos``
(the layout the RL rollout produces and the reward model scores; pairs longer than ``max_length`` are dropped and
counted, never truncated), here laid out in padded ``[2P, T]`` batches: rows ``0..P-1`` are the chosen sequences,
rows ``P..2P-1`` the rejected ones of the same pairs.

``loss_mask[t]`` marks the positions whose next token (``targets[t]``) belongs to the response (including its
end-of-sequence token); the prompt is never scored.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxrl_hf.rewards.rm_data import EncodedPairs, bucket_length, pad_right


def preference_batch(encoded: EncodedPairs, indices: Sequence[int], batch_size: int, pad_id: int,
                     max_length: int, bucket: int = 64) -> dict[str, np.ndarray]:
    """Pairs ``indices`` as a ``[2·batch_size, T]`` batch (``T``: the longest sequence rounded up to ``bucket``, at
    most ``max_length``): ``input_ids``, ``attention_mask``, ``targets`` (int32), ``loss_mask`` (float32) and
    ``pair_mask [batch_size]`` (0 for filler slots when ``indices`` is short)."""
    if not 0 < len(indices) <= batch_size:
        raise ValueError(f"preference_batch: {len(indices)} pairs for a batch of {batch_size}")
    picked = list(indices) + [indices[0]] * (batch_size - len(indices))
    sequences = [encoded.chosen[i] for i in picked] + [encoded.rejected[i] for i in picked]
    starts = [encoded.prompt_lengths[i] for i in picked] * 2
    ids, attention = pad_right(sequences, bucket_length(max(len(s) for s in sequences), bucket, max_length), pad_id)
    response = np.zeros(ids.shape, np.float32)
    for j, (seq, start) in enumerate(zip(sequences, starts)):
        response[j, start:len(seq)] = 1.0
    targets = np.full_like(ids, pad_id)
    targets[:, :-1] = ids[:, 1:]
    loss_mask = np.zeros_like(response)
    loss_mask[:, :-1] = response[:, 1:]
    pair_mask = np.zeros((batch_size,), np.float32)
    pair_mask[: len(indices)] = 1.0
    return {"input_ids": ids, "attention_mask": attention, "targets": targets, "loss_mask": loss_mask,
            "pair_mask": pair_mask}
