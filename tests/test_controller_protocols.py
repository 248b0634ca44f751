"""Transfer protocols and mesh coordinates as pure functions (no Ray): split/replicate/collect
semantics are checked against applying the method to the whole batch at once."""

import itertools

import numpy as np
import pytest

from jaxrl_hf.controller import Batch, Dispatch, GroupLayout, MeshCoords, Worker, coords_from_process_grid, register
from jaxrl_hf.controller.batch import PAD_ROWS_KEY
from jaxrl_hf.controller.futures import _gather_rows, chunk_bounds
from jaxrl_hf.controller.process import trim_padding
from jaxrl_hf.controller.protocols import RankCall, as_protocol, registered_methods


def run_locally(protocol, layout, method, *args, **kwargs):
    """What a WorkerGroup does, minus Ray: dispatch, run each rank, drop padding, collect."""
    calls = protocol.dispatch(layout, args, kwargs)
    outputs = []
    for rank, call in enumerate(calls):
        rows = next((len(a) for a in call.args if isinstance(a, Batch)), None)
        outputs.append(trim_padding(method(rank, *call.args, **call.kwargs), call.pad_rows, rows))
    return protocol.collect_fn(layout, outputs)


def sample_batch(n):
    return Batch.from_dict({"x": np.arange(n, dtype=np.float64), "tag": [f"s{i}" for i in range(n)]})


def double(rank, batch):
    return batch.union(Batch.from_dict({"y": batch["x"] * 2, "rank": np.full(len(batch), rank)}))


