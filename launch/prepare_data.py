"""Write RL datasets in verl's schema (and GSM8K preference pairs for reward-model training).

    python launch/prepare_data.py gsm8k       [--input-dir DIR (default: the copy in jaxrl_hf/data/assets/gsm8k)] [--out-dir runs/data/gsm8k]
    python launch/prepare_data.py arithmetic  [--seed 0] [--n-train 20000] [--n-test 500]
                                              [--min-digits 1] [--max-digits 2] [--operators '+-*'] [--num-operands 2]
    python launch/prepare_data.py gsm8k_prefs [--seed 0] [--limit N]   (train_prefs.jsonl / test_prefs.jsonl)
    python launch/prepare_data.py arithmetic_gsm8k [--seed 0] [--n-train 2000] [--n-test 200] [--max-digits 1]
                                              (arithmetic as GSM8K rows: openai/gsm8k, its '####' instruction)

Each command writes ``train.<fmt>`` and ``test.<fmt>`` (``--format parquet|jsonl``) and prints the paths.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from jaxrl_hf.data import gsm8k as gsm8k_data  # noqa: E402
from jaxrl_hf.data.arithmetic import ArithmeticConfig, generate_arithmetic, parse_operators  # noqa: E402
from jaxrl_hf.data.io import write_rows  # noqa: E402
from jaxrl_hf.data.gsm8k import default_gsm8k_dir  # noqa: E402

DEFAULT_GSM8K_DIR = default_gsm8k_dir()


def _source_file(input_dir: str, split: str) -> str:
    path = os.path.join(input_dir, f"{split}.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"prepare_data: GSM8K {split} file not found at {path} (pass --input-dir)")
    return path


def cmd_gsm8k(args: argparse.Namespace) -> list[str]:
    out = []
    for split in ("train", "test"):
        rows = gsm8k_data.to_rows(_source_file(args.input_dir, split), split)
        out.append(write_rows(rows, os.path.join(args.out_dir, f"{split}.{args.format}")))
    return out


def cmd_arithmetic(args: argparse.Namespace) -> list[str]:
    cfg = ArithmeticConfig(
        min_digits=args.min_digits,
        max_digits=args.max_digits,
        operators=parse_operators(args.operators),
        num_operands=args.num_operands,
    )
    out = []
    for split, n in (("train", args.n_train), ("test", args.n_test)):
        rows = generate_arithmetic(n, args.seed, cfg, split=split)
        out.append(write_rows(rows, os.path.join(args.out_dir, f"{split}.{args.format}")))
    return out


def cmd_arithmetic_gsm8k(args: argparse.Namespace) -> list[str]:
    cfg = ArithmeticConfig(max_digits=args.max_digits)
    return [write_rows(gsm8k_data.arithmetic_rows(n, args.seed, split, cfg),
                       os.path.join(args.out_dir, f"{split}.{args.format}"))
            for split, n in (("train", args.n_train), ("test", args.n_test))]


def cmd_gsm8k_prefs(args: argparse.Namespace) -> list[str]:
    out = []
    os.makedirs(args.out_dir, exist_ok=True)
    for split in ("train", "test"):
        pairs = gsm8k_data.preference_pairs(_source_file(args.input_dir, split), args.seed, args.limit)
        path = os.path.join(args.out_dir, f"{split}_prefs.jsonl")
        with open(path, "w", encoding="utf-8") as fh:
            for pair in pairs:
                fh.write(json.dumps(pair, ensure_ascii=False) + "\n")
        out.append(path)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="task", required=True)

    g = sub.add_parser("gsm8k", help="GSM8K in verl's schema")
    g.add_argument("--input-dir", default=DEFAULT_GSM8K_DIR)
    g.add_argument("--out-dir", default="runs/data/gsm8k")
    g.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    g.set_defaults(fn=cmd_gsm8k)

    a = sub.add_parser("arithmetic", help="seeded synthetic arithmetic")
    a.add_argument("--out-dir", default="runs/data/arithmetic")
    a.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--n-train", type=int, default=20000)
    a.add_argument("--n-test", type=int, default=500)
    a.add_argument("--min-digits", type=int, default=1)
    a.add_argument("--max-digits", type=int, default=2)
    a.add_argument("--operators", default="+-*", help="subset of '+-*/'")
    a.add_argument("--num-operands", type=int, default=2)
    a.set_defaults(fn=cmd_arithmetic)

    m = sub.add_parser("arithmetic_gsm8k", help="arithmetic problems as GSM8K rows (openai/gsm8k scorer)")
    m.add_argument("--out-dir", default="runs/data/arithmetic_gsm8k")
    m.add_argument("--format", choices=("parquet", "jsonl"), default="parquet")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--n-train", type=int, default=2000)
    m.add_argument("--n-test", type=int, default=200)
    m.add_argument("--max-digits", type=int, default=1)
    m.set_defaults(fn=cmd_arithmetic_gsm8k)

    p = sub.add_parser("gsm8k_prefs", help="GSM8K preference pairs (correct vs corrupted solution), jsonl")
    p.add_argument("--input-dir", default=DEFAULT_GSM8K_DIR)
    p.add_argument("--out-dir", default="runs/data/gsm8k_prefs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=int, default=None, help="first N problems per split")
    p.set_defaults(fn=cmd_gsm8k_prefs)
    return parser


def main(argv: list[str] | None = None) -> list[str]:
    args = build_parser().parse_args(argv)
    try:
        paths = args.fn(args)
    except ValueError as exc:  # bad options (e.g. digits, operators) or a bad source row
        raise SystemExit(f"prepare_data {args.task}: {exc}") from None
    for path in paths:
        print(path)
    return paths


if __name__ == "__main__":
    main()
