"""Plot a run's learning curves: ``python launch/plot.py RUN_DIR [--out FILE]``.

Reads ``RUN_DIR/metrics.jsonl`` (and ``validation.jsonl``) and draws four panels vs step: reward/accuracy
(train score, train acc, validation acc), response length, entropy, pg_clipfrac. Writes ``RUN_DIR/curves.png``
with matplotlib when it is installed, else ``RUN_DIR/curves.svg`` (a self-contained SVG, no dependency).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from xml.sax.saxutils import escape

PANELS = [
    ("reward / accuracy", ["critic/score/mean", "critic/acc/mean", "val:acc"]),
    ("response length (tokens)", ["response_length/mean"]),
    ("entropy", ["actor/entropy"]),
    ("pg_clipfrac", ["actor/pg_clipfrac"]),
]
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"]


def _read(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_series(run_dir: str) -> dict[str, list[tuple[float, float]]]:
    """``{metric: [(step, value), ...]}`` incl. ``val:acc`` = mean of the val-core */acc/mean@N metrics."""
    records = _read(os.path.join(run_dir, "metrics.jsonl"))
    if not records:
        raise SystemExit(f"plot: no records in {os.path.join(run_dir, 'metrics.jsonl')}")
    series: dict[str, list[tuple[float, float]]] = {}
    for rec in records:
        for key, value in rec.items():
            if isinstance(value, (int, float)) and key != "step" and math.isfinite(value):
                series.setdefault(key, []).append((rec["step"], float(value)))
    for rec in _read(os.path.join(run_dir, "validation.jsonl")):
        accs = [v for k, v in rec.items() if k.startswith("val-core/") and "/acc/mean@" in k and isinstance(v, (int, float))]
        if accs:
            series.setdefault("val:acc", []).append((rec["step"], sum(accs) / len(accs)))
    return series


def plot_matplotlib(series: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, keys) in zip(axes.flat, PANELS):
        for color, key in zip(COLORS, keys):
            if key in series:
                xs, ys = zip(*series[key])
                ax.plot(xs, ys, marker="o" if key == "val:acc" else None, color=color, label=key)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def plot_svg(series: dict, out: str, title: str) -> None:
    """Four line panels as SVG (axes, ticks, legends), written by hand."""
    pw, ph, margin = 420, 260, 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * pw}" height="{2 * ph + 30}" font-family="sans-serif" font-size="11">',
             '<rect width="100%" height="100%" fill="white"/>',
             f'<text x="{pw}" y="18" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for i, (name, keys) in enumerate(PANELS):
        ox, oy = (i % 2) * pw, 30 + (i // 2) * ph
        present = [k for k in keys if k in series]
        points = [p for k in present for p in series[k]]
        x0, y0, x1, y1 = ox + margin, oy + ph - 35, ox + pw - 15, oy + 25
        parts.append(f'<text x="{ox + pw / 2}" y="{oy + 15}" text-anchor="middle" font-size="12">{escape(name)}</text>')
        parts.append(f'<line x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/><line x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="black"/>')
        if not points:
            parts.append(f'<text x="{(x0 + x1) / 2}" y="{(y0 + y1) / 2}" text-anchor="middle" fill="gray">no data</text>')
            continue
        xmin, xmax = min(p[0] for p in points), max(p[0] for p in points)
        ymin, ymax = min(p[1] for p in points), max(p[1] for p in points)
        xmax, ymax = (xmax if xmax > xmin else xmin + 1), (ymax if ymax > ymin else ymin + 1e-9 + abs(ymin) * 0.1 + 1e-3)

        def sx(x: float) -> float:
            return x0 + (x - xmin) / (xmax - xmin) * (x1 - x0)

        def sy(y: float) -> float:
            return y0 - (y - ymin) / (ymax - ymin) * (y0 - y1)

        for t in range(5):
            yv = ymin + (ymax - ymin) * t / 4
            xv = xmin + (xmax - xmin) * t / 4
            parts.append(f'<text x="{x0 - 4}" y="{sy(yv) + 4}" text-anchor="end">{yv:.3g}</text>')
            parts.append(f'<text x="{sx(xv)}" y="{y0 + 14}" text-anchor="middle">{xv:.0f}</text>')
        parts.append(f'<text x="{(x0 + x1) / 2}" y="{y0 + 28}" text-anchor="middle">step</text>')
        for j, key in enumerate(present):
            color = COLORS[j % len(COLORS)]
            pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in series[key])
            parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.5" points="{pts}"/>')
            for x, y in series[key] if len(series[key]) < 40 else []:
                parts.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2" fill="{color}"/>')
            parts.append(f'<text x="{x0 + 8}" y="{y1 + 12 * j}" fill="{color}">{escape(key)}</text>')
    parts.append("</svg>")
    with open(out, "w", encoding="utf-8") as fh:
        fh.write("\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="output file (.png needs matplotlib; .svg always works)")
    args = parser.parse_args(argv)
    series = load_series(args.run_dir)
    try:
        import matplotlib  # noqa: F401

        have_mpl = True
    except ImportError:
        have_mpl = False
    out = args.out or os.path.join(args.run_dir, "curves.png" if have_mpl else "curves.svg")
    if out.endswith(".png"):
        if not have_mpl:
            raise SystemExit("plot: writing a PNG needs matplotlib (pip install matplotlib); use --out FILE.svg")
        plot_matplotlib(series, out)
    else:
        plot_svg(series, out, title=os.path.basename(os.path.abspath(args.run_dir)))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
