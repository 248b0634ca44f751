"""Rank layouts of the 3D-HybridEngine (HybridFlow §2.5.3) checked against the paper's Fig. 8."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxrl_hf.mesh.device_mesh import build_hybrid_meshes, build_train_mesh, flat_device_ids
from jaxrl_hf.mesh.topology import (GenParallel, TrainParallel, all_configs, generation_coords, generation_tp_groups,
                                    micro_dp_groups, parse_config, train_coords, training_dp_groups,
                                    training_model_parallel_groups, training_tp_groups)

needs8 = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")


def test_paper_figure_8_groups():
    # Fig. 8 on G1..G8 (ranks 0..7): 1-4-2 training, 1-2-2-2 generation.
    gen = parse_config("1-4-2->1-2")
    assert training_tp_groups(gen.train) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert training_dp_groups(gen.train) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    # (b) HybridFlow: gen TP [G1,G3],[G2,G4],[G5,G7],[G6,G8]; micro-DP [G1,G2],[G3,G4],...
    assert generation_tp_groups(gen) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert micro_dp_groups(gen) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    # (a) HybridFlow-V: the training grouping reused: gen TP groups consecutive.
    assert generation_tp_groups(gen, vanilla=True) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert training_model_parallel_groups(gen.train) == [(0, 1, 2, 3), (4, 5, 6, 7)]


@pytest.mark.parametrize("gen", all_configs(8), ids=lambda g: f"{g.train.label()}->{g.pp}-{g.tp}")
def test_generation_block_contains_training_block(gen):
    """Pure index arithmetic: a rank's layer block and tensor slice in generation contain its
    training ones, for every valid layout on 8 devices."""
    layers, width = 8 * 3, 8 * 5
    p, t = gen.train.pp, gen.train.tp
    for rank in range(gen.train.num_devices):
        pp, tp, dp = train_coords(rank, gen.train)
        pg, tg, dg, dpg = generation_coords(rank, gen)
        assert dpg == dp and 0 <= dg < gen.dg
        lo, hi = pp * layers // p, (pp + 1) * layers // p
        assert pg * layers // gen.pp <= lo and hi <= (pg + 1) * layers // gen.pp
        lo, hi = tp * width // t, (tp + 1) * width // t
        assert tg * width // gen.tp <= lo and hi <= (tg + 1) * width // gen.tp
    # every generation coordinate is used exactly once
    assert len({generation_coords(r, gen) for r in range(gen.train.num_devices)}) == gen.train.num_devices


@pytest.mark.parametrize("bad, message", [
    (lambda: GenParallel(TrainParallel(1, 4, 2), 1, 3), "tp_g=3 must divide training tp=4"),
    (lambda: GenParallel(TrainParallel(2, 2, 2), 4, 1), "pp_g=4 must divide training pp=2"),
    (lambda: TrainParallel(0, 4, 2), "TrainParallel.pp must be a positive integer"),
    (lambda: GenParallel(TrainParallel(1, 4, 2), 1, -2), "GenParallel.tp must be a positive integer"),
    (lambda: parse_config("1-4-2-1-2"), "not of the form 'p-t-d->pg-tg'"),
])
def test_invalid_layouts_say_why(bad, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        bad()


@needs8
def test_wrong_device_count_is_an_error():
    with pytest.raises(ValueError, match="needs 4 devices"):
        build_train_mesh(TrainParallel(1, 2, 2), jax.devices()[:8])


@needs8
@pytest.mark.parametrize("gen", all_configs(8), ids=lambda g: f"{g.train.label()}->{g.pp}-{g.tp}")
def test_meshes_share_flat_device_order(gen):
    meshes = build_hybrid_meshes(gen)
    assert flat_device_ids(meshes.train) == flat_device_ids(meshes.generation)
    assert meshes.generation_axis_size("dg") == gen.dg
    assert dict(meshes.train.shape) == {"pp": gen.train.pp, "tp": gen.train.tp, "dp": gen.train.dp}
    # the mesh's micro-DP groups (devices sharing pp_g, tp_g, dp) are the paper's
    names = meshes.generation.axis_names
    coords = {}
    for idx in np.ndindex(*meshes.generation.devices.shape):
        key = tuple(i for i, n in zip(idx, names) if n not in meshes.dg_axes)
        coords.setdefault(key, []).append(int(meshes.generation.devices[idx].id))
    assert sorted(tuple(sorted(g)) for g in coords.values()) == micro_dp_groups(gen)


@needs8
def test_mixed_strides_split_dg_into_two_mesh_axes():
    meshes = build_hybrid_meshes(parse_config("2-4-1->1-2"))
    assert meshes.dg_axes == ("dg_pp", "dg_tp")
    assert meshes.generation.axis_names == ("pp_g", "dg_pp", "tp_g", "dg_tp", "dp")
    assert build_hybrid_meshes(parse_config("2-2-2->1-2")).generation.axis_names == ("pp_g", "dg", "tp_g", "dp")
    assert build_hybrid_meshes(parse_config("1-4-2->1-2")).generation.axis_names == ("pp_g", "tp_g", "dg", "dp")
