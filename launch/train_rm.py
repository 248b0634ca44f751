"""Train a reward model (value-head decoder) with the Bradley-Terry loss on preference pairs.

    python launch/train_rm.py --out runs/rm                       # GSM8K pairs built from jaxrl_hf/data/assets/gsm8k
    python launch/train_rm.py --pairs prefs.jsonl --model smollm2-135m-instruct --out runs/rm \\
        [--eval-pairs held_out.jsonl | --eval-fraction 0.1] [--steps 40 --batch-size 8 --lr 2e-5 \\
        --max-length 384 --seed 0 --num-layers K --dtype float32|bfloat16 --json OUT.json]

Pairs are jsonl rows with ``prompt`` (chat messages or a string), ``chosen`` and ``rejected``; a
malformed row stops the run with the file and row named. Without ``--pairs``, pairs are built from
GSM8K (``jaxrl_hf.data.gsm8k.preference_pairs``: the reference solution vs the same solution driven to
a nearby wrong answer), train pairs from ``train.jsonl`` and held-out pairs from ``test.jsonl``.

``--model`` is ``smollm2-135m-instruct`` (default), any name/path ``load_pretrained`` accepts, or
``tiny`` (a 2-layer random decoder with SmolLM2's tokenizer, for smoke tests). ``--num-layers K`` keeps
only the first K decoder layers of the backbone (faster on CPU). The value head starts as
normal(0, ``--head-init-std``). Held-out (and train-subset) pairwise accuracy is measured before and
after training; the output directory is loadable with ``jaxrl_hf.rewards.rm_io.load_reward_model``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_hf.data import gsm8k as gsm8k_data  # noqa: E402
from jaxrl_hf.finetune.dotted_args import to_flags  # noqa: E402
from jaxrl_hf.models import DecoderConfig, Tokenizer, init_value_params, load_pretrained, value_params_from_lm  # noqa: E402
from jaxrl_hf.models.pretrained import resolve_hf_dir  # noqa: E402
from jaxrl_hf.rewards.rm_data import (EncodedPairs, PreferencePair, encode_pairs, make_batch, pairs_from_rows,  # noqa: E402
                                      read_pairs)
from jaxrl_hf.rewards.rm_io import save_reward_model  # noqa: E402
from jaxrl_hf.rewards.rm_training import (RMOptimConfig, init_train_state, make_optimizer, make_score_fn,  # noqa: E402
                                          make_train_step)
from jaxrl_hf.data.gsm8k import default_gsm8k_dir  # noqa: E402

DEFAULT_GSM8K_DIR = default_gsm8k_dir()
TOKENIZER_MODEL = "smollm2-135m-instruct"


@dataclass
class Backbone:
    """Value-model params, config, tokenizer and where the tokenizer files live."""

    name: str
    config: DecoderConfig
    params: Any
    tokenizer: Tokenizer
    tokenizer_dir: str


def tiny_config(vocab_size: int, eos_id: int, pad_id: int, dtype: str) -> DecoderConfig:
    """A 2-layer random decoder over a real tokenizer's vocabulary (smoke tests, CI)."""
    return DecoderConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         max_position_embeddings=2048, tie_word_embeddings=True, eos_token_ids=(eos_id,),
                         pad_token_id=pad_id, dtype=dtype)


def truncate_layers(params: Any, config: DecoderConfig, num_layers: int) -> tuple[Any, DecoderConfig]:
    """Keep the first ``num_layers`` decoder layers (layers are stacked on axis 0 of every layer tensor)."""
    if not 1 <= num_layers <= config.num_hidden_layers:
        raise SystemExit(f"train_rm: --num-layers {num_layers} must be in 1..{config.num_hidden_layers}")
    model = dict(params["model"])
    model["layers"] = jax.tree.map(lambda x: x[:num_layers], model["layers"])
    return {**params, "model": model}, config.replace(num_hidden_layers=num_layers)