@pytest.mark.parametrize("n,world", [(16, 2), (13, 4), (3, 4), (1, 2)])
def test_dp_compute_pads_splits_and_unpads(n, world):
    layout = GroupLayout.pure_dp("r", "p", world)
    out = run_locally(Dispatch.DP_COMPUTE.protocol, layout, double, sample_batch(n))
    np.testing.assert_array_equal(out["x"], np.arange(n))
    np.testing.assert_array_equal(out["y"], 2 * np.arange(n))
    assert list(out["tag"]) == [f"s{i}" for i in range(n)]
    assert PAD_ROWS_KEY not in out.meta_info
    # contiguous equal chunks of the padded batch: rank r served rows [r*c, (r+1)*c)
    chunk = -(-n // world)
    np.testing.assert_array_equal(out["rank"], np.arange(n) // chunk)


def test_dp_compute_chunks_carry_their_padding_and_replicate_other_args():
    layout = GroupLayout.pure_dp("r", "p", 4)
    calls = Dispatch.DP_COMPUTE.protocol.dispatch(layout, (sample_batch(13), 0.5), {"k": "v"})
    assert [c.pad_rows for c in calls] == [0, 0, 0, 3]
    assert [c.args[0].meta_info[PAD_ROWS_KEY] for c in calls] == [0, 0, 0, 3]
    assert all(c.args[1] == 0.5 and c.kwargs == {"k": "v"} for c in calls)
    # the 3 padding rows are copies of the first rows of the batch
    np.testing.assert_array_equal(calls[3].args[0]["x"], [12, 0, 1, 2])
    with pytest.raises(ValueError, match="different lengths"):
        Dispatch.DP_COMPUTE.protocol.dispatch(layout, (sample_batch(4), sample_batch(5)), {})


def test_padding_with_k_outputs_per_input_row():
    """A method returning k interleaved rows per input row (n samples per prompt) is unpadded by k*pad."""
    layout = GroupLayout.pure_dp("r", "p", 4)

    def sample_three(rank, batch):
        return batch.repeat(3, interleave=True)

    out = run_locally(Dispatch.DP_COMPUTE.protocol, layout, sample_three, sample_batch(10))
    assert list(out["tag"]) == list(sample_batch(10).repeat(3)["tag"])
    with pytest.raises(ValueError, match="not a multiple"):
        trim_padding(sample_batch(5), 1, 2)


def mesh_layout(dp, tp, pp):
    coords = [MeshCoords(d, dp, t, tp, p, pp) for p, d, t in itertools.product(range(pp), range(dp), range(tp))]
    return GroupLayout("actor", "pool", tuple(coords))


def test_mesh_dp_splits_by_dp_replicates_tp_pp_and_collects_tp0_last_stage():
    layout = mesh_layout(dp=2, tp=2, pp=2)  # 8 processes
    calls = Dispatch.MESH_DP.protocol.dispatch(layout, (sample_batch(7),), {})
    for rank, call in enumerate(calls):
        c = layout.coords[rank]
        expected = sample_batch(8)["x"][c.dp_rank * 4 : c.dp_rank * 4 + 4] % 7  # padded to 8
        np.testing.assert_array_equal(call.args[0]["x"], expected)
    assert layout.collect_ranks() == [4, 6]  # rank = 4*pp + 2*dp + tp: pp 1, tp 0, dp 0 then 1
    out = run_locally(Dispatch.MESH_DP.protocol, layout, double, sample_batch(7))
    np.testing.assert_array_equal(out["y"], 2 * np.arange(7))
    np.testing.assert_array_equal(out["rank"], [4] * 4 + [6] * 3)
    assert Dispatch.MESH_3D is Dispatch.MESH_DP


def test_dp_compute_metric_returns_per_rank_values():
    layout = GroupLayout.pure_dp("r", "p", 3)

    def metric(rank, batch):
        valid = len(batch) - batch.meta_info[PAD_ROWS_KEY]
        return {"rank": rank, "sum": float(batch["x"][:valid].sum()), "count": valid}

    out = run_locally(Dispatch.DP_COMPUTE_METRIC.protocol, layout, metric, sample_batch(7))
    assert [m["rank"] for m in out] == [0, 1, 2]
    assert sum(m["sum"] for m in out) == sum(range(7)) and sum(m["count"] for m in out) == 7


def test_one_to_all_and_all_to_all():
    layout = GroupLayout.pure_dp("r", "p", 3)
    calls = Dispatch.ONE_TO_ALL.protocol.dispatch(layout, (1, 2), {"a": 3})
    assert calls[0] is calls[1] is calls[2] and calls[0].args == (1, 2)
    calls = Dispatch.ALL_TO_ALL.protocol.dispatch(layout, ([1, 2, 3],), {"k": ["a", "b", "c"]})
    assert [(c.args, c.kwargs) for c in calls] == [((1,), {"k": "a"}), ((2,), {"k": "b"}), ((3,), {"k": "c"})]
    with pytest.raises(ValueError, match=r"ALL_TO_ALL argument 'k' must be a list with one element per rank \(3"):
        Dispatch.ALL_TO_ALL.protocol.dispatch(layout, (), {"k": [1, 2]})


@pytest.mark.parametrize("seed", range(5))
def test_gather_rows_matches_concat_pad_chunk(seed):
    """The worker-side row gather (used for futures) equals concat -> pad_to_divisor -> chunk."""
    rng = np.random.default_rng(seed)
    parts = [sample_batch(int(k)) for k in rng.integers(1, 6, size=rng.integers(1, 5))]
    parts = [Batch.from_dict({"x": p["x"] + 100 * i, "tag": list(p["tag"])}) for i, p in enumerate(parts)]
    whole = Batch.concat(parts)
    count = int(rng.integers(1, 5))
    reference = whole.pad_to_divisor(count)[0].chunk(count)
    for index in range(count):
        start, stop, pad = chunk_bounds(len(whole), index, count)
        got = _gather_rows(parts, start, stop)
        np.testing.assert_array_equal(got["x"], reference[index]["x"])
        assert list(got["tag"]) == list(reference[index]["tag"])
        assert pad == min(stop - start, max(0, stop - len(whole)))


def test_coords_from_process_grid():
    # 2 processes x 4 devices, mesh dp=8: process-level pure DP
    grid = np.repeat([0, 1], 4)
    assert coords_from_process_grid(grid, ("dp",), 1) == MeshCoords(dp_rank=1, dp_size=2)
    # mesh (dp=4, tp=2) with tp across the two processes: both see the whole batch
    grid = np.tile([0, 1], (4, 1))
    assert coords_from_process_grid(grid, ("dp", "tp"), 0) == MeshCoords(0, 1, 0, 2, 0, 1)
    assert coords_from_process_grid(grid, ("dp", "tp"), 1) == MeshCoords(0, 1, 1, 2, 0, 1)
    # 8 single-device processes on (pp=2, dp=2, sp=1, tp=2): compare with direct enumeration
    grid = np.arange(8).reshape(2, 2, 1, 2)
    for p, d, s, t in itertools.product(range(2), range(2), range(1), range(2)):
        coords = coords_from_process_grid(grid, ("pp", "dp", "sp", "tp"), int(grid[p, d, s, t]))
        assert coords == MeshCoords(d, 2, t, 2, p, 2)
    with pytest.raises(ValueError, match="do not form a box"):
        coords_from_process_grid(np.array([[0, 1], [1, 0]]), ("dp", "tp"), 0)
    with pytest.raises(ValueError, match="equal aligned blocks"):
        coords_from_process_grid(np.array([0, 0, 0, 1]), ("dp",), 0)
    with pytest.raises(ValueError, match="owns no device"):
        coords_from_process_grid(np.zeros(4, int), ("dp",), 3)


def test_layout_validation_names_ranks():
    with pytest.raises(ValueError, match="ranks 0 and 1 both claim"):
        GroupLayout("a", "p", (MeshCoords(0, 2), MeshCoords(0, 2)))
    with pytest.raises(ValueError, match="disagree"):
        GroupLayout("a", "p", (MeshCoords(0, 2), MeshCoords(0, 1, 1, 2)))
    with pytest.raises(ValueError, match="dp\\*tp\\*pp"):
        GroupLayout("a", "p", (MeshCoords(0, 3), MeshCoords(1, 3)))


def test_register_forms_and_errors():
    def my_dispatch(layout, args, kwargs):
        return [RankCall((rank,) + args, kwargs) for rank in range(layout.world_size)]

    def my_collect(layout, outputs):
        return sum(outputs)

    class W(Worker):
        @register
        def plain(self):
            return 1

        @register(dispatch=(my_dispatch, my_collect), blocking=False)
        def custom(self, rank, x):
            return rank * x

        @register(Dispatch.DP_COMPUTE)
        def positional(self, batch):
            return batch

        def not_exposed(self):
            return 0

    found = registered_methods(W)
    assert sorted(found) == ["custom", "plain", "positional"]
    assert found["plain"].protocol.name == "ONE_TO_ALL" and found["plain"].blocking
    assert found["positional"].protocol.name == "DP_COMPUTE"
    custom = found["custom"].protocol
    assert not found["custom"].blocking
    assert run_locally(custom, GroupLayout.pure_dp("r", "p", 3), lambda r, rank, x: rank * x, 10) == 30
    with pytest.raises(ValueError, match=r"unknown dispatch 'DP'.*valid: \['ALL_TO_ALL'"):
        as_protocol("DP")
    with pytest.raises(ValueError, match="one RankCall per rank"):
        as_protocol((lambda l, a, k: [], my_collect)).dispatch(GroupLayout.pure_dp("r", "p", 2), (), {})
