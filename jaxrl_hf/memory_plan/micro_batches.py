"""The static shapes of a pass's micro-batches, as the worker forms them (`jaxrl_hf.workers.token_batches`).

A pass (actor update, log-probs) is batched by rows (padded ``[D·r, T]``, ``r`` = ``*_micro_batch_size_per_device``),
by a token budget (verl's ``use_dynamic_bsz`` + ``*_max_token_len_per_gpu`` = ``L``) and/or packed
(``model.use_remove_padding``: the token columns become `jaxrl_hf.workers.packing.PACKED_KEYS`, ``[D, L]`` per
micro-batch, one packed sequence per data-parallel device, and ``pack_rows [D·r, T]``). ``D`` is the ``dp`` mesh
axis. The worker's shapes depend on the rows' lengths; the plan takes full-length rows (``T = P + R`` tokens
each), the longest sequences the budget must hold: by tokens ``r = bucket(L // T)`` rows per device, and a
mini-batch of ``N`` rows takes ``bucket(N / (D·r))`` micro-batches (the worker rounds both up to a power of two);
packed by rows ``L = r·T``.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrl_hf.workers import packing
from jaxrl_hf.workers.token_batches import TOKEN_KEYS, MicroBatching

INT_COLUMNS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask", *packing.PACKED_KEYS)
PACKED_ROW_KEYS = ("pack_input_ids", "pack_segment_ids", "pack_position_ids")  # [D, L]; pack_rows is per row


@dataclasses.dataclass(frozen=True)
class PassShapes:
    """Per micro-batch: ``rows_per_device`` (``r``), the token width of a row (``T``, padded) and, packed, the
    packed length ``L``; ``packed``: whether the token columns are `packing.PACKED_KEYS`."""

    rows_per_device: int
    width: int
    packed_length: int | None

    @property
    def packed(self) -> bool:
        return self.packed_length is not None

    def columns(self, keys: tuple[str, ...], response_len: int) -> dict[str, tuple[tuple[int, ...], str, bool]]:
        """``{column: (trailing shape, dtype name, per_device)}`` of one micro-batch for the pass's ``keys``;
        ``per_device`` columns lead with ``D`` (one packed sequence per device), the others with ``D·r`` rows."""
        out = {}
        for key in keys:
            if self.packed and key in TOKEN_KEYS:
                continue
            width = self.width if key in TOKEN_KEYS else response_len
            out[key] = ((width,), "int32" if key in INT_COLUMNS else "float32", False)
        if self.packed:
            out.update({k: ((self.packed_length,), "int32", True) for k in PACKED_ROW_KEYS})
            out["pack_rows"] = ((self.width,), "int32", False)
        return out


def pass_shapes(batching: MicroBatching, width: int) -> PassShapes:
    """The micro-batch geometry of one pass for full-length rows of ``width`` tokens (module docstring)."""
    if batching.dynamic:
        if batching.max_token_len < width:
            raise ValueError(f"{batching.budget_key}={batching.max_token_len}: a full-length row has {width} tokens "
                             "(rollout.max_prompt_length + response_length); the budget must hold at least one")
        rows = packing.bucket(max(1, batching.max_token_len // width))
    else:
        rows = batching.rows_per_device
    packed_length = None
    if batching.remove_padding:
        packed_length = batching.max_token_len if batching.dynamic else packing.static_length(rows * width,
                                                                                               rows * width)
    return PassShapes(rows, width, packed_length)


def update_micro_count(batching: MicroBatching, shapes: PassShapes, mini_rows: int, devices: int,
                       by_rows: int) -> int:
    """Micro-batches of one mini-batch: ``by_rows`` (`MiniBatchPlan`) unless by tokens (rounded up to a power of
    two, as the worker pads the count)."""
    if not batching.dynamic:
        return by_rows
    return packing.bucket(math.ceil(mini_rows / (devices * shapes.rows_per_device)))
