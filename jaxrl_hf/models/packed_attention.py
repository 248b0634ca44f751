"""Attention over packed sequences one row at a time.

A packed sequence (``model.use_remove_padding``, `jaxrl_hf.workers.packing`) holds ``r`` rows as segments
``1 .. r``, each one contiguous run of at most ``T`` tokens. Attention over the whole ``[L]`` sequence with a segment
mask computes ``L²`` scores where the rows need ``r·T²``, and on a GPU cuDNN's fused attention cannot express
several segments in one row (`jaxrl_hf.models.attention.cudnn_attention` then falls back to the blockwise kernel).
`per_row_attention` moves every row's queries, keys and values into a ``[T]`` slot of its own, runs any
implementation there and moves the outputs back: the same result for the padded rows' cost.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp

Array = jnp.ndarray


def packed_row_slots(segments: Array, rows: int, width: int) -> tuple[Array, Array]:
    """Where the rows of packed sequences lie: ``segments [B, L]`` holding segment ids ``1 .. rows``, each one
    contiguous run of at most ``width`` tokens (0 = padding). Returns ``start [B, rows]`` (a row's first index;
    0 for an absent one) and ``length [B, rows]``."""
    member = segments[:, :, None] == jnp.arange(1, rows + 1, dtype=segments.dtype)[None, None, :]  # [B, L, r]
    return jnp.argmax(member, axis=1).astype(jnp.int32), member.sum(axis=1, dtype=jnp.int32)


@jax.custom_vjp
def _move_rows(x: Array, index: Array, valid: Array, back_index: Array, back_valid: Array) -> Array:
    """``y[b, i] = x[b, index[b, i]]`` where ``valid[b, i]``, else 0: tokens moved along axis 1 by a partial
    bijection whose inverse is ``(back_index, back_valid)``. The transpose of such a move is the inverse move, so
    the gradient is a gather too: no scatter-add (a bf16 scatter-add is an atomic compare-and-swap loop on a GPU)."""
    picked = jax.vmap(lambda xb, ib: xb[ib])(x, index)
    return jnp.where(valid.reshape(*valid.shape, *([1] * (x.ndim - 2))), picked, jnp.zeros((), x.dtype))


def _move_rows_fwd(x, index, valid, back_index, back_valid):  # noqa: ANN001, ANN202
    return _move_rows(x, index, valid, back_index, back_valid), (index, valid, back_index, back_valid)


def _move_rows_bwd(saved, dy):  # noqa: ANN001, ANN202
    index, valid, back_index, back_valid = saved
    return _move_rows(dy, back_index, back_valid, index, valid), None, None, None, None


_move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def per_row_attention(q: Array, k: Array, v: Array, segments: Array, rows: int, width: int, attend: Any,
                      *carried: Array) -> Array:
    """Self-attention of packed sequences one row at a time: every row (segment ``s``, `packed_row_slots`) is
    moved into a ``[B·rows, width]`` slot of its own, left-aligned, ``attend(q, k, v, segments, *carried)`` runs
    there (``carried``: integer ``[B, L]`` arrays, e.g. positions, moved alongside; 0 in empty slots), and each
    token's output is moved back to its packed position (`_move_rows`, gathers both ways). The result
    equals attention over the packed sequence (a token sees only its own row, causally, at the same distances)
    for ``(rows / L²)·width²`` of its score count: packing then costs what the padded rows cost in attention, and
    `cudnn_attention` can take packed rows (each slot is one run from 0). On a CPU the slots attend in
    `concurrent_parts` independent calls of ``attend``, which XLA runs on its threads at once. Tokens of segments
    above ``rows`` or past ``width`` in their row are not seen (the packer guarantees neither occurs); padding
    gets 0."""
    b, length = segments.shape
    segments = segments.astype(jnp.int32)
    start, count = packed_row_slots(segments, rows, width)
    offsets = jnp.arange(width, dtype=jnp.int32)
    slot_valid = (offsets < count[..., None]).reshape(b, rows * width)  # row slot -> a token of the row
    slot_index = jnp.minimum(start[..., None] + offsets, length - 1).reshape(b, rows * width)
    row = jnp.clip(segments - 1, 0, rows - 1)
    offset = jnp.arange(length, dtype=jnp.int32)[None] - jnp.take_along_axis(start, row, axis=1)
    token_valid = (segments > 0) & (segments <= rows) & (offset < width)  # packed token -> its row slot
    token_index = row * width + jnp.clip(offset, 0, width - 1)
    unpack = lambda x: _move_rows(x, slot_index, slot_valid, token_index, token_valid).reshape(  # noqa: E731
        b * rows, width, *x.shape[2:])
    moved = [jnp.where(slot_valid, jnp.take_along_axis(x, slot_index, axis=1), 0).reshape(b * rows, width)
             for x in carried]
    slots = [unpack(q), unpack(k), unpack(v), slot_valid.reshape(b * rows, width).astype(jnp.int32), *moved]
    parts = concurrent_parts(rows)
    bounds = [rows * i // parts for i in range(parts + 1)]

    def part(x: Array, lo: int, hi: int) -> Array:  # row slots lo .. hi - 1 of every sequence
        return x.reshape(b, rows, *x.shape[1:])[:, lo:hi].reshape(b * (hi - lo), *x.shape[1:])
    outs = [attend(*(part(x, lo, hi) for x in slots)).reshape(b, hi - lo, width, *q.shape[2:])
            for lo, hi in zip(bounds, bounds[1:])]
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    return _move_rows(out.reshape(b, rows * width, *q.shape[2:]), token_index, token_valid, slot_index, slot_valid)


def concurrent_parts(rows: int) -> int:
    """In how many parts `per_row_attention` attends to ``rows`` row slots: on a CPU backend one part per core, up to
    ``rows`` (XLA:CPU runs a batched attention matmul on one thread, but independent ops on its pool's threads at
    once); 1 elsewhere."""
    if jax.default_backend() != "cpu":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(int(rows), cores))


def per_row_attention_pays(rows: int, width: int, length: int) -> bool:
    """Whether `per_row_attention` is worth it: more than one row per sequence (one row is already one run), no
    more scores than attention over the packed sequence (``rows · width² <= length²``) and at most 4× its
    queries (``rows · width <= 4 · length``)."""
    return rows > 1 and rows * width * width <= length * length and rows * width <= 4 * length
