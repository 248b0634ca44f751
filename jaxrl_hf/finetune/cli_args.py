"""The command-line options ``launch/train_sft.py`` and ``launch/train_dpo.py`` share (model, optimizer, schedule,
LoRA, checkpoints), each default given by the caller, and the parse that applies a ``--preset`` first and takes
verl's dotted keys (`jaxrl_hf.finetune.dotted_args`)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_hf.finetune.dotted_args import to_flags


def add_training_args(p: argparse.ArgumentParser, *, steps: int, batch_help: str, max_length: int, length_help: str,
                      lr: float, weight_decay: float) -> None:
    """Model, output, optimizer, schedule, LoRA, dtype and checkpoint options."""
    p.add_argument("--model", default="smollm2-135m-instruct", help="'tiny', a known name, an HF dir or a .gguf")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first K decoder layers")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=8, help=batch_help)
    p.add_argument("--max-length", type=int, default=max_length, help=length_help)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--lr-scheduler", choices=("cosine", "constant"), default="cosine")
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=weight_decay)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--lora-rank", type=int, default=0, help="> 0: train LoRA adapters only, base frozen")
    p.add_argument("--lora-alpha", type=float, default=16.0)
    p.add_argument("--target-modules", default=None,
                   help="LoRA targets: 'all-linear' (default) or HF module names, e.g. q_proj,v_proj (verl's key)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"), default="full")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and after the last)")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")


def parse_training_args(parser: argparse.ArgumentParser, argv: Sequence[str], presets: Mapping[str, Mapping[str, Any]],
                        prog: str) -> argparse.Namespace:
    """Parse ``argv`` with ``--preset``'s defaults applied first; the counts must be >= 1 (``SystemExit`` naming the
    option otherwise). verl's dotted ``key=value`` words are read as the options they name (`to_flags`).
    ``args.argv`` keeps the command line as given."""
    given, argv = list(argv), to_flags(parser, argv, prog)
    preset = parser.parse_known_args(list(argv))[0].preset
    if preset:
        parser.set_defaults(**presets[preset])
    args = parser.parse_args(list(argv))
    args.argv = given
    for name in ("steps", "batch_size", "max_length", "save_every", "log_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"{prog}: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args
