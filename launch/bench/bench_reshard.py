"""Benchmark: 3D-HybridEngine train->generation transition vs HybridFlow-V vs DS-Chat (HybridFlow §2.5.4).

For each synthetic Llama-like model (135M-like and ~1B-like) and (p,t,d)->(p_g,t_g) layout on 8
devices, every method's transition is compiled on abstract inputs and its collectives and memory
are read from the compiled program (bytes received per device, peak parameter bytes per device),
then executed and timed side by side. Prints a table and the ratios baseline / HybridFlow, and
writes JSON (``--json OUT``; ``OUT["results"]`` holds one row per (model, layout, config, method)).

A config may name the training layout (rule set) it starts from: ``fsdp:2-1-4->1-1``,
``fsdp_tp:2-2-2->1-2`` (default ``megatron``); the baselines run on megatron configs only. HybridFlow rows
also report the one-shot reshard (``--layers-per-group`` applies to the chunked one, the default) and the
way back: bytes vs the layout's formula, peak / generation shard before (one-shot) and after chunking.

When a method's transition of the full model does not fit the memory budget (``--mem-budget-gb``,
default 40% of MemAvailable over all 8 simulated devices), its time is measured on a slice with the
same per-layer shapes (``--slice-layers`` layers, vocab / 8) and scaled by the param-bytes ratio;
the row says so in ``time_source``. Bytes and peak memory always come from the full-size program.

Usage: python launch/bench/bench_reshard.py --json out.json [--models 135m,1b] [--configs 1-4-2->1-2,fsdp:2-1-4->1-1,...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jaxrl_hf.mesh.chunked_reshard import DEFAULT_LAYERS_PER_GROUP  # noqa: E402
from jaxrl_hf.mesh.hybrid_engine import METHODS, delete_tree, make_transition, shard_bytes_per_device  # noqa: E402
from jaxrl_hf.mesh.synthetic import init_params, llama_logical_axes, llama_param_shapes, llama_shape, param_bytes  # noqa: E402
from jaxrl_hf.mesh.topology import GenParallel, parse_config  # noqa: E402
from jaxrl_hf.mesh.transition_report import analyze_transition, time_transition  # noqa: E402

DEFAULT_CONFIGS = "1-4-2->1-2,2-2-2->1-2,1-8-1->1-2"


LAYOUTS = ("megatron", "fsdp", "fsdp_tp")


def expected_bytes(method: str, gen: GenParallel, m: int, layout: str = "megatron") -> float:
    """Per-device transition traffic: Table 2 of the paper; HybridFlow from a dp-sharded layout (fsdp, fsdp_tp)
    receives its generation shard minus its training shard M/(p·t·d)."""
    p, t, n = gen.train.pp, gen.train.tp, gen.train.num_devices
    if method == "hybridflow" and layout != "megatron":
        return m / (gen.pp * gen.tp) - m / n
    return {"hybridflow": (gen.dg - 1) / (p * t) * m, "hybridflow_v": (p * t - 1) / (p * t) * m,
            "ds_chat": (n - 1) / n * m}[method]


def parse_layout_config(text: str) -> tuple[str, str]:
    """``'fsdp:2-1-4->1-1'`` -> ``('fsdp', '2-1-4->1-1')``; no prefix means megatron."""
    layout, _, label = text.rpartition(":")
    layout = layout or "megatron"
    if layout not in LAYOUTS:
        sys.exit(f"--configs {text!r}: layout {layout!r}; valid: {list(LAYOUTS)}")
    return layout, label


def mem_available_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def _copier(shardings):
    # x + 0 in a jitted program yields fresh buffers (a new training state per repeat).
    return jax.jit(lambda tree: jax.tree.map(lambda a: a + jnp.zeros((), a.dtype), tree), out_shardings=shardings)


def measure_time(method: str, gen: GenParallel, shape, dtype, repeats: int,
                 options: dict) -> tuple[float, list[float], int]:
    """(median s, all times, resident bytes/device) of ``method`` executed on the ``shape`` model."""
    axes, shapes = llama_logical_axes(shape), llama_param_shapes(shape, dtype)
    transition = make_transition(method, gen, axes, shapes, **options)
    master = init_params(shapes, transition.train_shardings, seed=0)
    copy = _copier(transition.train_shardings)
    timing = time_transition(transition, lambda: copy(master), repeats=repeats, warmup=1)
    delete_tree(master)
    return timing.median_s, list(timing.times_s), timing.resident_bytes_per_device


def hybrid_extras(gen: GenParallel, axes, shapes, layout: str, transition) -> dict:
    """Peaks of the chunked reshard's way back and of the one-shot reshard (both directions), and its bytes."""
    one_shot = make_transition("hybridflow", gen, axes, shapes, rule_set=layout, layers_per_group=None)
    before = analyze_transition(one_shot, shapes)
    return {
        "peak_back_param_bytes_per_device":
            analyze_transition(transition, shapes, transition.training_phases()).peak_param_bytes_per_device,
        "one_shot_bytes_per_device": before.bytes_per_device,
        "one_shot_peak_param_bytes_per_device": before.peak_param_bytes_per_device,
        "one_shot_peak_back_param_bytes_per_device":
            analyze_transition(one_shot, shapes, one_shot.training_phases()).peak_param_bytes_per_device,
        "programs": len(transition.phases()),
    }


