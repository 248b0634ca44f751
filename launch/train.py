"""Main entry point from a checkout: ``python launch/train.py --algo dapo [--preset smoke] [key.path=value ...]``,
the same as the installed console script ``jaxrl-hf-train`` (``--help``: jaxrl_hf/trainer/cli.py)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_hf.trainer.cli import main  # noqa: E402


if __name__ == "__main__":
    sys.exit(main())
