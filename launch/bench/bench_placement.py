"""Placement benchmark: (A) simulator vs wall clock on this machine, (B) the paper's setting in simulation.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python launch/bench/bench_placement.py --json OUT

(A) calibrates the device constants (launch/calibrate.py's measurements) before and after the runs
(the host is shared, its load drifts; the prediction uses their geometric mean), runs a small PPO
iteration (4 tiny decoder models) under several placements on the 8 fake CPU devices, measures
each stage's wall time and compares it with the calibrated simulator's prediction: Spearman rank
correlation and median relative error, over stage times and over step times.
(B) runs Algorithm 1 for PPO with 7B-70B models on 16-128 A100-80GB (datasheet constants) and
reports which placement wins at which scale, next to the best colocated / split / standalone ones.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jaxrl_hf.placement import (Cluster, DeviceSpec, ModelArch, ParallelStrategy, RolloutShape, SimOptions, arch_by_name,  # noqa: E402
                                build_dataflow, published_device, search)
from jaxrl_hf.placement.cluster import device_to_dict  # noqa: E402
from jaxrl_hf.placement.report import median_relative_error, placement_label, spearman, strategies_label  # noqa: E402
from jaxrl_hf.placement.search import evaluate_placement  # noqa: E402

SMALL_ARCH = ModelArch(num_layers=2, hidden=256, num_heads=4, num_kv_heads=4, ffn_hidden=768, vocab=2048)
SMALL_SHAPE = RolloutShape(prompts=16, prompt_len=16, response_len=48, mini_batches=1)

# (name, [(models, first device, n devices, t, t_g for the actor)])
CPU_PLACEMENTS = [
    ("colocate@8 tp2", [(("actor", "critic", "ref", "reward"), 0, 8, 2, 1)]),
    ("colocate@8 dp", [(("actor", "critic", "ref", "reward"), 0, 8, 1, 1)]),
    ("colocate@8 tp4", [(("actor", "critic", "ref", "reward"), 0, 8, 4, 4)]),
    ("colocate@2", [(("actor", "critic", "ref", "reward"), 0, 2, 1, 1)]),
    ("colocate@1", [(("actor", "critic", "ref", "reward"), 0, 1, 1, 1)]),
    ("actor@4 / rest@4", [(("actor",), 0, 4, 2, 1), (("critic", "ref", "reward"), 4, 4, 1, None)]),
    ("actor+ref@4 / critic+reward@4", [(("actor", "ref"), 0, 4, 1, 1), (("critic", "reward"), 4, 4, 1, None)]),
    ("standalone 4/2/1/1", [(("actor",), 0, 4, 1, 1), (("critic",), 4, 2, 1, None), (("ref",), 6, 1, 1, None),
                            (("reward",), 7, 1, 1, None)]),
]


def cpu_section(repeats: int, quick_calibration: bool) -> dict:
    """Part (A): calibrate, then measure and predict every placement in CPU_PLACEMENTS."""
    from jaxrl_hf.placement.calibration import calibrate_device
    from jaxrl_hf.placement.measure import MeasuredModel, measure_placement
    from jaxrl_hf.placement.memory import MEASURED_WORKLOAD_OPTIONS
    import jax

    n = len(jax.devices())
    if n < 8:
        raise SystemExit(f"needs 8 devices, found {n}: set XLA_FLAGS=--xla_force_host_platform_device_count=8")
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    device_before, raw = calibrate_device(quick=quick_calibration)
    calib_s = time.perf_counter() - t0
    raw["host_load_avg_1min"] = [load_before, os.getloadavg()[0]]
    dataflow = build_dataflow("ppo", SMALL_ARCH, SMALL_SHAPE)
    measured = []
    for name, sets in CPU_PLACEMENTS:
        placed = [MeasuredModel(m, (start, start + size), t, t_g if m == "actor" else None)
                  for models, start, size, t, t_g in sets for m in models]
        load = os.getloadavg()[0]
        meas = measure_placement(dataflow, placed, repeats=repeats)
        measured.append((meas, [load, os.getloadavg()[0]]))
        print(f"  {name}: measured {sum(meas.values()):.3f} s (host load {load:.1f})", flush=True)
    # the host is shared with other jobs whose load drifts: calibrate again after measuring and
    # predict with the geometric mean of the two calibrations
    device_after, raw_after = calibrate_device(quick=quick_calibration)
    raw_after["host_load_avg_1min"] = [os.getloadavg()[0]]
    device = mean_device(device_before, device_after)
    cluster = Cluster(device, 8)
    rows = []
    for (name, sets), (meas, loads) in zip(CPU_PLACEMENTS, measured):
        strategies, placement = {}, []
        for models, start, size, t, t_g in sets:
            placement.append(models)
            for m in models:
                gen = (1, t_g) if m == "actor" else (None, None)
                strategies[m] = ParallelStrategy(1, t, size // t, *gen)
        pred = evaluate_placement(dataflow, cluster, tuple(placement), strategies, MEASURED_WORKLOAD_OPTIONS)
        rows.append({"placement": name, "strategies": strategies_label(pred), "measured_s": meas,
                     "host_load_avg_1min": loads,
                     "predicted_s": pred.stage_times, "measured_step_s": sum(meas.values()),
                     "predicted_step_s": pred.step_time_s})
    stage_pred = [r["predicted_s"][s] for r in rows for s in r["measured_s"]]
    stage_meas = [r["measured_s"][s] for r in rows for s in r["measured_s"]]
    step_pred = [r["predicted_step_s"] for r in rows]
    step_meas = [r["measured_step_s"] for r in rows]
    return {"device_profile": raw, "device_profile_after": raw_after, "device_used": device_to_dict(device),
            "calibration_s": calib_s, "arch": SMALL_ARCH.__dict__,
            "shape": SMALL_SHAPE.__dict__, "rows": rows,
            "stage_spearman": spearman(stage_pred, stage_meas),
            "stage_median_rel_error": median_relative_error(stage_pred, stage_meas),
            "step_spearman": spearman(step_pred, step_meas),
            "step_median_rel_error": median_relative_error(step_pred, step_meas),
            "best_measured": min(rows, key=lambda r: r["measured_step_s"])["placement"],
            "best_predicted": min(rows, key=lambda r: r["predicted_step_s"])["placement"]}


def mean_device(a: DeviceSpec, b: DeviceSpec) -> DeviceSpec:
    """Geometric mean of the numeric constants of two calibrations of the same machine."""
    def gm(x, y):
        if isinstance(x, dict):
            return {k: gm(x[k], y[k]) for k in x}
        if x is None or isinstance(x, (str, bool)) or isinstance(x, int) and not isinstance(x, bool) and x == y:
            return x
        return math.sqrt(x * y) if x > 0 and y > 0 else (x + y) / 2
    fields = {f.name: gm(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(DeviceSpec)}
    return DeviceSpec(**fields)


def _kind(placement: tuple[tuple[str, ...], ...]) -> str:
    if len(placement) == 1:
        return "colocate"
    if len(placement) == 4:
        return "standalone"
    actor_set = next(b for b in placement if "actor" in b)
    return "split" if "critic" not in actor_set else "other"


def paper_section(sizes: list[str], gpus: list[int], gpu: str) -> dict:
    """Part (B): Algorithm 1 in simulation over model sizes × cluster sizes."""
    rows = []
    for size in sizes:
        dataflow = build_dataflow("ppo", arch_by_name(size), RolloutShape())
        for n in gpus:
            res = search(dataflow, Cluster(published_device(gpu), n), SimOptions())
            if not res.candidates:
                rows.append({"model": size, "gpus": n, "feasible": 0, "search_s": res.wall_time_s})
                continue
            best_of = {}
            for c in res.candidates:
                best_of.setdefault(_kind(c.placement), c)
            best = res.best
            rows.append({
                "model": size, "gpus": n, "feasible": len(res.candidates), "search_s": res.wall_time_s,
                "best": placement_label(best), "best_kind": _kind(best.placement), "best_step_s": best.step_time_s,
                "best_strategies": strategies_label(best), "best_stage_s": best.stage_times,
                **{f"{k}_step_s": (best_of[k].step_time_s if k in best_of else None)
                   for k in ("colocate", "split", "standalone")},
                "split_best": placement_label(best_of["split"]) if "split" in best_of else None,
            })
    return {"gpu": gpu, "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick-calibration", action="store_true")
    ap.add_argument("--skip-cpu", action="store_true", help="only the simulated paper setting")
    ap.add_argument("--gpu", default="a100-80gb")
    args = ap.parse_args(argv)
    out: dict = {}
    if not args.skip_cpu:
        print("(A) simulator vs measurement, small PPO on 8 fake CPU devices", flush=True)
        cpu = cpu_section(args.repeats, args.quick_calibration)
        out["cpu"] = cpu
        stages = list(cpu["rows"][0]["measured_s"])
        print("| placement | " + " | ".join(f"{s} meas / pred s" for s in stages) + " | step meas / pred s |")
        print("|---|" + "---|" * (len(stages) + 1))
        for r in cpu["rows"]:
            cells = [f"{r['measured_s'][s]:.3f} / {r['predicted_s'][s]:.3f}" for s in stages]
            print(f"| {r['placement']} | " + " | ".join(cells)
                  + f" | {r['measured_step_s']:.3f} / {r['predicted_step_s']:.3f} |")
        print(f"stage times: Spearman {cpu['stage_spearman']:.3f}, median relative error "
              f"{cpu['stage_median_rel_error']:.1%}; step times: Spearman {cpu['step_spearman']:.3f}, "
              f"median relative error {cpu['step_median_rel_error']:.1%}; best measured "
              f"{cpu['best_measured']!r}, best predicted {cpu['best_predicted']!r}")
    print(f"(B) PPO in simulation on {args.gpu} (datasheet constants), 1024 prompts x (1024+1024) tokens", flush=True)
    paper = paper_section(["7b", "13b", "34b", "70b"], [16, 32, 64, 128], args.gpu)
    out["paper"] = paper
    print("| model | GPUs | best placement | step s | colocate s | best split s | split / colocate | "
          "standalone s | search s |")
    print("|---|---|---|---|---|---|---|---|---|")
    fmt = (lambda v: f"{v:.1f}" if v is not None else "infeasible")
    for r in paper["rows"]:
        if not r["feasible"]:
            print(f"| {r['model']} | {r['gpus']} | none fits in memory | | | | | | {r['search_s']:.2f} |")
            continue
        ratio = (f"{r['split_step_s'] / r['colocate_step_s']:.3f}"
                 if r["split_step_s"] and r["colocate_step_s"] else "-")
        print(f"| {r['model']} | {r['gpus']} | {r['best']} | {r['best_step_s']:.1f} | {fmt(r['colocate_step_s'])} | "
              f"{fmt(r['split_step_s'])} | {ratio} | {fmt(r['standalone_step_s'])} | {r['search_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"json written to {args.json}")
    return out


if __name__ == "__main__":
    main()