def load_backbone(args: argparse.Namespace) -> Backbone:
    """The value model to train: pretrained backbone (optionally truncated) + a fresh random head."""
    head_rng = jax.random.key(args.seed + 1)
    if args.model == "tiny":
        tok_dir = resolve_hf_dir(TOKENIZER_MODEL)
        tokenizer = Tokenizer.from_dir(tok_dir)
        eos = tokenizer.eos_token_id
        config = tiny_config(tokenizer.vocab_size, eos, tokenizer.pad_token_id, args.dtype)
        params = init_value_params(config, args.seed)
        params["score"] = {"kernel": args.head_init_std * jax.random.normal(head_rng, (config.hidden_size, 1))}
        return Backbone("tiny", config, params, tokenizer, tok_dir)
    lm = load_pretrained(args.model, dtype=args.dtype, remat=args.remat)
    config = lm.config
    params = value_params_from_lm(lm.params, config, head_rng, head_std=args.head_init_std)
    if args.num_layers is not None:
        params, config = truncate_layers(params, config, args.num_layers)
    return Backbone(args.model, config, params, lm.tokenizer, lm.path)


def load_pair_sets(args: argparse.Namespace) -> tuple[list[PreferencePair], list[PreferencePair], dict[str, Any]]:
    """``(train, held_out, description)`` from ``--pairs``/``--eval-pairs`` or built from GSM8K."""
    if args.pairs is None:
        train_src = os.path.join(args.gsm8k, "train.jsonl")
        test_src = os.path.join(args.gsm8k, "test.jsonl")
        train = pairs_from_rows(gsm8k_data.preference_pairs(train_src, args.seed, args.train_limit), train_src)
        held = pairs_from_rows(gsm8k_data.preference_pairs(test_src, args.seed, args.eval_limit), test_src)
        return train, held, {"pairs": f"gsm8k_prefs(seed={args.seed})", "train_source": train_src,
                             "held_out_source": test_src}
    pairs = read_pairs(args.pairs)
    if args.train_limit is not None:
        pairs = pairs[: args.train_limit]
    if args.eval_pairs is not None:
        held = read_pairs(args.eval_pairs)[: args.eval_limit]
        return pairs, held, {"pairs": args.pairs, "held_out_source": args.eval_pairs}
    if len(pairs) < 2:
        raise SystemExit(f"train_rm: {args.pairs} has {len(pairs)} pair(s); need >= 2 to hold some out "
                         f"(or pass --eval-pairs)")
    order = list(range(len(pairs)))
    random.Random(args.seed).shuffle(order)
    n_held = min(len(pairs) - 1, max(1, round(args.eval_fraction * len(pairs))))
    if args.eval_limit is not None:
        n_held = min(n_held, args.eval_limit)
    held_idx = set(order[:n_held])
    held = [p for i, p in enumerate(pairs) if i in held_idx]
    train = [p for i, p in enumerate(pairs) if i not in held_idx]
    return train, held, {"pairs": args.pairs, "held_out_source": f"{args.pairs} ({n_held} rows held out, seed {args.seed})"}


def evaluate(score_fn: Any, params: Any, encoded: EncodedPairs, batch_size: int, pad_id: int,
             max_length: int) -> dict[str, float]:
    """Pairwise accuracy (``r_chosen > r_rejected``), BT loss (float64) and mean margin over ``encoded``."""
    chosen, rejected = [], []
    for start in range(0, len(encoded), batch_size):
        idx = list(range(start, min(start + batch_size, len(encoded))))
        batch = make_batch(encoded, idx, batch_size, pad_id, max_length=max_length)
        ids = np.concatenate([batch["chosen_ids"], batch["rejected_ids"]])
        mask = np.concatenate([batch["chosen_mask"], batch["rejected_mask"]])
        scores = np.asarray(score_fn(params, jnp.asarray(ids), jnp.asarray(mask)), np.float64)
        chosen.append(scores[: len(idx)])
        rejected.append(scores[batch_size : batch_size + len(idx)])
    c, r = np.concatenate(chosen), np.concatenate(rejected)
    return {"accuracy": float(np.mean(c > r)), "bt_loss": float(np.mean(np.logaddexp(0.0, r - c))),
            "margin": float(np.mean(c - r)), "pairs": int(len(c))}


