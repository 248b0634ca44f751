"""The host side of packed / token-budget micro-batches (`jaxrl_hf.workers.packing`): the balanced partition
(checked against an exhaustive optimum and Graham's LPT bound), its determinism and budget errors, the packed
layout (every token where it belongs, positions restarting per row) and the exact round trips rows -> slots -> rows
and padded per-token outputs -> packed -> gathered back."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_hf.workers import packing
from jaxrl_hf.workers.common import WorkerConfigError
from jaxrl_hf.workers.packed_forward import gather_response_positions, response_slots

KEY = "actor.ppo_max_token_len_per_gpu"


def padded_rows(seed, rows, prompt, response, empty_rows=()):
    """A rollout-shaped batch: left-padded prompts (1..prompt tokens), right-padded responses (0..response), and
    ``input_ids`` that name their own (row, column), so every packed token can be traced back."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((rows, prompt + response), np.int32)
    response_mask = np.zeros((rows, response), np.int32)
    for i in range(rows):
        p, r = int(rng.integers(1, prompt + 1)), int(rng.integers(1, response + 1))
        mask[i, prompt - p:prompt + r] = 1
        response_mask[i, :r] = 1
    response_mask[list(empty_rows)] = 0
    ids = (np.arange(rows)[:, None] * 1000 + np.arange(prompt + response)[None]).astype(np.int32)
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return ids, mask, positions, response_mask


def occupancy(slots):
    rows = slots[slots != packing.EMPTY]
    return sorted(rows.tolist())


