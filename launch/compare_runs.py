"""Compare runs on one figure: ``python launch/compare_runs.py RUN_DIR [RUN_DIR ...] [--labels a,b] [--out FILE]
[--json FILE] [--window 5]``.

Reads each run's ``metrics.jsonl`` and ``validation.jsonl`` (``launch/plot.py``'s ``load_series``) and draws four
panels against the training step, one colour per run: training accuracy (``critic/acc/mean``, thin, with its
``--window``-step running mean, thick), validation accuracy (the mean over validation datasets), tool calls per
sample (``agent/tool_calls/mean``; absent for a run without the agent loop) and response length. Prints a table
per run (validation accuracy first and last, mean training accuracy over the first and last ``--window`` steps, tool
calls and tool errors) and writes it as JSON with ``--json``. Default figure: ``compare.png`` in the current
directory. Used for the tool-vs-no-tool comparison in docs/AGENT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from plot import COLORS, finish_panel, load_series  # noqa: E402  (launch/plot.py)

PANELS = [
    ("training accuracy (train batch)", "critic/acc/mean"),
    ("validation accuracy (held-out)", "val:acc"),
    ("tool calls per sample", "agent/tool_calls/mean"),
    ("response length (model tokens)", "response_length/mean"),
]


def running_mean(values: list[float], window: int) -> list[float]:
    """Mean of the last ``window`` values at each position (fewer at the start)."""
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i + 1 - window): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


def summarize(series: dict[str, list[tuple[float, float]]], window: int) -> dict[str, Any]:
    """One run's row: first/last validation accuracy, mean training accuracy over its first and last ``window``
    steps, mean tool calls per sample and total tool errors (None where the run has no such metric)."""
    def values(key: str) -> list[float]:
        return [v for _, v in series.get(key, [])]

    acc, val, calls, errors = (values(k) for k in ("critic/acc/mean", "val:acc", "agent/tool_calls/mean",
                                                   "agent/tool_errors"))
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"steps": len(acc), "val_acc_first": val[0] if val else None, "val_acc_last": val[-1] if val else None,
            "val_steps": [s for s, _ in series.get("val:acc", [])],
            "train_acc_first_window": mean(acc[:window]), "train_acc_last_window": mean(acc[-window:]),
            "train_acc_mean": mean(acc), "tool_calls_mean": mean(calls), "tool_errors_total": sum(errors) if errors
            else None}


def draw(runs: dict[str, dict[str, list[tuple[float, float]]]], window: int) -> Any:
    """The 2x2 figure: one colour per run in every panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, key) in zip(axes.flat, PANELS):
        drawn = 0
        for color, (label, series) in zip(COLORS, runs.items()):
            if key not in series:
                continue
            xs, ys = zip(*series[key])
            if key == "critic/acc/mean":
                ax.plot(xs, ys, color=color, alpha=0.3, linewidth=1)
                ax.plot(xs, running_mean(list(ys), window), color=color, linewidth=2.5,
                        label=f"{label} ({window}-step mean)")
            else:
                ax.plot(xs, ys, color=color, label=label, marker="o" if key.startswith("val:") else None)
            drawn += 1
        finish_panel(ax, title, "", drawn)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+")
    parser.add_argument("--labels", default=None, help="comma-separated, one per run (default: directory names)")
    parser.add_argument("--window", type=int, default=5)
    parser.add_argument("--out", default="compare.png")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [os.path.basename(os.path.abspath(d)) for d in args.run_dirs]
    if len(labels) != len(args.run_dirs):
        parser.error(f"--labels has {len(labels)} names for {len(args.run_dirs)} runs")
    if args.window < 1:
        parser.error(f"--window must be >= 1, got {args.window}")
    runs = {label: load_series(d) for label, d in zip(labels, args.run_dirs)}
    rows = {label: summarize(series, args.window) for label, series in runs.items()}
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    print(f"| run | steps | val acc first | val acc last | train acc first {args.window} | train acc last "
          f"{args.window} | tool calls / sample | tool errors |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for label, r in rows.items():
        print(f"| {label} | {r['steps']} | {fmt(r['val_acc_first'])} | {fmt(r['val_acc_last'])} | "
              f"{fmt(r['train_acc_first_window'])} | {fmt(r['train_acc_last_window'])} | {fmt(r['tool_calls_mean'])} | "
              f"{'-' if r['tool_errors_total'] is None else int(r['tool_errors_total'])} |")
    try:
        fig = draw(runs, args.window)
    except ImportError as exc:
        raise SystemExit(f"compare_runs: matplotlib is needed (a dependency of jaxrl_hf): {exc}") from exc
    fig.savefig(args.out, dpi=100)
    print(args.out)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"runs": dict(zip(labels, args.run_dirs)), "window": args.window, "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
