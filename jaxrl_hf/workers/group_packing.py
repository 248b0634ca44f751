"""Group rows without padding: the host side of the packed shared-prompt forward (``actor.share_prompt_forward``
with ``model.use_remove_padding``).

A rollout's rows come in groups of ``n`` samples of one prompt, each row ``[prompt (P, left-padded) | response
(R, right-padded)]``. `pack_group_rows` lays each group out as one run of real tokens only:

    tokens:      [prompt's p tokens | sample 1's r_1 tokens | ... | sample n's r_n tokens]
    segments:    [1 ... 1           | 2 ... 2               | ... | n + 1 ...            ]
    positions:   the rollout's ``position_ids`` of each token (a sample's continue its prompt's)

and puts ``k`` consecutive groups' runs one after another in a row of ``L`` tokens (``[G / k, L]``, padding: segment
0), group ``j`` of a row with its segments offset by ``j·(n + 1)`` (the ``shared_prefix`` row layout's shape). With
``k`` = 1 a row is one group and ``L = T``, `packing.static_length` of the longest group's ``p + Σ r_i``, at most
``P + n·R`` (the padded group row); with ``k`` > 1, ``L`` is that of the fullest row's, and the rows no longer pad
every group to the longest (the default run's two groups an update: `actor/padding_ratio` 0.18 -> 0.084). Either way a
varying load reuses a few compiled programs. ``group_windows [G, T]`` lists each group's positions in its row (0
past its run): attention runs one group at a time in slots of ``T``. The LM head scores the real response tokens
only, ``S`` slots a group (`packing.static_length` of the largest group's ``Σ r_i``, at most ``n·R``; the padded
columns were about half of the ``n·R`` at the default run's lengths, and the LM head is a fifth of SmolLM2-135M's
FLOPs):

    group_logit_index [G, S]:    where in its run (a ``group_windows`` column) the hidden state predicting each
                                 scored token is: the prompt's last token for a sample's first, the sample's
                                 previous token after it (the padded forward's hidden state at column
                                 ``P + t - 1``); 0 in a group's unused slots
    group_score_targets [G, S]:  the scored token (0 in unused slots)
    group_score_slot [G, n·R]:   each response column's slot, ``S`` for a padding column (its output is 0, and every
                                 caller masks it)

The model side is `jaxrl_hf.workers.shared_prompt`.

The default DAPO rows (prompts ~53 of 64 tokens, responses ~14 of 32, n = 4) are ~57% real: a group row of 192
positions carries ~110 tokens.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from jaxrl_hf.workers import packing
from jaxrl_hf.workers.token_batches import agree_max

GROUP_KEYS = ("group_input_ids", "group_position_ids", "group_segments", "group_logit_index", "group_score_targets",
              "group_score_slot", "group_windows")
"""The arrays `pack_group_rows` adds to a micro-batch (they replace its ``input_ids`` / ``attention_mask`` /
``position_ids``)."""


def packable(attention_mask: np.ndarray, response_length: int) -> bool:
    """Whether rows can be packed and still predict every response token from the same keys: 0/1 masks, each
    prompt's last column real, and each response's real tokens a prefix of its columns (right padding)."""
    mask = np.asarray(attention_mask)
    prompt_len = mask.shape[1] - int(response_length)
    if prompt_len < 1 or not np.isin(mask, (0, 1)).all():
        return False
    response = mask[:, prompt_len:] != 0
    return bool((mask[:, prompt_len - 1] != 0).all() and (response[:, :-1] >= response[:, 1:]).all())


def group_token_counts(attention_mask: np.ndarray, response_length: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """``(p, Σ r_i)`` of each group of ``group`` rows: its prompt's real tokens and its responses' ``[G]``."""
    mask = np.asarray(attention_mask) != 0
    rows, width = mask.shape
    prompt_len = width - int(response_length)
    responses = mask[:, prompt_len:].sum(axis=1).reshape(rows // group, group).sum(axis=1)
    return mask[::group, :prompt_len].sum(axis=1), responses


def group_lengths(attention_mask: np.ndarray, response_length: int, group: int) -> np.ndarray:
    """Real tokens ``p + Σ r_i`` of each group of ``group`` rows ``[G]``."""
    prompts, responses = group_token_counts(attention_mask, response_length, group)
    return prompts + responses


def group_row_length(attention_mask: np.ndarray, response_length: int, group: int) -> int:
    """``T`` of the packed group rows of ``attention_mask``'s rows (module docstring), the largest over the JAX
    processes (all of them call it in lockstep, once per micro-batch stack or chunk)."""
    cap = np.shape(attention_mask)[1] + (group - 1) * int(response_length)
    length = packing.static_length(int(group_lengths(attention_mask, response_length, group).max()), cap)
    return agree_max(length)[0]  # every process runs the same program


def packed_row_length(attention_mask: np.ndarray, response_length: int, group: int, per_row: int) -> int:
    """``L`` of rows packing ``per_row`` consecutive groups each (`packing.static_length` of the fullest row), the
    largest over the JAX processes (in lockstep, as `group_row_length`)."""
    loads = group_lengths(attention_mask, response_length, group).reshape(-1, per_row).sum(axis=1)
    cap = per_row * (np.shape(attention_mask)[1] + (group - 1) * int(response_length))
    return agree_max(packing.static_length(int(loads.max()), cap))[0]


def group_scored_length(attention_mask: np.ndarray, response_length: int, group: int) -> int:
    """``S``, the LM head's slots per group (module docstring) for ``attention_mask``'s rows, the largest over the
    JAX processes (in lockstep, as `group_row_length`)."""
    responses = group_token_counts(attention_mask, response_length, group)[1]
    return agree_max(packing.static_length(int(responses.max()), group * int(response_length)))[0]


def pack_group_rows(arrays: Mapping[str, np.ndarray], response_length: int, group: int, length: int,
                    scored: int | None = None, per_row: int = 1,
                    row_length: int | None = None) -> dict[str, np.ndarray]:
    """``arrays`` (``input_ids``, ``attention_mask``, ``position_ids`` ``[G·n, P + R]``, groups of ``n`` =
    ``group`` rows with one prompt, `packable`) -> `GROUP_KEYS` (module docstring), with the other arrays
    unchanged. ``length``: ``T``, the longest group's run; ``scored``: ``S`` (None: this chunk's
    `group_scored_length`); ``per_row``: ``k`` consecutive groups a row, in ``row_length`` ``L`` tokens (None:
    this chunk's `packed_row_length`; ``T`` when ``k`` is 1)."""
    ids, mask, positions = (np.asarray(arrays[k]) for k in ("input_ids", "attention_mask", "position_ids"))
    rows, width = ids.shape
    r, per_row = int(response_length), int(per_row)
    prompt_len, groups = width - r, rows // group
    if groups % per_row:
        raise ValueError(f"pack_group_rows: {groups} groups do not fill rows of {per_row} groups each")
    scored = group_scored_length(mask, r, group) if scored is None else int(scored)
    if row_length is None:
        row_length = length if per_row == 1 else packed_row_length(mask, r, group, per_row)
    out = {name: np.zeros((groups // per_row, row_length), np.int32) for name in GROUP_KEYS[:3]}
    index, targets = np.zeros((groups, scored), np.int32), np.zeros((groups, scored), np.int32)
    slot = np.full((groups, group * r), scored, np.int32)
    windows = np.zeros((groups, length), np.int32)
    at = 0
    for g in range(groups):
        first, packed_row, stride = g * group, g // per_row, (g % per_row) * (group + 1)
        at = 0 if g % per_row == 0 else at
        real = np.flatnonzero(mask[first, :prompt_len])
        cursor, used = len(real), 0
        pieces = [(first, real, 1)]
        for i in range(group):
            taken = int(np.count_nonzero(mask[first + i, prompt_len:]))
            if used + taken > scored:
                raise ValueError(f"pack_group_rows: group {g} has more than {scored} response tokens to score")
            span = slice(used, used + taken)
            index[g, span] = np.concatenate([[len(real) - 1], cursor + np.arange(taken - 1)])[:taken]
            targets[g, span] = ids[first + i, prompt_len:prompt_len + taken]
            slot[g, i * r:i * r + taken] = np.arange(used, used + taken)
            pieces.append((first + i, prompt_len + np.arange(taken), i + 2))
            cursor, used = cursor + taken, used + taken
        if cursor > length:
            raise ValueError(f"pack_group_rows: group {g} holds {cursor} tokens, more than the packed length {length}")
        if at + cursor > row_length:
            raise ValueError(f"pack_group_rows: row {packed_row} holds more than {row_length} tokens")
        windows[g, :cursor] = at + np.arange(cursor)
        for row, columns, segment in pieces:
            span = slice(at, at + len(columns))
            out["group_input_ids"][packed_row, span] = ids[row, columns]
            out["group_position_ids"][packed_row, span] = positions[row, columns]
            out["group_segments"][packed_row, span] = stride + segment
            at += len(columns)
    out.update(group_logit_index=index, group_score_targets=targets, group_score_slot=slot, group_windows=windows)
    return {**{k: v for k, v in arrays.items() if k not in ("input_ids", "attention_mask", "position_ids")}, **out}


def pack_micro_stack(mini: Mapping[str, np.ndarray], response_length: int, group: int,
                     per_row: int = 1) -> dict[str, np.ndarray]:
    """A stack of micro-batches ``[M, rows, ...]`` (`jaxrl_hf.workers.minibatch.iterate_minibatches`) packed
    micro-batch by micro-batch at one set of lengths (the stack's longest group and fullest row), ``per_row``
    groups a row, as the train step takes it."""
    count = np.shape(mini["attention_mask"])[0]
    flat_mask = np.asarray(mini["attention_mask"]).reshape(-1, np.shape(mini["attention_mask"])[-1])
    length = group_row_length(flat_mask, response_length, group)
    scored = group_scored_length(flat_mask, response_length, group)
    row_length = length if per_row == 1 else packed_row_length(flat_mask, response_length, group, per_row)
    packed = [pack_group_rows({k: np.asarray(v)[m] for k, v in mini.items()}, response_length, group, length, scored,
                              per_row, row_length) for m in range(count)]
    return {k: np.stack([p[k] for p in packed]) for k in packed[0]}


def token_counts(packed: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """``(real tokens, token slots)`` of packed group rows (for ``actor/padding_ratio``)."""
    segments = np.asarray(packed["group_segments"])
    return int(np.count_nonzero(segments)), int(segments.size)
