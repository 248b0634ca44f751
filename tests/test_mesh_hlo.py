"""The compiled-HLO collective parser on hand-written lines with hand-computed answers."""

from __future__ import annotations

import pytest

from jaxrl_hf.mesh.hlo_collectives import parse_collectives, summarize

HEADER = "HloModule m, num_partitions=8\n"


def _one(line: str):
    ops = parse_collectives(HEADER + line)
    assert len(ops) == 1
    return ops[0]


def test_explicit_groups_all_gather_bytes():
    op = _one("%ag = f32[8,16]{1,0} all-gather(f32[4,16]{1,0} %p), channel_id=1, "
              "replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, use_global_device_ids=true")
    assert op.kind == "all-gather" and op.result_bytes == 8 * 16 * 4
    assert op.groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert op.received_bytes(3) == 8 * 16 * 4 / 2


def test_iota_groups_with_transpose():
    # [4,2]<=[2,2,2]T(0,2,1): iota(8).reshape(2,2,2).transpose(0,2,1).reshape(4,2)
    op = _one("%ag = bf16[6]{0} all-gather(bf16[3]{0} %p), replica_groups=[4,2]<=[2,2,2]T(0,2,1), dimensions={0}")
    assert op.groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert op.result_bytes == 12


def test_mesh_axes_groups_plain_and_with_device_ids():
    op = _one("%ag = f32[64]{0} all-gather(f32[16]{0} %p), replica_groups=mesh['axis_0'=4,'axis_1'=2] "
              "{'axis_0'}, dimensions={0}")
    # partitions row-major over (4, 2); members vary along axis_0
    assert op.groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    op = _one("%ag = f32[64]{0} all-gather(f32[32]{0} %p), replica_groups=mesh['axis_0'=2,'axis_1'=2,"
              "'axis_2'=2], device_ids=([2,2,2]T(1,0,2)) {'axis_1'}, dimensions={0}")
    # device assignment iota(8).reshape(2,2,2).transpose(1,0,2) = [[[0,1],[4,5]],[[2,3],[6,7]]];
    # members vary along the middle axis: (0,4), (1,5), (2,6), (3,7)
    assert op.groups == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_mesh_sub_axis_group():
    # 'a':(2)2 on an axis of size 8: reshape [8] -> [2,2,2], group over the middle dim
    op = _one("%ag = f32[4]{0} all-gather(f32[2]{0} %p), replica_groups=mesh['a'=8] {'a':(2)2}, dimensions={0}")
    assert op.groups == ((0, 2), (1, 3), (4, 6), (5, 7))


def test_permute_all_reduce_all_to_all_reduce_scatter():
    text = HEADER + "\n".join([
        "%cp = f32[10]{0} collective-permute(f32[10]{0} %p), channel_id=2, source_target_pairs={{0,1},{1,0},{2,1}}",
        "%ar = f32[10]{0} all-reduce(f32[10]{0} %p), channel_id=3, replica_groups={{0,1,2,3}}, to_apply=%add",
        "%a2a = f32[8]{0} all-to-all(f32[8]{0} %p), channel_id=4, replica_groups={{0,1}}, dimensions={0}",
        "%rs = f32[2]{0} reduce-scatter(f32[8]{0} %p), channel_id=5, replica_groups={{0,1,2,3}}, dimensions={0}",
    ])
    s = summarize(text, [10, 11, 12, 13, 14, 15, 16, 17])
    assert s.kinds == {"collective-permute", "all-reduce", "all-to-all", "reduce-scatter"}
    # device 11 = partition 1: permute 2 pairs x 40 B; all-reduce 2*40*3/4; all-to-all 32/2; reduce-scatter 8*3
    assert s.received_bytes[11] == pytest.approx(80 + 60 + 16 + 24)
    assert s.received_bytes[10] == pytest.approx(40 + 60 + 16 + 24)
    assert s.received_bytes[17] == 0
    assert s.device_groups("all-to-all") == {(10, 11)}


def test_empty_groups_mean_all_partitions_and_async_start():
    op = _one("%ags = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %p), replica_groups={}, dimensions={0}")
    assert op.groups == (tuple(range(8)),) and op.result_bytes == 64


def test_unknown_formats_fail_loudly():
    with pytest.raises(ValueError, match="unrecognised"):
        parse_collectives(HEADER + "%ag = f32[4]{0} all-gather(f32[2]{0} %p), replica_groups=mesh['a'=2] {'b'}")
    with pytest.raises(ValueError, match="unknown HLO element type"):
        parse_collectives(HEADER + "%ag = q7[4]{0} all-gather(q7[2]{0} %p), replica_groups={{0,1}}")
