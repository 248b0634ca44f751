"""Preference pairs for reward-model training: reading, validation, tokenisation and padded batches.

A pair file is jsonl, one object per line::

    {"prompt": [{"role": "user", "content": "..."}],   # chat messages (a plain string is one user turn)
     "chosen": "the preferred response", "rejected": "the other response", ...}   # extra keys are kept

Every malformed row is an error naming the file and the line (``PreferencePairError``). A sequence is
laid out exactly as the RL loop hands a rollout to the reward model: the prompt rendered with the chat
template and the generation prompt, then the response tokens, then the end-of-sequence token (added if
the response does not already end with it). The reward is read at the last real token of that sequence.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxrl_hf.data.io import iter_jsonl
from jaxrl_hf.data.schema import ROLES, DatasetRowError



class PreferencePairError(DatasetRowError):
    """A preference-pair row is malformed; the message names the file and row (line number)."""


@dataclass(frozen=True)
class PreferencePair:
    """One validated pair: the prompt as chat messages and the preferred / dispreferred responses."""

    prompt: tuple[Mapping[str, Any], ...]
    chosen: str
    rejected: str
    source: str = "<pairs>"
    row: int = 0


def normalize_prompt(prompt: Any, where: str) -> tuple[dict[str, Any], ...]:
    """Chat messages from a pair's ``prompt`` (list of ``{"role", "content"}`` or a plain user string)."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PreferencePairError(f"{where}: 'prompt' is an empty string")
        return ({"role": "user", "content": prompt},)
    if not isinstance(prompt, list) or not prompt:
        raise PreferencePairError(f"{where}: 'prompt' must be a non-empty list of chat messages or a string, "
                                  f"got {type(prompt).__name__} {str(prompt)[:60]!r}")
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, Mapping):
            raise PreferencePairError(f"{where}: prompt message {i} must be an object, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise PreferencePairError(f"{where}: prompt message {i} has role {role!r}; valid roles: {list(ROLES)}")
        if not isinstance(content, str):
            raise PreferencePairError(f"{where}: prompt message {i} ('{role}') needs a string 'content', "
                                      f"got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    return tuple(messages)


def validate_pair(row: Any, *, source: str = "<pairs>", index: int = 0) -> PreferencePair:
    """Check one decoded row; raise ``PreferencePairError`` naming ``source`` and row ``index``."""
    where = f"{source}: row {index}"
    if not isinstance(row, Mapping):
        raise PreferencePairError(f"{where}: expected an object with 'prompt', 'chosen', 'rejected', "
                                  f"got {type(row).__name__}")
    missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
    if missing:
        raise PreferencePairError(f"{where}: missing key(s) {missing} (a pair needs 'prompt', 'chosen', 'rejected'; "
                                  f"found {sorted(row)})")
    for key in ("chosen", "rejected"):
        value = row[key]
        if not isinstance(value, str):
            raise PreferencePairError(f"{where}: '{key}' must be a string response, got {type(value).__name__}")
        if not value.strip():
            raise PreferencePairError(f"{where}: '{key}' is empty")
    if row["chosen"] == row["rejected"]:
        raise PreferencePairError(f"{where}: 'chosen' and 'rejected' are identical, so the pair states no preference")
    return PreferencePair(normalize_prompt(row["prompt"], where), row["chosen"], row["rejected"], source, index)


def read_pairs(path: str | os.PathLike) -> list[PreferencePair]:
    """All pairs of a jsonl file, each validated; the row number is the 1-based line number."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"preference-pair file not found: {path}")
    pairs = [validate_pair(row, source=path, index=line_no)
             for line_no, row in iter_jsonl(path, error_cls=PreferencePairError, unit="row")]
    if not pairs:
        raise PreferencePairError(f"{path}: no preference pairs (the file is empty)")
    return pairs


def pairs_from_rows(rows: Sequence[Mapping[str, Any]], source: str = "<rows>") -> list[PreferencePair]:
    """Validate in-memory rows (e.g. ``jaxrl_hf.data.gsm8k.preference_pairs``); rows are numbered from 1."""
    return [validate_pair(row, source=source, index=i) for i, row in enumerate(rows, start=1)]


def write_pairs(pairs: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> str:
    """Write rows as jsonl (directories created); returns the path."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for row in pairs:
            fh.write(json.dumps(dict(row), ensure_ascii=False) + "\n")
    return path


# --- tokenisation ------------------------------------------------------------------------------------

def encode_prompt(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """``chat_template(messages, add_generation_prompt=True)`` as token ids."""
    return list(tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True))


def encode_response(tokenizer: Any, response: str, eos_id: int) -> list[int]:
    """``response`` as token ids, ending in ``eos_id`` (added unless the text already ends with it)."""
    response_ids = tokenizer.encode(response)
    if not response_ids or response_ids[-1] != eos_id:
        response_ids = [*response_ids, eos_id]
    return list(response_ids)


def encode_sequence(tokenizer: Any, messages: Sequence[Mapping[str, Any]], response: str, eos_id: int) -> list[int]:
    """``chat_template(messages, add_generation_prompt=True) + response + [eos]`` as token ids."""
    return [*encode_prompt(tokenizer, messages), *encode_response(tokenizer, response, eos_id)]


@dataclass(frozen=True)
class EncodedPairs:
    """Token ids of the kept pairs, the length of each pair's prompt (its response starts there, in both
    sequences), where each came from, and a count of those dropped for exceeding ``max_length``."""

    chosen: list[list[int]]
    rejected: list[list[int]]
    prompt_lengths: list[int]
    kept_rows: list[tuple[str, int]]
    dropped_too_long: int

    def __len__(self) -> int:
        return len(self.chosen)

    def subset(self, indices: Sequence[int]) -> "EncodedPairs":
        """The pairs ``indices`` (in that order), none counted as dropped."""
        return EncodedPairs([self.chosen[i] for i in indices], [self.rejected[i] for i in indices],
                            [self.prompt_lengths[i] for i in indices], [self.kept_rows[i] for i in indices], 0)


def encode_pairs(pairs: Sequence[PreferencePair], tokenizer: Any, eos_id: int, max_length: int) -> EncodedPairs:
    """Tokenise every pair (`encode_sequence` layout, the prompt rendered once); a pair whose chosen or rejected
    sequence is longer than ``max_length`` is dropped (never truncated: cutting the prompt would hide the question
    the answer is judged against)."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    chosen, rejected, prompt_lengths, kept, dropped = [], [], [], [], 0
    for pair in pairs:
        prompt = encode_prompt(tokenizer, pair.prompt)
        c = [*prompt, *encode_response(tokenizer, pair.chosen, eos_id)]
        r = [*prompt, *encode_response(tokenizer, pair.rejected, eos_id)]
        if len(c) > max_length or len(r) > max_length:
            dropped += 1
            continue
        chosen.append(c)
        rejected.append(r)
        prompt_lengths.append(len(prompt))
        kept.append((pair.source, pair.row))
    return EncodedPairs(chosen, rejected, prompt_lengths, kept, dropped)


def pad_right(sequences: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [N, length] int32, mask [N, length] int32)`` with right padding."""
    ids = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for i, seq in enumerate(sequences):
        if len(seq) > length:
            raise ValueError(f"sequence {i} has {len(seq)} tokens, longer than the padded length {length}")
        ids[i, : len(seq)] = seq
        mask[i, : len(seq)] = 1
    return ids, mask


def bucket_length(n: int, bucket: int, max_length: int) -> int:
    """``n`` rounded up to a multiple of ``bucket`` (capped at ``max_length``), so few shapes get compiled."""
    return min(max(bucket, -(-n // bucket) * bucket), max(max_length, n))


def make_batch(encoded: EncodedPairs, indices: Sequence[int], batch_size: int, pad_id: int,
               bucket: int = 64, max_length: int = 1 << 30) -> dict[str, np.ndarray]:
    """A padded batch of ``batch_size`` pairs from ``indices`` (fewer indices: filler rows with
    ``pair_mask = 0``). Keys: ``chosen_ids``, ``chosen_mask``, ``rejected_ids``, ``rejected_mask``
    (``[P, T]`` int32, chosen and rejected padded to one length ``T``) and ``pair_mask`` ``[P]`` float32."""
    indices = list(indices)
    if not indices or len(indices) > batch_size:
        raise ValueError(f"a batch needs 1..{batch_size} pair indices, got {len(indices)}")
    fill = batch_size - len(indices)
    chosen = [encoded.chosen[i] for i in indices] + [encoded.chosen[indices[0]]] * fill
    rejected = [encoded.rejected[i] for i in indices] + [encoded.rejected[indices[0]]] * fill
    length = bucket_length(max(len(s) for s in chosen + rejected), bucket, max_length)
    chosen_ids, chosen_mask = pad_right(chosen, length, pad_id)
    rejected_ids, rejected_mask = pad_right(rejected, length, pad_id)
    pair_mask = np.array([1.0] * len(indices) + [0.0] * fill, np.float32)
    return {"chosen_ids": chosen_ids, "chosen_mask": chosen_mask, "rejected_ids": rejected_ids,
            "rejected_mask": rejected_mask, "pair_mask": pair_mask}