def test_partition_fits_the_budget_balances_and_is_deterministic():
    lengths = np.random.default_rng(1).integers(5, 81, 37)
    budget, devices = 200, 4
    slots = packing.partition_by_tokens(lengths, budget, devices, key=KEY)
    assert occupancy(slots) == list(range(37))  # every row exactly once
    loads = packing.packed_loads(lengths, slots)
    assert loads.max() <= budget
    # LPT: each row went to the least loaded bin, so any two bins differ by at most one row's length
    assert loads.max() - loads.min() <= lengths.max()
    micro = slots.shape[0]
    lower = -(-int(lengths.sum()) // (budget * devices))
    assert micro >= lower
    if micro > lower:  # the smallest count for which the rule fits
        assert packing.lpt_bins(lengths, np.arange(37), (micro - 1) * devices, budget) is None
    # micro-batches group bins of similar load: loads decrease along (micro-batch, device)
    assert (np.diff(loads.reshape(-1)) <= 0).all()
    again = packing.partition_by_tokens(lengths.copy(), budget, devices, key=KEY)
    np.testing.assert_array_equal(again, slots)


def test_lpt_is_within_grahams_bound_of_the_exhaustive_optimum():
    rng = np.random.default_rng(3)
    for _ in range(5):
        lengths = rng.integers(1, 40, 8)
        bins = 3
        optimum = min(max(sum(int(lengths[i]) for i in range(8) if assign[i] == b) for b in range(bins))
                      for assign in itertools.product(range(bins), repeat=8))
        lpt = packing.lpt_bins(lengths, np.arange(8), bins, capacity=10 ** 6)
        makespan = max(int(lengths[b].sum()) for b in map(np.asarray, lpt) if len(b))
        assert makespan <= (4 / 3 - 1 / (3 * bins)) * optimum + 1e-9


def test_a_row_longer_than_the_budget_names_the_key_and_the_row():
    lengths = np.array([10, 50, 97, 20])
    with pytest.raises(WorkerConfigError, match=r"actor.ppo_max_token_len_per_gpu=96 .* row 2 .* 97 tokens"):
        packing.partition_by_tokens(lengths, 96, 2, key=KEY)
    # a skipped row (no scored token) is not packed, so its length does not matter
    slots = packing.partition_by_tokens(lengths, 96, 2, key=KEY, skip=np.array([False, False, True, False]))
    assert occupancy(slots) == [0, 1, 3]


def test_fixed_rows_keep_the_padded_layout():
    slots = packing.partition_by_rows(10, 2, 2, skip=np.isin(np.arange(10), [3]))
    assert slots.shape == (3, 2, 2)
    np.testing.assert_array_equal(slots[0], [[0, 1], [2, -1]])
    np.testing.assert_array_equal(slots[2], [[8, 9], [-1, -1]])


def test_static_sizes():
    assert [packing.bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    # multiples of 32 up to 4 quanta, then 4 steps per doubling: at most a quarter of the length is padding
    assert [packing.static_length(n, 10_000) for n in (1, 32, 33, 100, 129, 250, 257, 293, 385, 1000, 5000)] == \
        [32, 32, 64, 128, 160, 256, 320, 320, 448, 1024, 5120]
    lengths = [packing.static_length(n, 10 ** 6) for n in range(1, 20_000)]
    assert all(n <= length and (n > 128 or length - n < 32) and (length - n) * 4 < max(length, 128)
               for n, length in zip(range(1, 20_000), lengths))
    assert len(set(lengths)) == 3 + 4 * 7 + 2  # 32, 64, 96, then 4 per doubling from 128 (20k: 16384, 20480)
    assert packing.static_length(150, 160) == 160  # never more than rows x T
    with pytest.raises(ValueError, match="quantum"):
        packing.static_length(10, 100, quantum=0)
    padded = packing.pad_slots(np.array([[[4, 2]]]), 2, 4)
    np.testing.assert_array_equal(padded, [[[4, 2, -1, -1]], [[-1, -1, -1, -1]]])


def test_pack_places_every_valid_token_with_restarted_positions():
    prompt, response = 7, 6
    ids, mask, positions, _ = padded_rows(0, 9, prompt, response)
    lengths = packing.valid_lengths(mask)
    slots = packing.pad_slots(packing.partition_by_tokens(lengths, 30, 2, key=KEY), 4, 8)
    packed = packing.pack_tokens(ids, mask, positions, slots, 30, response)
    assert packed["pack_input_ids"].shape == (4, 2, 30) and packed["pack_rows"].shape == (4, 16, prompt + response)
    for m, d, s in zip(*np.nonzero(slots != packing.EMPTY)):
        row = slots[m, d, s]
        segment = packed["pack_segment_ids"][m, d] == s + 1
        np.testing.assert_array_equal(packed["pack_input_ids"][m, d][segment], ids[row][mask[row] != 0])
        np.testing.assert_array_equal(packed["pack_position_ids"][m, d][segment], np.arange(lengths[row]))
        # pack_rows: each valid column of the padded row -> where its token landed; padding columns -> 0
        where = packed["pack_rows"][m, d * 8 + s]
        np.testing.assert_array_equal(packed["pack_input_ids"][m, d][where[mask[row] != 0]], ids[row][mask[row] != 0])
        assert (where[mask[row] == 0] == 0).all()
    for m in range(4):  # padding: segment 0 past each device's rows
        for d in range(2):
            used, segments = packing.packed_loads(lengths, slots)[m, d], packed["pack_segment_ids"][m, d]
            assert (segments[:used] > 0).all() and (segments[used:] == 0).all()


def test_rows_and_per_token_outputs_round_trip_exactly():
    prompt, response, rows = 5, 4, 11
    ids, mask, positions, response_mask = padded_rows(2, rows, prompt, response, empty_rows=(4,))
    skip = ~response_mask.any(axis=1)
    lengths = packing.valid_lengths(mask)
    slots = packing.pad_slots(packing.partition_by_tokens(lengths, 16, 2, key=KEY, skip=skip), 8, 4)
    # rows -> slots -> rows
    values = np.random.default_rng(0).normal(size=(rows, response)).astype(np.float32)
    gathered = packing.gather_rows({"values": values, "response_mask": response_mask}, slots)
    assert gathered["values"].shape == (8, 8, response)
    assert gathered["response_mask"][slots.reshape(8, 8) == packing.EMPTY].sum() == 0  # empty slots score nothing
    back = packing.scatter_rows(gathered["values"], slots, rows)
    np.testing.assert_array_equal(back[~skip], values[~skip])
    assert (back[skip] == 0).all()
    # a per-token output of the padded layout (here: the token id itself), packed, then gathered at the response
    # slots of pack_rows
    # (the jitted gather of the packed forward) gives the padded layout's [:, P-1 : P-1+R] at every scored slot
    packed = packing.pack_tokens(ids, mask, positions, slots, 16, response)
    per_token = jnp.asarray(packed["pack_input_ids"].astype(np.float32))
    for m in range(8):
        micro = {"pack_rows": jnp.asarray(packed["pack_rows"][m]), "responses": jnp.zeros((8, response))}
        out = np.asarray(gather_response_positions(per_token[m], response_slots(micro)))
        rows_out = packing.scatter_rows(out, slots[m], rows)
        expected = ids[:, prompt - 1:prompt - 1 + response].astype(np.float32)
        here = np.isin(np.arange(rows), slots[m])
        scored = (response_mask != 0) & here[:, None]
        np.testing.assert_array_equal(rows_out[scored], expected[scored])


def test_a_scored_token_after_padding_cannot_be_packed():
    ids, mask, positions, _ = padded_rows(0, 2, 4, 3)
    mask[1, 4] = 0  # a hole before response token 1
    mask[1, 5] = 1
    slots = packing.partition_by_rows(2, 1, 2)
    with pytest.raises(ValueError, match="row 1: response token 1 follows a padding token"):
        packing.pack_tokens(ids, mask, positions, slots, 16, 3)
