"""Batch: every operation checked against plain numpy / Python list references."""

import pickle

import numpy as np
import pytest

from jaxrl_hf.controller import Batch


def make(n=6, offset=0, **meta):
    rng = np.random.default_rng(offset)
    return Batch.from_dict(
        {
            "ids": np.arange(n * 3).reshape(n, 3) + offset,
            "logp": rng.standard_normal(n).astype(np.float32),
            "prompt": [f"p{i + offset}" for i in range(n)],
            "gt": [{"answer": i + offset} for i in range(n)],
        },
        meta_info=meta,
    )


def test_from_dict_classifies_columns_and_checks_lengths():
    b = make(4, temperature=1.0)
    assert set(b.arrays) == {"ids", "logp"} and set(b.objects) == {"prompt", "gt"}
    assert b.objects["gt"].dtype == object and b.objects["gt"][2] == {"answer": 2}
    assert len(b) == 4 and b.meta_info == {"temperature": 1.0}
    # nested lists stay per-sample objects, never a 2-D array
    ragged = Batch.from_dict({"toks": [[1, 2], [3, 4]]})
    assert ragged["toks"].shape == (2,) and ragged["toks"][1] == [3, 4]
    assert Batch.from_dict({"r": [1.0, 2.5]})["r"].dtype == np.float64
    with pytest.raises(ValueError, match=r"different lengths.*'a': 3.*'b': 2"):
        Batch.from_dict({"a": np.zeros(3), "b": np.zeros(2)})
    with pytest.raises(ValueError, match="scalar.*meta_info"):
        Batch.from_dict({"a": np.float32(1.0)})
    with pytest.raises(KeyError, match=r"no column 'zz'.*columns"):
        b["zz"]


def test_select_pop_union():
    b = make(5, step=3)
    s = b.select(["ids", "prompt"], meta_keys=[])
    assert s.keys() == ["ids", "prompt"] and s.meta_info == {}
    assert s["ids"] is b["ids"]  # no copy
    with pytest.raises(KeyError, match=r"no columns \['nope'\]"):
        b.select(["nope"])
    popped = b.pop(["logp"], meta_keys=["step"])
    assert "logp" not in b and popped.keys() == ["logp"] and popped.meta_info == {"step": 3}
    assert b.meta_info == {}
    merged = b.union(popped)
    assert sorted(merged.keys()) == sorted(["ids", "logp", "prompt", "gt"])
    # identical shared columns are fine, differing ones are a conflict
    assert b.union(b.select(["ids"]))["ids"] is b["ids"]
    other = Batch.from_dict({"ids": b["ids"] + 1})
    with pytest.raises(ValueError, match="column 'ids' differs"):
        b.union(other)
    with pytest.raises(ValueError, match="lengths 5 and 2"):
        b.union(Batch.from_dict({"z": np.zeros(2)}))
    with pytest.raises(ValueError, match=r"meta_info\['t'\] differs"):
        Batch.from_dict({"a": [1]}, {"t": 1}).union(Batch.from_dict({"b": [2]}, {"t": 2}))


def test_chunk_split_concat_roundtrip():
    b = make(6)
    chunks = b.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    np.testing.assert_array_equal(chunks[1]["ids"], b["ids"][2:4])
    assert list(chunks[2]["prompt"]) == ["p4", "p5"]
    back = Batch.concat(chunks)
    for key in b.keys():
        assert list(map(str, back[key])) == list(map(str, b[key]))
    with pytest.raises(ValueError, match="length 6 into 4.*pad_to_divisor"):
        b.chunk(4)
    assert [len(p) for p in b.split(4)] == [4, 2]
    with pytest.raises(ValueError, match="columns"):
        Batch.concat([b, b.select(["ids"])])
    with pytest.raises(ValueError, match=r"meta_info\['s'\] differs"):
        Batch.concat([make(2, s=1), make(2, s=2)])
    assert Batch.concat([make(2, s=1), make(2, s=2)], meta_conflict="first").meta_info == {"s": 1}


def test_repeat_interleave_and_tile_match_numpy_and_lists():
    b = make(3)
    inter = b.repeat(2, interleave=True)
    tiled = b.repeat(2, interleave=False)
    np.testing.assert_array_equal(inter["ids"], np.repeat(b["ids"], 2, axis=0))
    np.testing.assert_array_equal(tiled["ids"], np.tile(b["ids"], (2, 1)))
    assert list(inter["prompt"]) == ["p0", "p0", "p1", "p1", "p2", "p2"]
    assert list(tiled["prompt"]) == ["p0", "p1", "p2", "p0", "p1", "p2"]
    with pytest.raises(ValueError, match="positive int"):
        b.repeat(0)


def test_reorder_take_and_row():
    b = make(4)
    perm = [2, 0, 3, 1]
    r = b.reorder(perm)
    np.testing.assert_array_equal(r["logp"], b["logp"][perm])
    assert list(r["prompt"]) == [f"p{i}" for i in perm]
    with pytest.raises(ValueError, match="permutation of range\\(4\\)"):
        b.reorder([0, 0, 1, 2])
    assert list(b.take([3, 3])["prompt"]) == ["p3", "p3"]
    assert list(b.take(np.array([True, False, True, False]))["prompt"]) == ["p0", "p2"]
    assert b.row(1)["gt"] == {"answer": 1}
    assert list(b[1:3]["prompt"]) == ["p1", "p2"]


@pytest.mark.parametrize("n,divisor", [(5, 4), (7, 3), (8, 4), (1, 4)])
def test_pad_to_divisor_and_unpad(n, divisor):
    b = make(n)
    padded, pad = b.pad_to_divisor(divisor)
    assert pad == (-n) % divisor and len(padded) % divisor == 0
    expected_rows = [i % n for i in range(n + pad)]  # cyclic copies of the first rows
    assert list(padded["prompt"]) == [f"p{i}" for i in expected_rows]
    back = padded.unpad(pad)
    np.testing.assert_array_equal(back["ids"], b["ids"])
    assert Batch.from_dict({"a": np.zeros(0)}).pad_to_divisor(3)[1] == 0


def test_pickle_keeps_arrays_out_of_band():
    """Protocol-5 pickling (what Ray uses) sends each numeric array as one out-of-band buffer."""
    b = Batch.from_dict({"x": np.zeros((1024, 256), np.float32), "s": ["a"] * 1024})
    buffers = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 1 and buffers[0].raw().nbytes == b.nbytes
    assert len(data) < 64 * 1024  # the 1 MiB array is not in the pickle stream
    back = pickle.loads(data, buffers=buffers)
    np.testing.assert_array_equal(back["x"], b["x"])
    assert list(back["s"][:2]) == ["a", "a"]
