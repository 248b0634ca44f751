"""Stop a run whose updates keep being skipped for non-finite numbers, naming the step, role and quantity.

Each optimizer update whose loss or gradient norm is not finite is skipped in the jitted step (parameters and
optimizer state unchanged) and counted in ``<role>/skipped`` (the step's fraction of skipped updates). A step in
which every update of a role was skipped is a non-finite step; ``trainer.max_nonfinite_steps`` of them in a row
stop the run (``NonFiniteError``, exit code 7) instead of going on forever without learning.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from jaxrl_hf.errors import NonFiniteError

ROLES = ("actor", "critic")
QUANTITIES = (("loss", ("_loss",)), ("grad norm", ("/grad_norm",)), ("advantages", ("advantages/",)),
              ("returns", ("returns/",)), ("rewards", ("score/", "rewards/", "reward/")),
              ("log-probs", ("ppo_kl", "entropy", "kl_loss", "rollout_corr/")), ("values", ("values/", "vf_")))
"""Which quantity a metric measures, by a piece of its name."""


def non_finite_quantities(metrics: Mapping[str, Any]) -> dict[str, list[str]]:
    """``{quantity: [metric names]}`` of the step's non-finite metrics (stored as numbers or as "nan"/"inf")."""
    out: dict[str, list[str]] = {}
    for name, value in sorted(metrics.items()):
        try:
            finite = math.isfinite(float(value))
        except (TypeError, ValueError):
            continue
        if finite or name.startswith(("timing", "perf/")):
            continue
        quantity = next((q for q, pieces in QUANTITIES if any(p in name for p in pieces)), "other")
        out.setdefault(quantity, []).append(name)
    return out


class NonFiniteGuard:
    """Counts consecutive steps in which a role skipped every update; raises after ``max_steps`` of them."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = int(max_steps)
        self.streak: dict[str, int] = {role: 0 for role in ROLES}

    def check(self, step: int, metrics: Mapping[str, Any]) -> None:
        for role in ROLES:
            skipped = metrics.get(f"{role}/skipped")
            self.streak[role] = self.streak[role] + 1 if skipped is not None and float(skipped) >= 1.0 else 0
            if self.max_steps > 0 and self.streak[role] >= self.max_steps:
                bad = non_finite_quantities(metrics)
                what = "; ".join(f"{q}: {', '.join(names)}" for q, names in bad.items()) or "no logged metric"
                raise NonFiniteError(
                    f"step {step}: the {role} skipped every update for {self.streak[role]} steps in a row "
                    f"(trainer.max_nonfinite_steps={self.max_steps}) because its loss or gradient norm was not "
                    f"finite; non-finite at step {step}: {what}. Lower the learning rate, check the rewards, or "
                    f"resume from an earlier checkpoint")
