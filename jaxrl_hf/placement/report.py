"""Readable tables of search results."""
from __future__ import annotations

from jaxrl_hf.placement.search import Candidate, SearchResult


def placement_label(cand: Candidate) -> str:
    """e.g. "actor+ref@8 / critic+reward@8"."""
    return " / ".join(f"{'+'.join(b)}@{a}" for b, a in zip(cand.placement, cand.devices))


def strategies_label(cand: Candidate) -> str:
    return "; ".join(f"{p.model} {p.strategy.label()}" for s in cand.sets for p in s.plans)


def format_top_table(result: SearchResult, top: int = 10) -> str:
    """Markdown table of the `top` fastest placements with their predicted stage times."""
    stages = [s.name for s in result.dataflow.stages]
    head = ["rank", "placement (set@devices)", *[f"{s} s" for s in stages], "step s", "strategies"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, c in enumerate(result.candidates[:top], 1):
        row = [str(i), placement_label(c), *[f"{c.stage_times[s]:.2f}" for s in stages],
               f"{c.step_time_s:.2f}", strategies_label(c)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _ranks(x: list[float]) -> list[float]:
    """1-based ranks, ties get the average of their positions."""
    order = sorted(range(len(x)), key=lambda i: x[i])
    ranks = [0.0] * len(x)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman rank correlation: Pearson correlation of the (tie-averaged) ranks."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"spearman needs two equal-length sequences of >= 2 values, got {len(x)} and {len(y)}")
    rx, ry = _ranks(list(x)), _ranks(list(y))
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    if vx == 0 or vy == 0:
        raise ValueError("spearman is undefined for a constant sequence")
    return cov / (vx * vy)


def median_relative_error(predicted: list[float], measured: list[float]) -> float:
    """median(|predicted − measured| / measured)."""
    errs = sorted(abs(p - m) / m for p, m in zip(predicted, measured))
    n = len(errs)
    if n == 0:
        raise ValueError("median_relative_error of no values")
    return errs[n // 2] if n % 2 else (errs[n // 2 - 1] + errs[n // 2]) / 2
