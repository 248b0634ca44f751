"""Train a process reward model (value-head decoder) with a per-step binary cross-entropy on step-labelled data.

    python launch/train_prm.py --out runs/prm                       # steps built from jaxrl_hf/data/assets/gsm8k
    python launch/train_prm.py --preset smoke --out /tmp/prm        # tiny random model, a few steps (CI)
    python launch/train_prm.py --rows steps.jsonl --model smollm2-135m-instruct --out runs/prm \\
        [--eval-rows held.jsonl] [--steps 40 --batch-size 8 --lr 2e-5 --max-length 384 --num-layers K --json OUT]

Rows are jsonl ``{"prompt", "steps": [...], "labels": [0/1 per step]}`` (`jaxrl_hf.rewards.prm_data`, where the
layout and the GSM8K construction are documented); a malformed row stops the run naming the file and row.
Without ``--rows``, rows are built from GSM8K's solutions (train rows from ``train.jsonl``, held-out rows from
``test.jsonl``): every ``<<a*b=c>>`` is checked, and some solutions get one corrupted step as negatives. The loss is
read only at each step's boundary token (`jaxrl_hf.rewards.prm_training`). The model, optimizer and output layout
are ``launch/train_rm.py``'s; the output directory loads with
``jaxrl_hf.rewards.prm_manager.load_process_reward_model`` (``reward_model.reward_manager=prm``). Each step's
``train/loss``, ``train/step_accuracy``, ``train/prob_good_steps``, ``train/prob_bad_steps``, ``train/grad_norm`` and
``train/lr`` go to ``OUT/metrics.jsonl`` and TensorBoard (``OUT/tensorboard``); ``launch/plot.py OUT`` draws them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_hf.data.gsm8k import default_gsm8k_dir  # noqa: E402
from jaxrl_hf.finetune.dotted_args import to_flags  # noqa: E402
from jaxrl_hf.rewards.prm_data import (STEP_TAG, EncodedSteps, encode_step_rows, gsm8k_step_rows,  # noqa: E402
                                       make_step_batch, read_step_rows)
from jaxrl_hf.rewards.prm_training import make_prm_train_step, prm_loss  # noqa: E402
from jaxrl_hf.rewards.rm_io import save_reward_model  # noqa: E402
from jaxrl_hf.rewards.rm_training import RMOptimConfig, init_train_state, make_optimizer, warmup_schedule  # noqa: E402
from jaxrl_hf.trainer.logging import MetricLogger  # noqa: E402


def _train_rm() -> Any:
    """``launch/train_rm.py`` as a module (its backbone loader is shared)."""
    spec = importlib.util.spec_from_file_location("_train_rm", os.path.join(REPO_ROOT, "launch", "train_rm.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


PRESETS = {"smoke": dict(model="tiny", steps=8, batch_size=4, train_limit=24, eval_limit=8, max_length=256,
                         lr=3e-4, warmup_steps=0, num_layers=None)}


def load_rows(args: argparse.Namespace) -> tuple[list, list, dict[str, Any]]:
    """``(train, held_out, description)`` from ``--rows``/``--eval-rows`` or GSM8K."""
    if args.rows is None:
        train_src, test_src = (os.path.join(args.gsm8k, f) for f in ("train.jsonl", "test.jsonl"))
        return (gsm8k_step_rows(train_src, args.seed, args.train_limit),
                gsm8k_step_rows(test_src, args.seed, args.eval_limit),
                {"rows": f"gsm8k_steps(seed={args.seed})", "train_source": train_src, "held_out_source": test_src})
    rows = read_step_rows(args.rows)[: args.train_limit]
    if args.eval_rows is None:
        if len(rows) < 2:
            raise SystemExit(f"train_prm: {args.rows} has {len(rows)} row(s); need >= 2 (or pass --eval-rows)")
        n_held = max(1, len(rows) // 10)
        return rows[n_held:], rows[:n_held], {"rows": args.rows, "held_out_source": f"first {n_held} rows"}
    return rows, read_step_rows(args.eval_rows)[: args.eval_limit], {"rows": args.rows, "held_out_source": args.eval_rows}


def evaluate(params: Any, config: Any, encoded: EncodedSteps, batch_size: int, pad: int, max_length: int) -> dict:
    """Step BCE and step accuracy over ``encoded`` (weighted by steps)."""
    loss_fn = jax.jit(lambda p, b: prm_loss(p, config, b)[1])
    total, steps = {"loss": 0.0, "step_accuracy": 0.0}, 0.0
    for start in range(0, len(encoded), batch_size):
        idx = list(range(start, min(start + batch_size, len(encoded))))
        batch = make_step_batch(encoded, idx, batch_size, pad, max_length=max_length)
        n = float(batch["step_mask"].sum())
        metrics = jax.device_get(loss_fn(params, {k: jnp.asarray(v) for k, v in batch.items()}))
        for key in total:
            total[key] += float(metrics[key]) * n
        steps += n
    return {k: v / max(steps, 1.0) for k, v in total.items()} | {"steps": int(steps), "rows": len(encoded)}


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the job; returns the metadata written to the output's ``reward_model.json``."""
    t_start = time.perf_counter()
    train_rows, held_rows, data_desc = load_rows(args)
    backbone = _train_rm().load_backbone(args)
    config, tokenizer = backbone.config, backbone.tokenizer
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    encoded = {}
    for what, rows in (("train", train_rows), ("held_out", held_rows)):
        encoded[what] = encode_step_rows(rows, tokenizer, args.max_length, STEP_TAG)
        print(f"[train_prm] {what}: {len(rows)} rows, kept {len(encoded[what])}, dropped "
              f"{encoded[what].dropped_too_long} longer than --max-length {args.max_length}", flush=True)
        if not len(encoded[what]):
            raise SystemExit(f"train_prm: every {what} row is longer than --max-length {args.max_length} tokens")
    ev = lambda p: evaluate(p, config, encoded["held_out"], args.batch_size, pad, args.max_length)  # noqa: E731
    before = ev(backbone.params)
    optim_cfg = RMOptimConfig(lr=args.lr, head_lr_multiplier=args.head_lr_multiplier,
                              warmup_steps=min(args.warmup_steps, max(args.steps - 1, 0)))
    optimizer = make_optimizer(optim_cfg, backbone.params)
    state = init_train_state(backbone.params, optimizer)
    step_fn = make_prm_train_step(config, optimizer)
    lr_at = warmup_schedule(optim_cfg.lr, optim_cfg.warmup_steps)  # the backbone's; the head's is x multiplier
    logger = MetricLogger(args.out, ["jsonl", "tensorboard"])
    rng = np.random.default_rng(args.seed)
    order: list[int] = []
    history = []
    for step in range(args.steps):
        if len(order) < args.batch_size:
            order += rng.permutation(len(encoded["train"])).tolist()
        idx, order = order[: args.batch_size], order[args.batch_size:]
        batch = make_step_batch(encoded["train"], idx, args.batch_size, pad, max_length=args.max_length)
        state, metrics = step_fn(state, {k: jnp.asarray(v) for k, v in batch.items()})
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()} | {"step": step + 1}
        history.append(metrics)
        logger.log(step + 1, {f"train/{k}": v for k, v in metrics.items() if k != "step"}
                   | {"train/lr": float(lr_at(step))})
        print(f"[train_prm] step {step + 1:4d}/{args.steps} loss {metrics['loss']:.4f} "
              f"step-acc {metrics['step_accuracy']:.3f} p(good) {metrics['prob_good_steps']:.3f} "
              f"p(bad) {metrics['prob_bad_steps']:.3f}", flush=True)
    logger.close()
    after = ev(state.params)
    print(f"[train_prm] held-out step BCE {before['loss']:.4f} -> {after['loss']:.4f}, step accuracy "
          f"{before['step_accuracy']:.3f} -> {after['step_accuracy']:.3f}", flush=True)
    metadata = {"kind": "process_reward_model", "step_tag": STEP_TAG, "base_model": backbone.name,
                "sequence_layout_prm": "chat_template(prompt) + tok(step_k + step_tag)...; score at each step's "
                                       "last token", "data": data_desc, "steps": args.steps,
                "batch_size": args.batch_size, "seed": args.seed, "optimizer": {"name": "adamw", **vars(optim_cfg)},
                "before": before, "after": after, "history": history,
                "total_seconds": time.perf_counter() - t_start,
                "command": "python launch/train_prm.py " + " ".join(args.argv)}
    save_reward_model(args.out, state.params, config.replace(dtype="float32"), backbone.tokenizer_dir, eos, pad,
                      metadata)
    print(f"[train_prm] wrote {args.out}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(metadata, fh, indent=2)
    return metadata


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="defaults for a quick run (smoke: tiny)")
    p.add_argument("--rows", default=None, help="step-labelled jsonl (default: build from GSM8K)")
    p.add_argument("--eval-rows", default=None, help="held-out rows (default: the first 10%% of --rows)")
    p.add_argument("--gsm8k", default=default_gsm8k_dir(), help="GSM8K dir with train.jsonl/test.jsonl")
    p.add_argument("--train-limit", type=int, default=2000, help="at most this many source solutions/rows")
    p.add_argument("--eval-limit", type=int, default=128)
    p.add_argument("--model", default="smollm2-135m-instruct", help="'tiny', a known name, an HF dir or a .gguf")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first K decoder layers")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8, help="rows per step")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--head-lr-multiplier", type=float, default=10.0)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--head-init-std", type=float, default=0.02)
    p.add_argument("--max-length", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"), default="full")
    p.add_argument("--json", default=None, help="also write the run's metadata here")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    argv = to_flags(parser, given, "train_prm")
    preset = parser.parse_known_args(argv)[0].preset
    if preset:
        parser.set_defaults(**PRESETS[preset])
    args = parser.parse_args(argv)
    args.argv = given
    for name in ("steps", "batch_size", "max_length"):
        if getattr(args, name) < 1:
            raise SystemExit(f"train_prm: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        return train(args)
    except (ValueError, FileNotFoundError) as exc:  # bad rows, missing files, bad options
        raise SystemExit(f"train_prm: {exc}") from None


if __name__ == "__main__":
    main()
