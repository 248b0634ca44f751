"""DAPO's ablation (Yu et al. 2025, Table 1) in one command:
``python launch/ablate.py [--seeds 3] [--preset P] [--rows a,b] [--out DIR] [key.path=value ...]``.

Each row adds one mechanism to the row above it; everything else is ``--algo dapo``'s configuration (plus
``--preset`` and the overrides given here, applied to every row):

====================================  =======================================================================
row                                   adds
====================================  =======================================================================
``naive_grpo``                        symmetric clip 0.2, sample-level loss (seq-mean-token-mean), no overlong
                                      shaping or filtering, no dynamic sampling
``overlong_filtering``                ``algorithm.overlong_filter=true`` (§3.4: truncated samples out of the loss)
``clip_higher``                       ``actor.clip_ratio_high=0.28`` (§3.1)
``soft_overlong_punishment``          ``reward_model.overlong_buffer.enable=true`` (eq.13)
``token_level_loss``                  ``actor.loss_agg_mode=token-mean`` (§3.3)
``dynamic_sampling``                  ``algorithm.filter_groups.enable=true`` (§3.2): the full DAPO recipe
====================================  =======================================================================

Every row runs with ``--seeds`` seeds (seed s sets ``rollout.seed``, ``data.seed`` and ``trainer.seed``), one run
after another in this process (``jaxrl_hf.trainer.run``), into ``OUT/<row>/seed<s>``; a run whose
``metrics.jsonl`` already reaches ``trainer.total_steps`` is not run again (``--no-run``: none is run, and the
summary covers the finished runs only; ``--merge OLD.json`` adds, for a run not finished in OUT, the same run's
result from an earlier ``ablation.json``). The score of a run is its final
validation accuracy per data source (``val-core/<source>/acc/mean@N`` of the last ``validation.jsonl``
record). Writes ``OUT/ablation.json`` (every run, and per row the mean and std over seeds) and
``OUT/ablation.png`` (mean ± std per row and data source) and ``OUT/curves.png`` (per row, the seed-mean of
``actor/entropy``, ``response_length/mean`` and ``actor/pg_clipfrac`` against the training step). Exit status:
0; 1 if a run failed; 2 for a bad configuration; a run stopped by SIGTERM / Ctrl-C (75 / 130) stops the
ablation with its status (the same command resumes it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NAIVE_GRPO = ["actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.2", "actor.loss_agg_mode=seq-mean-token-mean",
              "algorithm.overlong_filter=false", "reward_model.overlong_buffer.enable=false",
              "algorithm.filter_groups.enable=false"]
ROWS: list[tuple[str, str]] = [  # (row name, the override it adds to the row above)
    ("naive_grpo", ""),
    ("overlong_filtering", "algorithm.overlong_filter=true"),
    ("clip_higher", "actor.clip_ratio_high=0.28"),
    ("soft_overlong_punishment", "reward_model.overlong_buffer.enable=true"),
    ("token_level_loss", "actor.loss_agg_mode=token-mean"),
    ("dynamic_sampling", "algorithm.filter_groups.enable=true"),
]


def row_overrides() -> dict[str, list[str]]:
    """``{row: overrides}``: the naive-GRPO overrides with each row's addition and all those above it (a later
    override of a key wins, so each row differs from the one above in exactly one key)."""
    out, added = {}, []
    for name, override in ROWS:
        added = added + [override] if override else added
        out[name] = NAIVE_GRPO + added
    return out


def final_accuracy(run_dir: str) -> dict[str, float]:
    """``{data source: acc mean@N}`` of the run's last validation record (empty without one)."""
    path = os.path.join(run_dir, "validation.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    last = records[-1] if records else {}
    return {k[len("val-core/"):k.index("/acc/mean@")]: float(v) for k, v in last.items()
            if k.startswith("val-core/") and "/acc/mean@" in k}


def last_step(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as fh:
        steps = [json.loads(line)["step"] for line in fh if line.strip()]
    return max(steps, default=0)


def run_length(run_dir: str, configured: int | None) -> float:
    """Steps the run has in all: ``trainer.total_steps``, or for a length counted in epochs
    (``trainer.total_epochs``) the one the run resolved into its ``config.yaml`` (unknown before it started)."""
    if configured is not None:
        return configured
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        return math.inf
    with open(path, encoding="utf-8") as fh:
        return float((yaml.safe_load(fh).get("trainer") or {}).get("total_steps") or math.inf)


def same_run(a: list[str], b: list[str]) -> bool:
    """Two runs' overrides name the same run, wherever its directory is (``trainer.run_dir`` and
    ``trainer.overwrite``, which does not change a run's numbers, aside)."""
    def key(overrides: list[str]) -> list[str]:
        return [o for o in overrides if not o.startswith(("trainer.run_dir=", "trainer.overwrite="))]

    return key(a) == key(b)


def carried_run(previous: dict[str, Any] | None, name: str, seed: int, overrides: list[str],
                source: str) -> dict[str, Any] | None:
    """The finished run ``(name, seed)`` of an earlier ``ablation.json`` (``--merge``) with the same overrides
    (its final accuracy is kept; its per-step metrics are not, so it is left out of the curves)."""
    for row in (previous or {}).get("rows", []):
        for r in row["runs"] if row["row"] == name else []:
            if r["seed"] == seed and r["status"] == 0 and r["final_acc"] and same_run(r["overrides"], overrides):
                return {**r, "carried_from": source}
    return None


def summarize(rows: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per row: its runs and, per data source, the mean and (sample) std of the final accuracy over seeds."""
    out = []
    for name, runs in rows.items():
        sources = sorted({s for r in runs for s in r["final_acc"]})
        values = {s: [r["final_acc"][s] for r in runs if s in r["final_acc"]] for s in sources}
        out.append({"row": name, "overrides": runs[0]["overrides"] if runs else [], "runs": runs,
                    "mean": {s: float(np.mean(v)) for s, v in values.items()},
                    "std": {s: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0 for s, v in values.items()}})
    return out


CURVE_KEYS = ("actor/entropy", "response_length/mean", "actor/pg_clipfrac")


def metric_curve(run_dir: str, key: str) -> dict[int, float]:
    """``{step: value}`` of one metric from the run's ``metrics.jsonl`` (steps without the key are left out)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    return {int(r["step"]): float(r[key]) for r in records if key in r}


def mean_curve(curves: list[dict[int, float]]) -> tuple[list[int], list[float]]:
    """Steps present in every seed's curve, and the mean over seeds at each."""
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    return steps, [float(np.mean([c[s] for c in curves])) for s in steps]


def plot_curves(summary: list[dict[str, Any]], path: str) -> None:
    """One panel per ``CURVE_KEYS`` metric, one line per row (mean over its seeds) against the training step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVE_KEYS), figsize=(4.5 * len(CURVE_KEYS), 3.5))
    for ax, key in zip(axes, CURVE_KEYS):
        for row in summary:
            curves = [c for c in (metric_curve(r["run_dir"], key) for r in row["runs"]) if c]  # carried: none
            steps, values = mean_curve(curves)
            ax.plot(steps, values, marker=".", label=row["row"])
        ax.set_xlabel("training step")
        ax.set_ylabel(f"{key} (mean over seeds)")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot(summary: list[dict[str, Any]], path: str) -> None:
    """Grouped bars: one group per row, one bar per data source, error bars = std over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = sorted({s for row in summary for s in row["mean"]})
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(summary), 4.5))
    width = 0.8 / max(len(sources), 1)
    x = np.arange(len(summary))
    for i, source in enumerate(sources):
        means = [row["mean"].get(source, np.nan) for row in summary]
        stds = [row["std"].get(source, 0.0) for row in summary]
        ax.bar(x + (i - (len(sources) - 1) / 2) * width, means, width, yerr=stds, capsize=3, label=source)
    seeds = max((len(row["runs"]) for row in summary), default=0)
    ax.set_xticks(x, [row["row"].replace("_", "\n") for row in summary], fontsize=8)
    ax.set_ylabel(f"final validation accuracy (mean@N), mean ± std over {seeds} seed(s)")
    ax.set_title("DAPO ablation: each row adds one mechanism to the row on its left")
    ax.grid(True, axis="y", alpha=0.3)
    if sources:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per row (0, 1, ..., SEEDS-1)")
    parser.add_argument("--preset", default=None, help="preset(s) for every run, as in launch/train.py")
    parser.add_argument("--rows", default=None, help=f"comma-separated subset of {[name for name, _ in ROWS]}")
    parser.add_argument("--out", default="runs/ablation", help="output directory")
    parser.add_argument("--no-run", action="store_true",
                        help="run nothing: summarize only the finished runs in OUT (a cut-off ablation's results)")
    parser.add_argument("--merge", default=None, metavar="ABLATION_JSON",
                        help="with --no-run: a (row, seed) not finished in OUT takes its result from this earlier "
                             "ablation.json when its overrides are the same (marked carried_from; not in the curves)")
    parser.add_argument("overrides", nargs="*", help="dotted config overrides applied to every row")
    args = parser.parse_args(argv)
    table = row_overrides()
    names = args.rows.split(",") if args.rows else list(table)
    unknown = [n for n in names if n not in table]
    if unknown or args.seeds < 1:
        parser.error(f"--rows: unknown {unknown}; valid: {list(table)}" if unknown else "--seeds must be >= 1")
    from jaxrl_hf.config import ConfigError, load_config
    from jaxrl_hf.errors import ExitCode
    from jaxrl_hf.trainer import run

    if args.merge and not args.no_run:
        parser.error("--merge needs --no-run (it summarizes; it does not replace a run)")
    previous = None
    if args.merge:
        with open(args.merge, encoding="utf-8") as fh:
            previous = json.load(fh)
    os.makedirs(args.out, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {}
    failed = False
    for name in names:
        for seed in range(args.seeds):
            run_dir = os.path.abspath(os.path.join(args.out, name, f"seed{seed}"))
            overrides = [*table[name], *(f"{k}={seed}" for k in ("rollout.seed", "data.seed", "trainer.seed")),
                         *args.overrides, f"trainer.run_dir={run_dir}",
                         "trainer.overwrite=true"]  # a row cut off before its first checkpoint starts over
            try:
                total = run_length(run_dir, load_config("dapo", args.preset, overrides).trainer.total_steps)
            except ConfigError as err:
                print(f"ablation: config error in row {name}: {err}", file=sys.stderr)
                return 2
            if args.no_run and last_step(run_dir) < total:
                carried = carried_run(previous, name, seed, overrides, args.merge or "")
                if carried:
                    results.setdefault(name, []).append(carried)
                continue
            status = 0 if last_step(run_dir) >= total else run("dapo", preset=args.preset, overrides=overrides)
            if status in (ExitCode.PREEMPTED, ExitCode.INTERRUPTED):  # SIGTERM / Ctrl-C stops the ablation too
                print(f"ablation: stopped in {name} seed {seed} (exit {status}); the same command resumes it",
                      file=sys.stderr)
                return int(status)
            failed |= status != 0
            results.setdefault(name, []).append({"seed": seed, "run_dir": run_dir, "status": status,
                                                 "overrides": overrides, "final_step": last_step(run_dir),
                                                 "final_acc": final_accuracy(run_dir)})
            print(f"ablation: {name} seed {seed}: status {status}, final acc {results[name][-1]['final_acc']}",
                  file=sys.stderr)
    summary = summarize(results)
    with open(os.path.join(args.out, "ablation.json"), "w", encoding="utf-8") as fh:
        json.dump({"command": sys.argv, "preset": args.preset, "seeds": args.seeds, "rows": summary}, fh, indent=2)
    plot(summary, os.path.join(args.out, "ablation.png"))
    plot_curves(summary, os.path.join(args.out, "curves.png"))
    for row in summary:
        cells = ", ".join(f"{s} {row['mean'][s]:.3f} ± {row['std'][s]:.3f}" for s in row["mean"])
        print(f"{row['row']:>26}: {cells or 'no validation'}")
    print(os.path.join(args.out, "ablation.json"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
