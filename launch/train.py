"""Main entry point: ``python launch/train.py --algo dapo [key=value ...]``.

The RL trainer (workers, the per-algorithm control flow, checkpoints) is not built yet — it is tracked as
the "Workers, the RL trainer, and launch/train.py" issue. Until then this command says so and exits with
status 2 rather than pretending to train. The pieces that exist can be used directly:
``jaxrl_hf.algos`` (every estimator and loss as a pure JAX function).
"""

from __future__ import annotations

import argparse
import sys

ALGOS = ("dapo", "grpo", "ppo", "remax", "rloo", "reinforce_pp", "gspo", "safe_rlhf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", choices=ALGOS, default="dapo")
    parser.add_argument("--preset", default=None)
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. actor.clip_ratio_high=0.28")
    args = parser.parse_args(argv)
    try:
        from jaxrl_hf.trainer import run  # noqa: F401  (exists once the trainer lands)
    except ImportError:
        print(
            f"jaxrl_hf: the RL trainer for --algo {args.algo} is not built yet.\n"
            "Available now: jaxrl_hf.algos (advantage estimators, policy/value losses, KL, DAPO pieces).\n"
            "Run the test suite with `make test`.",
            file=sys.stderr,
        )
        return 2
    return run(args.algo, preset=args.preset, overrides=args.overrides)


if __name__ == "__main__":
    sys.exit(main())
