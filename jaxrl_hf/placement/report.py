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