def _encode(pairs: list[PreferencePair], backbone: Backbone, eos: int, max_length: int, what: str) -> EncodedPairs:
    encoded = encode_pairs(pairs, backbone.tokenizer, eos, max_length)
    print(f"[train_rm] {what}: {len(pairs)} pairs, kept {len(encoded)}, dropped {encoded.dropped_too_long} "
          f"longer than --max-length {max_length}", flush=True)
    if not len(encoded):
        raise SystemExit(f"train_rm: every {what} pair is longer than --max-length {max_length} tokens")
    return encoded


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole job; returns the metadata written to ``reward_model.json``."""
    t_start = time.perf_counter()
    train_pairs, held_pairs, data_desc = load_pair_sets(args)
    backbone = load_backbone(args)
    config, tokenizer = backbone.config, backbone.tokenizer
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if eos is None:
        raise SystemExit(f"train_rm: tokenizer at {backbone.tokenizer_dir} defines no eos_token")
    print(f"[train_rm] model {backbone.name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"{sum(x.size for x in jax.tree.leaves(backbone.params)) / 1e6:.1f}M params, compute {config.dtype}",
          flush=True)
    train_enc = _encode(train_pairs, backbone, eos, args.max_length, "train")
    held_enc = _encode(held_pairs, backbone, eos, args.max_length, "held-out")
    train_eval_idx = list(range(min(len(train_enc), args.train_eval_size)))
    train_eval_enc = train_enc.subset(train_eval_idx)

    score_fn = make_score_fn(config)
    ev = lambda params, enc: evaluate(score_fn, params, enc, args.eval_batch_size, pad, args.max_length)  # noqa: E731
    t0 = time.perf_counter()
    before = {"held_out": ev(backbone.params, held_enc), "train_subset": ev(backbone.params, train_eval_enc)}
    eval_seconds = time.perf_counter() - t0
    print(f"[train_rm] before training: held-out acc {before['held_out']['accuracy']:.3f} "
          f"loss {before['held_out']['bt_loss']:.4f} | train-subset acc {before['train_subset']['accuracy']:.3f} "
          f"({eval_seconds:.1f}s)", flush=True)

    optim_cfg = RMOptimConfig(lr=args.lr, head_lr_multiplier=args.head_lr_multiplier, weight_decay=args.weight_decay,
                              warmup_steps=min(args.warmup_steps, max(args.steps - 1, 0)))
    optimizer = make_optimizer(optim_cfg, backbone.params)
    state = init_train_state(backbone.params, optimizer)
    step_fn = make_train_step(config, optimizer)
    rng = np.random.default_rng(args.seed)
    order: list[int] = []
    history = []
    t_train = time.perf_counter()
    for step in range(args.steps):
        if len(order) < args.batch_size:
            order += rng.permutation(len(train_enc)).tolist()
        idx, order = order[: args.batch_size], order[args.batch_size :]
        batch = make_batch(train_enc, idx, args.batch_size, pad, max_length=args.max_length)
        t_step = time.perf_counter()
        state, metrics = step_fn(state, {k: jnp.asarray(v) for k, v in batch.items()})
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        metrics.update(step=step + 1, seconds=time.perf_counter() - t_step, length=int(batch["chosen_ids"].shape[1]))
        history.append(metrics)
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            print(f"[train_rm] step {step + 1:4d}/{args.steps} loss {metrics['loss']:.4f} acc {metrics['accuracy']:.3f} "
                  f"margin {metrics['margin']:+.3f} |g| {metrics['grad_norm']:.3f} T={metrics['length']} "
                  f"{metrics['seconds']:.1f}s", flush=True)
    train_seconds = time.perf_counter() - t_train
    params = state.params
    after = {"held_out": ev(params, held_enc), "train_subset": ev(params, train_eval_enc)}
    print(f"[train_rm] after {args.steps} steps: held-out acc {after['held_out']['accuracy']:.3f} "
          f"loss {after['held_out']['bt_loss']:.4f} | train-subset acc {after['train_subset']['accuracy']:.3f}",
          flush=True)

    metadata = {
        "base_model": backbone.name,
        "num_hidden_layers": config.num_hidden_layers,
        "data": data_desc,
        "train_pairs": len(train_enc), "held_out_pairs": len(held_enc),
        "dropped_too_long": {"train": train_enc.dropped_too_long, "held_out": held_enc.dropped_too_long},
        "max_length": args.max_length, "steps": args.steps, "batch_size": args.batch_size, "seed": args.seed,
        "optimizer": {"name": "adamw", **vars(optim_cfg)}, "head_init_std": args.head_init_std,
        "compute_dtype": config.dtype,
        "before": before, "after": after,
        "final_train_accuracy": after["train_subset"]["accuracy"],
        "final_held_out_accuracy": after["held_out"]["accuracy"],
        "train_seconds": train_seconds, "total_seconds": time.perf_counter() - t_start,
        "history": history,
        "command": "python launch/train_rm.py " + " ".join(args.argv),
    }
    save_reward_model(args.out, params, config.replace(dtype="float32"), backbone.tokenizer_dir, eos, pad, metadata)
    print(f"[train_rm] wrote {args.out}", flush=True)
    print(summary_table(metadata), flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(metadata, fh, indent=2)
        print(f"[train_rm] wrote {args.json}", flush=True)
    return metadata


def summary_table(metadata: dict[str, Any]) -> str:
    """Markdown table: pairwise accuracy, BT loss and margin before vs after training."""
    lines = ["| set | pairs | accuracy before | accuracy after | BT loss before | BT loss after | margin after |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in ("held_out", "train_subset"):
        b, a = metadata["before"][name], metadata["after"][name]
        lines.append(f"| {name} | {a['pairs']} | {b['accuracy']:.3f} | {a['accuracy']:.3f} | {b['bt_loss']:.4f} | "
                     f"{a['bt_loss']:.4f} | {a['margin']:+.3f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", default=None, help="preference pairs jsonl (default: build from GSM8K)")
    p.add_argument("--eval-pairs", default=None, help="held-out pairs jsonl (default: hold out --eval-fraction)")
    p.add_argument("--eval-fraction", type=float, default=0.1)
    p.add_argument("--gsm8k", default=DEFAULT_GSM8K_DIR, help="GSM8K dir with train.jsonl/test.jsonl")
    p.add_argument("--train-limit", type=int, default=2000, help="at most this many training pairs")
    p.add_argument("--eval-limit", type=int, default=128, help="at most this many held-out pairs")
    p.add_argument("--train-eval-size", type=int, default=64, help="train pairs scored for the train accuracy")
    p.add_argument("--model", default="smollm2-135m-instruct", help="'tiny', a known name, an HF dir or a .gguf")
    p.add_argument("--num-layers", type=int, default=None, help="keep only the first K decoder layers")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8, help="pairs per step")
    p.add_argument("--eval-batch-size", type=int, default=16, help="pairs per scoring call")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--head-lr-multiplier", type=float, default=10.0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--head-init-std", type=float, default=0.02)
    p.add_argument("--max-length", type=int, default=384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype")
    p.add_argument("--remat", choices=("none", "full", "dots", "dots_no_batch"), default="full")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--json", default=None, help="also write the run's metadata (incl. per-step history) here")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(to_flags(parser, given, "train_rm"))
    args.argv = given
    for name in ("steps", "batch_size", "eval_batch_size", "max_length", "log_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"train_rm: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0.0 < args.eval_fraction < 1.0:
        raise SystemExit(f"train_rm: --eval-fraction must be in (0, 1), got {args.eval_fraction}")
    try:
        return train(args)
    except (ValueError, FileNotFoundError) as exc:  # bad pair rows, missing files, bad options
        raise SystemExit(f"train_rm: {exc}") from None


if __name__ == "__main__":
    main()
