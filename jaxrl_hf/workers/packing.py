"""Micro-batches by token budget (verl's ``use_dynamic_bsz``) and packed sequences (``model.use_remove_padding``):
the host (numpy) side, pure and deterministic.

Rows arrive in the padded layout: ``input_ids``/``attention_mask``/``position_ids`` ``[B, T]`` (left-padded
prompt ++ right-padded response, ``T = P + R``) and per-row arrays ``[B, R]`` or ``[B, ...]``. A row's *length*
is its number of valid tokens (``attention_mask != 0``).

1. **Where rows run** — ``slots[m, d, s]``: the row in micro-batch ``m`` on device ``d`` at slot ``s`` (``-1``:
   an empty slot). `partition_by_tokens` fills ``M·D`` bins under a per-device token budget with a
   longest-first greedy (Graham's LPT rule: each row, longest first, goes to the least loaded bin), the
   smallest ``M`` for which every row fits, so any two bins differ by at most one row's length; bins are ranked
   by load and every ``D`` consecutive ones form a micro-batch. `partition_by_rows` is the fixed-row split
   (``ppo_micro_batch_size_per_device`` rows per device, consecutive, as the padded path).
2. **Static shapes** — `pad_slots` pads the count of micro-batches and of slots per device (`bucket`: the next
   power of two) with empty ones, so a varying partition reuses a few compiled programs.
3. **Rows** — `gather_rows` lays per-row arrays out as ``[M, D·r, ...]`` (device ``d`` owns rows ``d·r ..
   d·r + r - 1``; empty slots are zeros, so their ``response_mask`` is 0); `scatter_rows` is its inverse for
   outputs.
4. **Packing** — `pack_tokens` concatenates each device's rows into one ``[L]`` sequence: ``pack_input_ids``,
   ``pack_segment_ids`` (slot ``s`` is segment ``s + 1``, 0 = padding: the decoder's segment-id contract, see
   `jaxrl_hf.models.llama.split_attention_masks`), ``pack_position_ids`` (each row's own ``position_ids``,
   restarting at 0 per row) and ``pack_rows [M, D·r, T]``: for column ``c`` of a row's padded layout, its index
   in its device's packed sequence (0 for a padding column). Its shape tells the jitted program how many rows a
   sequence holds and how long one can be (attention then runs per row,
   `jaxrl_hf.models.packed_attention.per_row_attention`); ``pack_rows[:, P - 1 : T - 1]`` holds for response slot
   ``t`` the token *before* it (whose output scores response token ``t``), so per-token outputs gathered there
   are the padded layout's ``[:, P - 1 + t]``.
"""

from __future__ import annotations

import heapq
import math
from typing import Mapping

import numpy as np

from jaxrl_hf.workers.common import WorkerConfigError

EMPTY = -1
PACKED_KEYS = ("pack_input_ids", "pack_segment_ids", "pack_position_ids", "pack_rows")


def bucket(n: int) -> int:
    """The next power of two >= ``n`` (>= 1): the static sizes a varying count is rounded up to."""
    return 1 << max(int(n) - 1, 0).bit_length()


def static_length(needed: int, cap: int, quantum: int = 32, per_octave: int = 4) -> int:
    """Packed length for fixed-row micro-batches, at most ``cap``: ``needed`` rounded up to a multiple of
    ``quantum``, and above ``per_octave`` quanta to one of ``per_octave`` steps per doubling (multiples of
    ``quantum · 2^k`` between ``per_octave · quantum · 2^k`` and twice that). A length then wastes at most
    ``1 / per_octave`` of itself on padding (a power of two: up to half) while a varying load reuses a few
    compiled programs (``per_octave`` per doubling)."""
    if quantum < 1 or per_octave < 1:
        raise ValueError(f"static_length: quantum {quantum} and per_octave {per_octave} must be >= 1")
    quanta = math.ceil(max(int(needed), 1) / quantum)
    step = 1 << max(quanta.bit_length() - per_octave.bit_length(), 0)
    return min(int(cap), quantum * step * math.ceil(quanta / step))


def valid_lengths(attention_mask: np.ndarray) -> np.ndarray:
    """Valid tokens per row ``[B]`` (int64)."""
    return (np.asarray(attention_mask) != 0).sum(axis=1).astype(np.int64)