def bench_row(model: str, layout: str, label: str, method: str, dtype, repeats: int, budget: int,
              slice_layers: int, layers_per_group: int | None) -> dict:
    gen = parse_config(label)
    shape = llama_shape(model)
    axes, shapes = llama_logical_axes(shape), llama_param_shapes(shape, dtype)
    m = param_bytes(shapes)
    options = {"rule_set": layout, "layers_per_group": layers_per_group} if method == "hybridflow" else {}
    transition = make_transition(method, gen, axes, shapes, **options)
    analysis = analyze_transition(transition, shapes)
    gen_bytes = shard_bytes_per_device(transition.gen_shardings, shapes)
    kept = 0 if method == "hybridflow" else shard_bytes_per_device(transition.train_shardings, shapes)
    train_bytes = shard_bytes_per_device(transition.train_shardings, shapes)
    need = gen.train.num_devices * (analysis.peak_param_bytes_per_device + train_bytes)  # + the master copy
    if need <= budget:
        median, times, resident = measure_time(method, gen, shape, dtype, repeats, options)
        source, measured_bytes = "measured", m
    else:
        layers = slice_layers * math.lcm(gen.train.pp, gen.pp)
        sliced = dataclasses.replace(shape, layers=layers, vocab=shape.vocab // 8)
        measured_bytes = param_bytes(llama_param_shapes(sliced, dtype))
        t_slice, times, _ = measure_time(method, gen, sliced, dtype, repeats, options)
        median = t_slice * m / measured_bytes
        resident = gen_bytes + kept
        source = (f"scaled: measured {t_slice:.4f}s on a {layers}-layer, vocab/8 slice "
                  f"({measured_bytes} B) x param-bytes ratio {m / measured_bytes:.2f}")
    expected = expected_bytes(method, gen, m, layout)
    row = {
        "model": model, "layout": layout, "config": label, "method": method, "dtype": jnp.dtype(dtype).name,
        "param_bytes": m,
        "bytes_per_device": analysis.bytes_per_device,
        "expected_bytes_per_device": expected,
        "bytes_match_formula": analysis.bytes_per_device == expected,
        "peak_param_bytes_per_device": analysis.peak_param_bytes_per_device,
        "resident_param_bytes_per_device": resident,
        "generation_shard_bytes": gen_bytes,
        "training_shard_bytes": train_bytes,
        "time_s": median,
        "times_s": times,
        "time_source": source,
        "collectives": sorted(analysis.collective_kinds),
        "replica_groups": sorted(list(g) for g in analysis.device_groups()),
    }
    if method == "hybridflow":
        row["layers_per_group"] = layers_per_group
        row.update(hybrid_extras(gen, axes, shapes, layout, transition))
    return row


def ratios(rows: list[dict]) -> list[dict]:
    out = []
    keyed = {(r["model"], r["layout"], r["config"], r["method"]): r for r in rows}
    for (model, layout, label, method), r in keyed.items():
        if method == "hybridflow":
            continue
        hf = keyed.get((model, layout, label, "hybridflow"))
        if hf is None:
            continue
        out.append({
            "model": model, "config": label, "baseline": method,
            "bytes_ratio": r["bytes_per_device"] / hf["bytes_per_device"] if hf["bytes_per_device"] else math.inf,
            "peak_ratio": r["peak_param_bytes_per_device"] / hf["peak_param_bytes_per_device"],
            "resident_ratio": r["resident_param_bytes_per_device"] / hf["resident_param_bytes_per_device"],
            "time_ratio": r["time_s"] / hf["time_s"],
            "time_reduction": 1.0 - hf["time_s"] / r["time_s"],
        })
    return out


def print_table(rows: list[dict], rat: list[dict]) -> None:
    mib = 1 << 20
    head = f"{'model':6} {'layout':8} {'config':11} {'method':13} {'M MiB':>8} {'recv MiB/dev':>12} {'formula':>7} " \
           f"{'peak MiB/dev':>12} {'resident MiB':>12} {'time s':>8}  source"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['model']:6} {r['layout']:8} {r['config']:11} {r['method']:13} {r['param_bytes'] / mib:8.1f} "
              f"{r['bytes_per_device'] / mib:12.2f} {'ok' if r['bytes_match_formula'] else 'DIFF':>7} "
              f"{r['peak_param_bytes_per_device'] / mib:12.2f} {r['resident_param_bytes_per_device'] / mib:12.2f} "
              f"{r['time_s']:8.4f}  {r['time_source'].split(':')[0]}")
    print()
    print("HybridFlow peak / generation shard, one-shot -> chunked (to_generation; to_training):")
    head = f"{'model':6} {'layout':8} {'config':11} {'gen MiB':>8} {'train MiB':>9} {'one-shot bytes':>14} " \
           f"{'peak before':>11} {'peak after':>10} {'back before':>11} {'back after':>10} {'programs':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if r["method"] != "hybridflow":
            continue
        g = r["generation_shard_bytes"]
        print(f"{r['model']:6} {r['layout']:8} {r['config']:11} {g / mib:8.2f} {r['training_shard_bytes'] / mib:9.2f} "
              f"{'= chunked' if r['one_shot_bytes_per_device'] == r['bytes_per_device'] else 'DIFF':>14} "
              f"{r['one_shot_peak_param_bytes_per_device'] / g:11.3f} {r['peak_param_bytes_per_device'] / g:10.3f} "
              f"{r['one_shot_peak_back_param_bytes_per_device'] / g:11.3f} "
              f"{r['peak_back_param_bytes_per_device'] / g:10.3f} {r['programs']:8d}")
    print()
    head = f"{'model':6} {'config':11} {'baseline':13} {'bytes x':>8} {'peak x':>7} {'resident x':>10} " \
           f"{'time x':>7} {'time cut':>8}"
    print(head)
    print("-" * len(head))
    for q in rat:
        print(f"{q['model']:6} {q['config']:11} {q['baseline']:13} {q['bytes_ratio']:8.2f} {q['peak_ratio']:7.2f} "
              f"{q['resident_ratio']:10.2f} {q['time_ratio']:7.2f} {q['time_reduction']:8.1%}")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write results JSON here")
    ap.add_argument("--models", default="135m,1b", help="comma list of synthetic models (tiny, 135m, 1b)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma list of '[layout:]p-t-d->pg-tg', layout one of megatron (default), fsdp, fsdp_tp")
    ap.add_argument("--layers-per-group", type=int, default=DEFAULT_LAYERS_PER_GROUP,
                    help="stacked layers per HybridFlow reshard program (0: one program for the whole tree)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mem-budget-gb", type=float, default=None,
                    help="host memory the executed transitions may use (default 40%% of MemAvailable)")
    ap.add_argument("--slice-layers", type=int, default=1,
                    help="layers (x lcm(p, p_g)) of the slice timed when the full model does not fit")
    args = ap.parse_args(argv)
    if jax.device_count() < 8:
        sys.exit(f"bench_reshard needs 8 devices, found {jax.device_count()}: run with "
                 "XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before jax is imported)")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        sys.exit(f"unknown --methods {unknown}; valid: {list(METHODS)}")
    configs = [parse_layout_config(c.strip()) for c in args.configs.split(",") if c.strip()]
    for _, c in configs:
        gen = parse_config(c)
        if gen.train.num_devices != 8:
            sys.exit(f"config {c!r} uses {gen.train.num_devices} devices; this benchmark runs on 8")
    layers_per_group = args.layers_per_group or None
    budget = int(args.mem_budget_gb * (1 << 30)) if args.mem_budget_gb else int(0.4 * mem_available_bytes())
    dtype = jnp.dtype(args.dtype)
    start = time.perf_counter()
    rows = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        for layout, label in configs:
            for method in methods if layout == "megatron" else [m for m in methods if m == "hybridflow"]:
                row = bench_row(model, layout, label, method, dtype, args.repeats, budget, args.slice_layers,
                                layers_per_group)
                rows.append(row)
                print(f"[{time.perf_counter() - start:7.1f}s] {model} {layout} {label} {method}: "
                      f"{row['bytes_per_device'] / (1 << 20):.2f} MiB/dev, {row['time_s']:.4f}s", flush=True)
    rat = ratios(rows)
    print()
    print_table(rows, rat)
    result = {
        "benchmark": "reshard", "machine": f"{platform.machine()} CPU, {os.cpu_count()} cores, no GPU; "
        f"8 simulated XLA host devices", "jax": jax.__version__, "dtype": args.dtype,
        "mem_budget_bytes": budget, "command": "python launch/bench/bench_reshard.py " + " ".join(argv or sys.argv[1:]),
        "results": rows, "ratios": rat, "wall_s": time.perf_counter() - start,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return result


if __name__ == "__main__":
    main()
