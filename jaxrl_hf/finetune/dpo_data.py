"""DPO data: preference pairs (`jaxrl_hf.rewards.rm_data` rows: ``prompt``, ``chosen``, ``rejected``) tokenised as
``chat_template(prompt, add_generation_prompt=True) + response + eos`` (the layout the RL rollout produces and the
reward model scores), with the response tokens marked, in padded ``[2P, T]`` batches: rows ``0..P-1`` are the
chosen sequences, rows ``P..2P-1`` the rejected ones of the same pairs.

``loss_mask[t]`` marks the positions whose next token (``targets[t]``) belongs to the response (including its
end-of-sequence token); the prompt is never scored. Pairs longer than ``max_length`` are dropped and counted
(never truncated).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxrl_hf.models.tokenizer import Tokenizer
from jaxrl_hf.rewards.rm_data import PreferencePair, encode_sequence


@dataclass(frozen=True)
class EncodedPreferences:
    """Token ids of the kept pairs, where each response starts, and the count dropped for length."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    prompt_lengths: list[int]
    rows: list[str]
    dropped_too_long: int

    def __len__(self) -> int:
        return len(self.chosen)


def encode_preferences(pairs: Sequence[PreferencePair], tokenizer: Tokenizer, eos_id: int,
                       max_length: int) -> EncodedPreferences:
    """Tokenise every pair (module docstring); a pair with a sequence over ``max_length`` tokens is dropped."""
    chosen, rejected, prompt_lengths, rows, dropped = [], [], [], [], 0
    for pair in pairs:
        prompt = tokenizer.apply_chat_template(list(pair.prompt), add_generation_prompt=True, tokenize=True)
        c = encode_sequence(tokenizer, pair.prompt, pair.chosen, eos_id)
        r = encode_sequence(tokenizer, pair.prompt, pair.rejected, eos_id)
        if len(c) > max_length or len(r) > max_length:
            dropped += 1
            continue
        chosen.append(c)
        rejected.append(r)
        prompt_lengths.append(len(prompt))
        rows.append(f"{pair.source}: row {pair.row}")
    return EncodedPreferences(chosen, rejected, prompt_lengths, rows, dropped)


def batch_length(longest: int, bucket: int, max_length: int) -> int:
    """Padded width: ``longest`` rounded up to a multiple of ``bucket``, at most ``max_length`` (few programs)."""
    return min(max_length, -(-max(longest, 1) // bucket) * bucket)


def preference_batch(encoded: EncodedPreferences, indices: Sequence[int], batch_size: int, pad_id: int,
                     max_length: int, bucket: int = 64) -> dict[str, np.ndarray]:
    """Pairs ``indices`` as a ``[2·batch_size, T]`` batch: ``input_ids``, ``attention_mask``, ``targets`` (int32),
    ``loss_mask`` (float32) and ``pair_mask [batch_size]`` (0 for filler slots when ``indices`` is short)."""
    if not 0 < len(indices) <= batch_size:
        raise ValueError(f"preference_batch: {len(indices)} pairs for a batch of {batch_size}")
    picked = list(indices) + [indices[0]] * (batch_size - len(indices))
    sequences = [encoded.chosen[i] for i in picked] + [encoded.rejected[i] for i in picked]
    starts = [encoded.prompt_lengths[i] for i in picked] * 2
    width = batch_length(max(len(s) for s in sequences), bucket, max_length)
    rows = len(sequences)
    ids = np.full((rows, width), pad_id, np.int32)
    attention = np.zeros((rows, width), np.int32)
    response = np.zeros((rows, width), np.float32)
    for j, (seq, start) in enumerate(zip(sequences, starts)):
        ids[j, :len(seq)] = seq
        attention[j, :len(seq)] = 1
        response[j, start:len(seq)] = 1.0
    targets = np.full_like(ids, pad_id)
    targets[:, :-1] = ids[:, 1:]
    loss_mask = np.zeros_like(response)
    loss_mask[:, :-1] = response[:, 1:]
    pair_mask = np.zeros((batch_size,), np.float32)
    pair_mask[: len(indices)] = 1.0
    return {"input_ids": ids, "attention_mask": attention, "targets": targets, "loss_mask": loss_mask,
            "pair_mask": pair_mask}
