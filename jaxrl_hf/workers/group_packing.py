"""Group rows without padding: the host side of the packed shared-prompt forward (``actor.share_prompt_forward``
with ``model.use_remove_padding``).

A rollout's rows come in groups of ``n`` samples of one prompt, each row ``[prompt (P, left-padded) | response
(R, right-padded)]``. `pack_group_rows` lays each group out as one row of real tokens only:

    tokens:      [prompt's p tokens | sample 1's r_1 tokens | ... | sample n's r_n tokens | padding]   [G, T]
    segments:    [1 ... 1           | 2 ... 2               | ... | n + 1 ...             | 0 ...  ]
    positions:   the rollout's ``position_ids`` of each token (a sample's continue its prompt's)

with ``T`` = `packing.static_length` of the longest group's ``p + Σ r_i``, at most ``P + n·R`` (the padded group
row), so a varying load reuses a few compiled programs. The LM head scores the real response tokens only, ``S``
slots a group (`packing.static_length` of the largest group's ``Σ r_i``, at most ``n·R``; the padded columns were
about half of the ``n·R`` at the default run's lengths, and the LM head is a fifth of SmolLM2-135M's FLOPs):

    group_logit_index [G, S]:    the packed position predicting each scored token: the prompt's last token for a
                                 sample's first, the sample's previous token after it (the padded forward's hidden
                                 state at column ``P + t - 1``); 0 in a group's unused slots
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
              "group_score_slot")
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


def group_row_length(attention_mask: np.ndarray, response_length: int, group: int) -> int:
    """``T`` of the packed group rows of ``attention_mask``'s rows (module docstring), the largest over the JAX
    processes (all of them call it in lockstep, once per micro-batch stack or chunk)."""
    mask = np.asarray(attention_mask) != 0
    rows, width = mask.shape
    prompt_len = width - int(response_length)
    prompts = mask[::group, :prompt_len].sum(axis=1)
    responses = mask[:, prompt_len:].sum(axis=1).reshape(rows // group, group).sum(axis=1)
    length = packing.static_length(int((prompts + responses).max()), prompt_len + group * int(response_length))
    return agree_max(length)[0]  # every process runs the same program


def group_scored_length(attention_mask: np.ndarray, response_length: int, group: int) -> int:
    """``S``, the LM head's slots per group (module docstring) for ``attention_mask``'s rows, the largest over the
    JAX processes (in lockstep, as `group_row_length`)."""
    mask = np.asarray(attention_mask) != 0
    rows, width = mask.shape
    responses = mask[:, width - int(response_length):].sum(axis=1).reshape(rows // group, group).sum(axis=1)
    return agree_max(packing.static_length(int(responses.max()), group * int(response_length)))[0]


def pack_group_rows(arrays: Mapping[str, np.ndarray], response_length: int, group: int, length: int,
                    scored: int | None = None) -> dict[str, np.ndarray]:
    """``arrays`` (``input_ids``, ``attention_mask``, ``position_ids`` ``[G·n, P + R]``, groups of ``n`` =
    ``group`` rows with one prompt, `packable`) -> `GROUP_KEYS` ``[G, length]`` / ``[G, scored]`` / ``[G, n·R]``
    (module docstring; ``scored`` None: this chunk's `group_scored_length`), with the other arrays unchanged."""
    ids, mask, positions = (np.asarray(arrays[k]) for k in ("input_ids", "attention_mask", "position_ids"))
    rows, width = ids.shape
    r = int(response_length)
    prompt_len, groups = width - r, rows // group
    scored = group_scored_length(mask, r, group) if scored is None else int(scored)
    out = {name: np.zeros((groups, length), np.int32) for name in GROUP_KEYS[:3]}
    index, targets = np.zeros((groups, scored), np.int32), np.zeros((groups, scored), np.int32)
    slot = np.full((groups, group * r), scored, np.int32)
    for g in range(groups):
        first = g * group
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
        at = 0
        for row, columns, segment in pieces:
            span = slice(at, at + len(columns))
            out["group_input_ids"][g, span] = ids[row, columns]
            out["group_position_ids"][g, span] = positions[row, columns]
            out["group_segments"][g, span] = segment
            at += len(columns)
    out.update(group_logit_index=index, group_score_targets=targets, group_score_slot=slot)
    return {**{k: v for k, v in arrays.items() if k not in ("input_ids", "attention_mask", "position_ids")}, **out}


def pack_micro_stack(mini: Mapping[str, np.ndarray], response_length: int, group: int) -> dict[str, np.ndarray]:
    """A stack of micro-batches ``[M, rows, ...]`` (`jaxrl_hf.workers.minibatch.iterate_minibatches`) packed
    micro-batch by micro-batch at one length (the stack's longest group), as the train step takes it."""
    count = np.shape(mini["attention_mask"])[0]
    flat_mask = np.asarray(mini["attention_mask"]).reshape(-1, np.shape(mini["attention_mask"])[-1])
    length = group_row_length(flat_mask, response_length, group)
    scored = group_scored_length(flat_mask, response_length, group)
    packed = [pack_group_rows({k: np.asarray(v)[m] for k, v in mini.items()}, response_length, group, length, scored)
              for m in range(count)]
    return {k: np.stack([p[k] for p in packed]) for k in packed[0]}


def token_counts(packed: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """``(real tokens, token slots)`` of packed group rows (for ``actor/padding_ratio``)."""
    segments = np.asarray(packed["group_segments"])
    return int(np.count_nonzero(segments)), int(segments.size)