def lpt_bins(lengths: np.ndarray, rows: np.ndarray, num_bins: int, capacity: int) -> list[list[int]] | None:
    """``rows`` into ``num_bins`` bins of at most ``capacity`` tokens by longest-processing-time-first: rows by
    decreasing length (ties: lower index first), each into the least loaded bin (ties: lower bin index). The
    least loaded bin is the only candidate (if it has no room none has), so ``None`` means "does not fit".
    Each bin lists its rows in increasing index order."""
    order = sorted((int(i) for i in rows), key=lambda i: (-int(lengths[i]), i))
    heap = [(0, b) for b in range(num_bins)]
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for i in order:
        load, b = heapq.heappop(heap)
        if load + lengths[i] > capacity:
            return None
        bins[b].append(i)
        heapq.heappush(heap, (load + int(lengths[i]), b))
    return [sorted(rows_of_bin) for rows_of_bin in bins]


def _slots_from_bins(bins: list[list[int]], devices: int) -> np.ndarray:
    width = max([len(b) for b in bins] + [1])
    slots = np.full((len(bins) // devices, devices, width), EMPTY, np.int64)
    for k, rows in enumerate(bins):
        slots[k // devices, k % devices, :len(rows)] = rows
    return slots


def partition_by_tokens(lengths: np.ndarray, budget: int, devices: int, *, key: str,
                        skip: np.ndarray | None = None) -> np.ndarray:
    """``slots [M, D, r]``: every row not in ``skip`` in exactly one bin, each bin's total length <= ``budget``,
    ``M`` the smallest count for which the LPT rule fits them (at least ``ceil(total / (budget·D))``); bins
    ranked by decreasing load (ties: first row) so each micro-batch groups bins of similar load. Deterministic:
    the same lengths give the same slots. A row longer than ``budget`` raises naming ``key``."""
    lengths = np.asarray(lengths, np.int64)
    live = np.flatnonzero(~np.asarray(skip, bool)) if skip is not None else np.arange(len(lengths))
    if budget < 1 or devices < 1:
        raise WorkerConfigError(f"{key}={budget} with {devices} devices: both must be >= 1")
    too_long = [int(i) for i in live if lengths[i] > budget]
    if too_long:
        i = max(too_long, key=lambda j: (lengths[j], -j))
        raise WorkerConfigError(f"{key}={budget} tokens per device is smaller than row {i} of the mini-batch, which "
                                f"has {int(lengths[i])} tokens (prompt + response); set {key} >= "
                                f"{int(lengths[i])} (ideally a few rows' worth)")
    if not len(live):
        return np.full((1, devices, 1), EMPTY, np.int64)
    micro = max(1, math.ceil(int(lengths[live].sum()) / (budget * devices)))
    while (bins := lpt_bins(lengths, live, micro * devices, budget)) is None:
        micro += 1
    bins.sort(key=lambda rows: (-int(lengths[rows].sum()), rows[0] if rows else len(lengths)))
    return _slots_from_bins(bins, devices)


def partition_by_rows(num_rows: int, rows_per_device: int, devices: int,
                      skip: np.ndarray | None = None) -> np.ndarray:
    """``slots [M, D, rows_per_device]`` of the fixed-row split: micro-batch ``m`` holds rows ``m·D·r ..``,
    device ``d`` the ``r`` consecutive ones from ``m·D·r + d·r`` (the padded path's layout); the last micro-batch
    is filled up with empty slots, and rows in ``skip`` are left out (their slot empty)."""
    per_micro = rows_per_device * devices
    count = max(1, math.ceil(num_rows / per_micro))
    flat = np.full(count * per_micro, EMPTY, np.int64)
    flat[:num_rows] = np.arange(num_rows)
    if skip is not None:
        flat[:num_rows][np.asarray(skip, bool)] = EMPTY
    return flat.reshape(count, devices, rows_per_device)


def pad_slots(slots: np.ndarray, num_micro: int, slots_per_device: int) -> np.ndarray:
    """``slots`` grown to ``[num_micro, D, slots_per_device]`` with empty micro-batches / slots."""
    m, d, r = slots.shape
    if num_micro < m or slots_per_device < r:
        raise ValueError(f"pad_slots: cannot shrink {slots.shape} to ({num_micro}, {d}, {slots_per_device})")
    out = np.full((num_micro, d, slots_per_device), EMPTY, np.int64)
    out[:m, :, :r] = slots
    return out


def gather_rows(arrays: Mapping[str, np.ndarray], slots: np.ndarray) -> dict[str, np.ndarray]:
    """Each ``[B, ...]`` array as ``[M, D·r, ...]`` in slot order; empty slots are zeros."""
    m, d, r = slots.shape
    flat = slots.reshape(-1)
    taken = np.maximum(flat, 0)
    out = {}
    for name, a in arrays.items():
        a = np.asarray(a)
        rows = a[taken]
        rows[flat == EMPTY] = 0
        out[name] = rows.reshape(m, d * r, *a.shape[1:])
    return out


def scatter_rows(outputs: np.ndarray, slots: np.ndarray, num_rows: int) -> np.ndarray:
    """Inverse of `gather_rows` for outputs ``[M, D·r, ...]`` (or one micro-batch's ``[D·r, ...]`` with
    ``slots [D, r]``): rows ``[num_rows, ...]``; a row in no slot stays 0."""
    slots = np.asarray(slots)
    flat = slots.reshape(-1)
    outputs = np.asarray(outputs)
    outputs = outputs.reshape(flat.size, *outputs.shape[slots.ndim - 1:])
    out = np.zeros((num_rows, *outputs.shape[1:]), outputs.dtype)
    keep = flat != EMPTY
    out[flat[keep]] = outputs[keep]
    return out


def pack_per_token(per_token: np.ndarray, attention_mask: np.ndarray, slots: np.ndarray,
                   pack_rows: np.ndarray, length: int) -> np.ndarray:
    """A per-token column ``[B, T, ...]`` in the packed layout `pack_tokens` made (its ``pack_rows [M, D·r, T]``
    for the same ``slots``): ``[M, D, length, ...]``, each valid token at its packed index, zeros elsewhere."""
    m, d, r = slots.shape
    rows = gather_rows({"value": per_token, "valid": np.asarray(attention_mask) != 0}, slots)
    out = np.zeros((m, d, length, *np.shape(per_token)[2:]), np.asarray(per_token).dtype)
    mi, j, c = np.nonzero(rows["valid"])
    out[mi, j // r, np.asarray(pack_rows)[mi, j, c]] = rows["value"][mi, j, c]
    return out


def packed_loads(lengths: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Tokens per (micro-batch, device) ``[M, D]``."""
    lengths = np.append(np.asarray(lengths, np.int64), 0)  # index -1 (empty) reads the appended 0
    return lengths[slots].sum(axis=-1)


def pack_tokens(input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray, slots: np.ndarray,
                length: int, response_length: int) -> dict[str, np.ndarray]:
    """The packed inputs of ``slots [M, D, r]`` (module docstring, point 4): ``pack_input_ids``,
    ``pack_segment_ids``, ``pack_position_ids`` ``[M, D, length]`` and ``pack_rows [M, D·r, T]`` (int32).

    A response slot whose predecessor is padding maps to index 0 (its output is garbage and must be masked, as
    the padded layout's is); a scored response token right after a padding token cannot be packed and raises."""
    input_ids, position_ids = np.asarray(input_ids), np.asarray(position_ids)
    valid = np.asarray(attention_mask) != 0
    width = valid.shape[1]
    prompt = width - response_length
    if prompt < 1:
        raise ValueError(f"pack_tokens: width {width} leaves no prompt before {response_length} response tokens")
    m, d, r = slots.shape
    ids = np.zeros((m, d, length), np.int32)
    segments = np.zeros((m, d, length), np.int32)
    positions = np.zeros((m, d, length), np.int32)
    where = np.zeros((m, d, r, width), np.int32)
    predecessor = np.arange(prompt - 1, width - 1)  # padded column of the token before response slot t
    for mi in range(m):
        for di in range(d):
            cursor = 0
            for s, row in enumerate(slots[mi, di]):
                if row == EMPTY:
                    continue
                cols = np.flatnonzero(valid[row])
                n = len(cols)
                if cursor + n > length:
                    raise ValueError(f"pack_tokens: micro-batch {mi} device {di} needs more than {length} tokens")
                broken = valid[row, prompt:] & ~valid[row, predecessor]
                if broken.any():
                    t = int(np.flatnonzero(broken)[0])
                    raise ValueError(f"pack_tokens: row {row}: response token {t} follows a padding token "
                                     "(attention_mask 0), which a packed sequence cannot represent")
                ids[mi, di, cursor:cursor + n] = input_ids[row, cols]
                positions[mi, di, cursor:cursor + n] = position_ids[row, cols]
                segments[mi, di, cursor:cursor + n] = s + 1
                where[mi, di, s, cols] = cursor + np.arange(n)
                cursor += n
    return {"pack_input_ids": ids, "pack_segment_ids": segments, "pack_position_ids": positions,
            "pack_rows": where.reshape(m, d * r, width)}
