"""What a compiled program needs per device, read from XLA, and the readable table of a plan.

Per program (all per device; XLA's ``compiled.memory_analysis()`` of the SPMD-partitioned program):

    peak_bytes_per_device  = argument + output − alias + temp

``argument``: the program's inputs (params, optimizer state, batch, cache); ``output``: its results;
``alias``: outputs written into donated inputs (the train state of ``update_actor``, the KV cache of
``generate``), counted once; ``temp``: XLA's scratch buffers at their live-range high-water mark (activations,
gradients, gathered FSDP shards). The generated code is not counted.

    total_bytes_per_device = peak_bytes_per_device + resident_bytes_per_device

``resident``: the worker's state held on the device during the program without being one of its arguments (the
Adam moments during ``log_prob`` and ``generate`` unless ``actor.offload_optimizer``; the reference copy unless
its params are offloaded). A plan ``fits`` when every program's total is at most ``usable_bytes_per_device``: the
device memory times JAX's share of it under the project's GPU memory budget (`jaxrl_hf.config.memory_budget`:
``1 − placement.memory.margin`` with the native engine, less vLLM's share when ``rollout.name=vllm``).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from jaxrl_hf.mesh.hlo_collectives import COLLECTIVE_KINDS, Collective, parse_collectives

GIB = 2 ** 30


def memory_stats(compiled: Any) -> dict[str, int]:
    """XLA's memory analysis of ``compiled`` and ``peak_bytes_per_device`` (module docstring)."""
    ma = compiled.memory_analysis()
    stats = {"argument_bytes": int(ma.argument_size_in_bytes), "output_bytes": int(ma.output_size_in_bytes),
             "alias_bytes": int(ma.alias_size_in_bytes), "temp_bytes": int(ma.temp_size_in_bytes)}
    stats["peak_bytes_per_device"] = (stats["argument_bytes"] + stats["output_bytes"] - stats["alias_bytes"]
                                      + stats["temp_bytes"])
    return stats


def _moves_floats(op: Collective) -> bool:
    """Whether a collective's result holds floating-point data (params, gradients, activations), as opposed to
    integer batch columns or indices."""
    result = op.text.split("=", 1)[1].split(op.kind, 1)[0]
    return any(dtype.startswith(("f", "bf")) for dtype in re.findall(r"([a-z][a-z0-9]*)\[", result))


def collective_counts(compiled: Any) -> tuple[dict[str, int], dict[str, int]]:
    """How many ops of each collective kind the compiled HLO holds (async start/done pairs counted once): all
    of them, and those moving floating-point data."""
    ops = parse_collectives(compiled.as_text())
    every, floats = Counter(op.kind for op in ops), Counter(op.kind for op in ops if _moves_floats(op))
    return ({kind: int(every.get(kind, 0)) for kind in COLLECTIVE_KINDS},
            {kind: int(floats.get(kind, 0)) for kind in COLLECTIVE_KINDS})


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def format_table(report: dict[str, Any]) -> str:
    """The plan as a readable table (GiB per device) plus the fit verdict and the keys' fate."""
    head = (f"{report['model']} ({report['num_params'] / 1e9:.2f}B params) on {report['devices']} devices, "
            f"{_gib(report['device_memory_bytes'])} GiB each; train {report['layout']['train']} "
            f"[{report['layout']['rule_set']}], generate {report['layout']['generate']}")
    cols = ("program", "peak", "params", "optim", "temp", "resident", "total", "cost model",
            "collectives (ag/rs/ar/a2a/cp)")
    rows = [cols]
    for name, p in report["programs"].items():
        c = p["collectives"]
        rows.append((name, _gib(p["peak_bytes_per_device"]), _gib(p["param_bytes_per_device"]),
                     _gib(p["optimizer_bytes_per_device"]), _gib(p["temp_bytes"]),
                     _gib(p["resident_bytes_per_device"]), _gib(p["total_bytes_per_device"]),
                     _gib(p["cost_model"]["predicted_bytes_per_device"]) if p["cost_model"] else "-",
                     "/".join(str(c[k]) for k in ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
                                                  "collective-permute"))))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(cols))]
    lines = [head, ""] + ["  ".join(str(v).rjust(w) if i else str(v).ljust(w) for i, (v, w) in
                                    enumerate(zip(r, widths))) for r in rows]
    if "vllm" in report:
        v, shared = report["vllm"], report["time_sharing"]
        lines += ["", f"vLLM tp={v['tensor_parallel_size']} x {v['replicas']} replicas: share "
                      f"{_gib(v['share_bytes_per_device'])} GiB = weights {_gib(v['weight_bytes_per_device'])} + "
                      f"activations {_gib(v['activation_allowance_bytes'])} + KV cache "
                      f"{_gib(v['kv_cache_bytes_per_device'])} GiB ({v['kv_cache_tokens']} tokens; one sequence of "
                      f"{v['max_model_len']}: {'fits' if v['one_sequence_fits'] else 'does NOT fit'})",
                  f"phases (allocator {shared['allocator']}: "
                  f"{'time-shared' if shared['time_shared'] else 'static split, JAX keeps its pool'}; JAX up to "
                  f"{_gib(shared['jax_cap_bytes'])} GiB):"]
        for name, row in report["phases"].items():
            lines.append(f"  {name:9s} JAX {_gib(row['jax_bytes'])} + vLLM {_gib(row['vllm_bytes'])} + allowance "
                         f"{_gib(row['allowance_bytes'])} = {_gib(row['total_bytes'])} GiB: "
                         f"{'fits' if row['fits'] else 'does NOT fit'}")
        lines.append(f"fits: {'yes' if report['fits'] else 'NO'}")
    else:
        lines += ["", f"fits in {_gib(report['usable_bytes_per_device'])} GiB usable per device "
                      f"({report['memory_budget']}): {'yes' if report['fits'] else 'NO'}"]
    keys = report["keys"]
    for title, entries in (("mapped", keys["mapped"]), ("not modelled (plan computed without them)",
                                                         keys["not_modelled"]), ("ignored", keys["ignored"])):
        if entries:
            lines.append(f"{title}: " + "; ".join(f"{k} ({v})" for k, v in entries))
    return "\n".join(lines)
