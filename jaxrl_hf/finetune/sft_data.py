"""SFT data: chat rows from jsonl/parquet (or GSM8K), tokenised with assistant-only loss masks, packed into
fixed-length buffers.

Rows (verl's SFT keys, each a CLI flag): a row holding ``messages_key`` (default ``messages``) is a conversation,
``[{"role", "content"}, ...]`` with at least one assistant turn; otherwise it needs ``prompt_key`` (a string: one
user turn, or a list of chat messages) and ``response_key`` (the assistant's reply string). A malformed row raises
``SFTRowError`` naming the file, the row and the keys it has. Built-in data (`gsm8k_conversations`): GSM8K train
questions (with verl's GSM8K instruction) answered by their reference solutions, calculator annotations removed.

Packing (the "remove padding" layout of `jaxrl_hf.workers.packing`): each buffer is one row of ``L`` tokens
holding whole conversations back to back; ``segment_ids`` number them 1, 2, ... (0 = unused tail), which the
decoder takes as its attention mask so a token only attends within its own conversation, and ``position_ids``
restart at 0 for each. Conversations go into buffers by first-fit decreasing (longest first, each into the first
buffer with room), so unused tails are short. ``loss_mask[t]`` marks positions whose *next* token
(``targets[t]``) is a learned assistant token of the same conversation. A conversation longer than ``L`` is
dropped and counted, never truncated (a cut answer teaches the model to stop mid-sentence).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxrl_hf.data.gsm8k import INSTRUCTION, clean_solution, read_source
from jaxrl_hf.data.io import iter_jsonl
from jaxrl_hf.data.schema import ROLES, DatasetRowError
from jaxrl_hf.finetune.chat_tokens import encode_chat
from jaxrl_hf.models.tokenizer import Tokenizer

Message = dict[str, str]


class SFTRowError(DatasetRowError):
    """An SFT data row is malformed; the message names the file, the row and the keys involved."""


@dataclass(frozen=True)
class RowKeys:
    """Which row keys hold the data (verl's ``data.messages_key`` / ``prompt_key`` / ``response_key``)."""

    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"


def _check_messages(messages: Any, where: str, key: str) -> list[Message]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise SFTRowError(f"{where}: '{key}' must be a non-empty list of chat messages, got "
                          f"{type(messages).__name__} {str(messages)[:60]!r}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise SFTRowError(f"{where}: '{key}'[{i}] must be {{'role': one of {list(ROLES)}, 'content': str}}, "
                              f"got {str(m)[:80]!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def row_to_messages(row: Any, keys: RowKeys, where: str) -> list[Message]:
    """The conversation of one row: its ``messages_key`` list, or ``prompt_key`` + ``response_key`` as a user
    (or given) prompt and one assistant reply. Raises ``SFTRowError`` naming ``where`` and the keys."""
    if not isinstance(row, Mapping):
        raise SFTRowError(f"{where}: expected an object, got {type(row).__name__}")
    if keys.messages_key in row and row[keys.messages_key] is not None:
        messages = _check_messages(row[keys.messages_key], where, keys.messages_key)
    else:
        missing = [k for k in (keys.prompt_key, keys.response_key) if row.get(k) is None]
        if missing:
            raise SFTRowError(f"{where}: needs '{keys.messages_key}' (chat messages) or both '{keys.prompt_key}' and "
                              f"'{keys.response_key}'; missing {missing}, found keys {sorted(row)}")
        prompt, response = row[keys.prompt_key], row[keys.response_key]
        if not isinstance(response, str) or not response.strip():
            raise SFTRowError(f"{where}: '{keys.response_key}' must be a non-empty string, got {str(response)[:60]!r}")
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        else:
            messages = _check_messages(prompt, where, keys.prompt_key)
        messages.append({"role": "assistant", "content": response})
    if not any(m["role"] == "assistant" for m in messages):
        raise SFTRowError(f"{where}: the conversation has no assistant turn, so it has nothing to learn")
    return messages


def read_sft_rows(path: str | os.PathLike, keys: RowKeys = RowKeys()) -> list[tuple[str, list[Message]]]:
    """``[(where, messages)]`` for every row of a ``.jsonl`` / ``.parquet`` file (rows numbered from 1)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SFT data file not found: {path}")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq

        numbered = enumerate(pq.read_table(path).to_pylist(), start=1)
    elif ext in (".jsonl", ".json"):
        numbered = iter_jsonl(path, error_cls=SFTRowError, unit="row")
    else:
        raise ValueError(f"{path}: unsupported SFT data extension {ext!r}; use .jsonl or .parquet")
    out = [(f"{path}: row {i}", row_to_messages(row, keys, f"{path}: row {i}")) for i, row in numbered]
    if not out:
        raise SFTRowError(f"{path}: no rows (the file is empty)")
    return out


def gsm8k_conversations(path: str, limit: int | None = None) -> list[tuple[str, list[Message]]]:
    """GSM8K source rows as conversations: user = question + verl's instruction, assistant = the reference
    solution without ``<<...>>`` calculator annotations (it ends in ``#### <answer>``)."""
    return [(f"{path}: line {raw['line']}",
             [{"role": "user", "content": raw["question"] + " " + INSTRUCTION},
              {"role": "assistant", "content": clean_solution(raw["answer"])}])
            for raw in read_source(path)[:limit]]


@dataclass(frozen=True)
class EncodedChats:
    """Token ids and assistant masks of the kept conversations, and how many were longer than the buffer."""

    ids: list[list[int]]
    masks: list[list[int]]
    rows: list[str]
    dropped_too_long: int

    def __len__(self) -> int:
        return len(self.ids)


def encode_conversations(conversations: Sequence[tuple[str, Sequence[Mapping[str, Any]]]], tokenizer: Tokenizer,
                         max_length: int) -> EncodedChats:
    """Tokenise each conversation (`encode_chat`); those over ``max_length`` tokens are dropped and counted."""
    ids, masks, rows, dropped = [], [], [], 0
    for where, messages in conversations:
        try:
            seq, mask = encode_chat(tokenizer, messages)
        except ValueError as err:
            raise SFTRowError(f"{where}: {err}") from None
        if len(seq) > max_length:
            dropped += 1
            continue
        ids.append(seq)
        masks.append(mask)
        rows.append(where)
    return EncodedChats(ids, masks, rows, dropped)


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices, each bin's total length ``<= capacity``: items by decreasing length (ties: lower index),
    each into the first bin with room, else a new bin. Deterministic; every item must fit alone."""
    free: list[int] = []
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-int(lengths[j]), j)):
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"item {i} has {n} tokens, more than the buffer length {capacity}")
        for b, room in enumerate(free):
            if room >= n:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(capacity - n)
    return bins


def pack_buffers(encoded: EncodedChats, length: int, pad_id: int) -> dict[str, np.ndarray]:
    """The packed training set ``[N, length]`` (module docstring): ``input_ids``, ``targets`` (next token in the
    same conversation, else ``pad_id``), ``segment_ids``, ``position_ids`` (int32) and ``loss_mask`` (float32)."""
    bins = first_fit_decreasing([len(s) for s in encoded.ids], length)
    n = len(bins)
    ids = np.full((n, length), pad_id, np.int32)
    learned = np.zeros((n, length), np.float32)
    segments = np.zeros((n, length), np.int32)
    positions = np.zeros((n, length), np.int32)
    for b, items in enumerate(bins):
        cursor = 0
        for s, i in enumerate(items, start=1):
            k = len(encoded.ids[i])
            ids[b, cursor:cursor + k] = encoded.ids[i]
            learned[b, cursor:cursor + k] = encoded.masks[i]
            segments[b, cursor:cursor + k] = s
            positions[b, cursor:cursor + k] = np.arange(k)
            cursor += k
    same = np.zeros_like(segments, bool)
    same[:, :-1] = (segments[:, 1:] == segments[:, :-1]) & (segments[:, :-1] > 0)
    targets = np.full_like(ids, pad_id)
    targets[:, :-1] = np.where(same[:, :-1], ids[:, 1:], pad_id)
    loss_mask = np.zeros_like(learned)
    loss_mask[:, :-1] = learned[:, 1:] * same[:, :-1]
    return {"input_ids": ids, "targets": targets, "segment_ids": segments, "position_ids": positions,
            "loss_mask": loss_mask}
