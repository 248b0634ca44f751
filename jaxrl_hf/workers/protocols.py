"""Transfer protocols of the workers: the paper's 3D_PROTO (MESH_DP) with per-rank meta info merged.

Each rank reports its own ``gen_timing_s`` / ``num_generated_tokens``, which differ between ranks, so the
plain MESH_DP collect (which insists on equal meta info) cannot merge them. ``MESH_DP_MERGE`` concatenates
the rows like MESH_DP and merges meta info: timings take the max over ranks (the stage ends with the
slowest rank), counts are summed, anything else keeps the first rank's value.
"""

from __future__ import annotations

from typing import Any

from jaxrl_hf.controller import Batch, GroupLayout, Protocol
from jaxrl_hf.controller.protocols import dispatch_mesh_dp

MAX_META_KEYS = ("gen_timing_s",)
SUM_META_KEYS = ("num_generated_tokens",)


def merge_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Meta info of several ranks as one: max for timings, sum for counts, first value otherwise."""
    merged: dict[str, Any] = {}
    for meta in metas:
        for key, value in meta.items():
            if key not in merged:
                merged[key] = value
            elif key in MAX_META_KEYS:
                merged[key] = max(merged[key], value)
            elif key in SUM_META_KEYS:
                merged[key] = merged[key] + value
    return merged


def collect_mesh_dp_merge(layout: GroupLayout, outputs: list) -> Any:
    """Concatenate the Batches of tp rank 0 / last pp stage in dp order, meta info merged (`merge_meta`)."""
    picked = [outputs[r] for r in layout.collect_ranks()]
    if not all(isinstance(o, Batch) for o in picked):
        return picked
    merged = Batch.concat(picked, meta_conflict="first")
    return Batch(merged.arrays, merged.objects, merge_meta([o.meta_info for o in picked]))


MESH_DP_MERGE = Protocol("MESH_DP_MERGE", dispatch_mesh_dp, collect_mesh_dp_merge, accepts_futures=True)
