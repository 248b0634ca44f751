"""Plot a run's learning curves: ``python launch/plot.py RUN_DIR [--out FILE]``.

Reads ``RUN_DIR/metrics.jsonl`` (and ``validation.jsonl``) and draws four panels vs step: reward/accuracy
(train score, train acc, validation acc per dataset), response length, entropy, pg_clipfrac (a mixture-of-experts
policy: also expert load and router losses); for an SFT / DPO / PRM
run (``launch/train_sft.py``, ``train_dpo.py``, ``train_prm.py``): loss, DPO reward accuracy and margin (PRM: step
accuracy; SFT: tokens/s), gradient norm, lr. Writes ``RUN_DIR/curves.png``
with matplotlib's Agg backend (``--out`` may name another format matplotlib writes: ``.svg``, ``.pdf``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

PANELS = [
    ("reward / accuracy", "score / accuracy", ["critic/score/mean", "critic/acc/mean", "val:acc"]),
    ("response length", "tokens", ["response_length/mean"]),
    ("entropy", "nats / token", ["actor/entropy"]),
    ("pg_clipfrac", "fraction of tokens clipped", ["actor/pg_clipfrac"]),
]
FINETUNE_PANELS = [
    ("loss", "loss", ["train/loss"]),
    ("accuracy (DPO, PRM) / throughput (SFT)", "",
     ["rewards/accuracies", "rewards/margins", "train/step_accuracy", "perf/tokens_per_s"]),
    ("gradient norm", "global L2 norm", ["train/grad_norm"]),
    ("learning rate", "lr", ["train/lr"]),
]
"""``launch/train_sft.py`` / ``train_dpo.py`` / ``train_prm.py`` runs (no RL metrics): their own four panels."""
MOE_PANELS = [
    ("expert load (share of routed tokens, per layer)", "share", ["actor/moe/expert_load_max",
                                                                   "actor/moe/expert_load_min"]),
    ("router losses", "loss", ["actor/moe/aux_loss", "actor/moe/z_loss"]),
]
"""Two more panels for a mixture-of-experts policy (its ``actor/moe/*`` metrics)."""
LABELS = {"critic/score/mean": "train score", "critic/acc/mean": "train accuracy",
          "val:acc": "validation accuracy, mean over datasets", "response_length/mean": "train batch mean",
          "actor/entropy": "policy entropy (train batch)", "actor/pg_clipfrac": "PPO-clip fraction"}
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


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
        accs = {k[len("val-core/"):k.index("/acc/mean@")]: v for k, v in rec.items()
                if k.startswith("val-core/") and "/acc/mean@" in k and isinstance(v, (int, float))}
        if accs:
            series.setdefault("val:acc", []).append((rec["step"], sum(accs.values()) / len(accs)))
        for source, value in accs.items():
            series.setdefault(f"val:{source}", []).append((rec["step"], value))
    return series


def panel_keys(keys: list[str], series: dict[str, list[tuple[float, float]]]) -> list[str]:
    """A panel's metrics; ``val:acc`` expands to one line per validation dataset (``val:<source>``)."""
    out = []
    for key in keys:
        per_source = sorted(k for k in series if k.startswith("val:") and k != "val:acc") if key == "val:acc" else []
        out.extend(per_source or [key])
    return out


def draw(series: dict[str, list[tuple[float, float]]], title: str) -> Any:
    """A matplotlib Figure of ``PANELS`` (2x2; 3x2 with `MOE_PANELS`): titles, axis labels, legends; "no data" on
    empty panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finetune = "train/loss" in series and "critic/score/mean" not in series
    panels = [(n, y, [k for k in keys if k != "perf/tokens_per_s" or "rewards/margins" not in series])
              for n, y, keys in FINETUNE_PANELS] if finetune else PANELS
    if "actor/moe/expert_load_max" in series:
        panels = panels + MOE_PANELS
    fig, axes = plt.subplots(len(panels) // 2, 2, figsize=(10, 3.5 * (len(panels) // 2)))
    fig.suptitle(title)
    for ax, (name, ylabel, keys) in zip(axes.flat, panels):
        drawn = 0
        for color, key in zip(COLORS, panel_keys(keys, series)):
            if key in series:
                xs, ys = zip(*series[key])
                few, val = len(xs) < 40, key.startswith("val:")
                label = (f"{LABELS[key]} ({key})" if key in LABELS else
                         f"validation accuracy, {key[4:]}" if val else key)
                ax.plot(xs, ys, color=color, label=label, marker="o" if (val or few) else None,
                        markersize=5 if val else 3)
                drawn += 1
        finish_panel(ax, name, ylabel, drawn)
    fig.tight_layout()
    return fig


def finish_panel(ax: Any, title: str, ylabel: str, drawn: int) -> None:
    """Title, axis labels and grid of one panel against the step; its legend, or "no data" if nothing was drawn."""
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", color="gray", transform=ax.transAxes)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="output file (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    series = load_series(args.run_dir)
    out = args.out or os.path.join(args.run_dir, "curves.png")
    try:
        fig = draw(series, title=os.path.basename(os.path.abspath(args.run_dir)))
    except ImportError as exc:
        raise SystemExit(f"plot: matplotlib is needed (a dependency of jaxrl_hf; pip install -e .): {exc}") from exc
    fig.savefig(out, dpi=100)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
