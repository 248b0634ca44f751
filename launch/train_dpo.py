"""Direct preference optimisation (DPO, sigmoid loss) or IPO of a causal LM on preference pairs.

    python launch/train_dpo.py --out runs/dpo                        # GSM8K pairs built from jaxrl_hf/data/assets
    python launch/train_dpo.py --preset smoke --out /tmp/dpo         # tiny random model, a few steps (CI, < 30 s)
    python launch/prepare_data.py gsm8k_prefs && python launch/train_dpo.py \\
        --pairs runs/data/gsm8k_prefs/train_prefs.jsonl --model runs/sft/hf --out runs/dpo \\
        [--loss dpo|ipo --beta 0.1 --steps 100 --batch-size 8 --max-length 512 --lr 5e-7 --group-by-length \\
         --lora-rank 8 --target-modules all-linear --resume]

Pairs are jsonl rows ``{"prompt", "chosen", "rejected"}`` (`jaxrl_hf.rewards.rm_data`, the rows ``train_rm.py``
reads; a malformed row stops the run naming the file and row). Each sequence is ``chat_template(prompt) +
response + eos`` and only the response tokens are scored (`jaxrl_hf.finetune.dpo_data`). A batch is padded to its
longest sequence (rounded up to 64 tokens); ``--group-by-length`` batches pairs of similar length, which cut the
padded share of the token slots (``train/padding_ratio``) from 0.38 to 0.17 over an epoch of the 7473 GSM8K pairs at
batch size 8 (SmolLM2 tokenizer).

The reference model is the frozen initial model (``--model`` as loaded, before any update; with LoRA, the base):
its response log-probs are computed once, before the first update, for every pair the run's steps will visit,
and kept on the host, so no second model is held during training. On ``--resume`` they are computed again from
``--model`` (which must be the same model as the first run's). The loss is
``-log σ(β h)`` (``--loss dpo``) or ``(h - 1/(2β))²`` (``--loss ipo``, on per-token mean log-probs, as TRL),
``h = (π_c - r_c) - (π_r - r_r)`` (`jaxrl_hf.algos.preference`). ``OUT/metrics.jsonl`` holds TRL's
``train/loss``, ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected`` plus ``train/lr``, ``train/grad_norm`` and throughput; ``OUT/checkpoint``
(atomic; ``--resume`` continues it) and ``OUT/hf`` (HF safetensors + tokenizer, usable as ``model.path``; with
LoRA also ``OUT/hf/lora_adapter`` in PEFT's format) as ``launch/train_sft.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_hf.algos.preference import PREFERENCE_LOSSES  # noqa: E402
from jaxrl_hf.data import gsm8k as gsm8k_data  # noqa: E402
from jaxrl_hf.errors import ExitCode  # noqa: E402
from jaxrl_hf.finetune.cli_args import add_training_args, parse_training_args  # noqa: E402
from jaxrl_hf.finetune import loop, policy as pol  # noqa: E402
from jaxrl_hf.finetune.dpo_data import preference_batch  # noqa: E402
from jaxrl_hf.finetune.steps import dpo_loss, make_reference_fn, make_train_step  # noqa: E402
from jaxrl_hf.rewards.rm_data import (EncodedPairs, PreferencePairError, encode_pairs, pairs_from_rows,  # noqa: E402
                                      read_pairs)
from jaxrl_hf.trainer.logging import MetricLogger  # noqa: E402

PRESETS = {"smoke": dict(model="tiny", steps=6, batch_size=4, train_limit=8, max_length=384, lr=1e-3,
                         warmup_steps=0, lr_scheduler="constant", save_every=3)}


def load_pairs(args: argparse.Namespace) -> tuple[list, str]:
    """``(pairs, description)`` from ``--pairs`` or built from GSM8K's train split."""
    if args.pairs is None:
        src = os.path.join(args.gsm8k, "train.jsonl")
        rows = gsm8k_data.preference_pairs(src, args.seed, args.train_limit)
        return pairs_from_rows(rows, src), f"gsm8k_prefs(seed={args.seed}) from {src}"
    return read_pairs(args.pairs)[: args.train_limit], args.pairs


def reference_log_probs(params: Any, config: Any, encoded: EncodedPairs, pairs: list[int], batch_size: int,
                        pad_id: int, max_length: int, average: bool) -> np.ndarray:
    """``[N, 2]`` float32: the frozen model's response log-probs of the (chosen, rejected) sequences of ``pairs``
    (NaN for pairs the run never visits)."""
    fn = make_reference_fn(config, average)
    out = np.full((len(encoded), 2), np.nan, np.float32)
    for start in range(0, len(pairs), batch_size):
        idx = pairs[start:start + batch_size]
        batch = preference_batch(encoded, idx, batch_size, pad_id, max_length)
        logps = np.asarray(fn(params, {k: jnp.asarray(v) for k, v in batch.items() if k != "pair_mask"}))
        out[idx, 0] = logps[: len(idx)]
        out[idx, 1] = logps[batch_size: batch_size + len(idx)]
    return out


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole job; returns the run summary (also written to ``OUT/dpo.json``)."""
    t_start = time.perf_counter()
    pairs, data_desc = load_pairs(args)
    policy = pol.load_policy(args.model, args.seed, args.dtype, args.remat, args.num_layers)
    config, pad = policy.config, policy.pad_id
    encoded = encode_pairs(pairs, policy.tokenizer, policy.eos_id, args.max_length)
    if not len(encoded):
        raise PreferencePairError(f"every one of the {len(pairs)} pairs of {data_desc} is longer than "
                                  f"--max-length {args.max_length} tokens")
    print(f"[train_dpo] {data_desc}: {len(pairs)} pairs, kept {len(encoded)}, dropped {encoded.dropped_too_long} "
          f"longer than --max-length {args.max_length}; model {policy.name} ({config.num_hidden_layers} layers)",
          flush=True)
    lora_cfg = pol.lora_config(args.lora_rank, args.lora_alpha, args.target_modules)
    trainable, frozen = pol.split_trainable(policy.params, lora_cfg, args.seed)
    schedule = pol.lr_schedule(args.lr, args.warmup_steps, args.steps, args.lr_scheduler)
    optimizer = pol.make_optimizer(schedule, args.weight_decay, args.max_grad_norm)
    lengths = tuple(max(len(c), len(r)) for c, r in zip(encoded.chosen, encoded.rejected)) \
        if args.group_by_length else None
    spec = loop.LoopSpec("dpo", args.out, args.steps, args.batch_size, len(encoded), args.seed, args.save_every,
                         args.log_every, args.resume, lengths)
    state, first = loop.start_state(spec, pol.init_state(trainable, optimizer))
    visited = sorted({i for s in range(first, args.steps)
                      for i in pol.batch_indices(s, args.batch_size, len(encoded), args.seed, lengths)})
    t_ref = time.perf_counter()
    ref = reference_log_probs(policy.params, config, encoded, visited, args.batch_size, pad, args.max_length,
                              average=args.loss == "ipo")
    print(f"[train_dpo] reference log-probs of the {len(visited)} pairs steps {first + 1}..{args.steps} visit, from "
          f"the frozen initial model ({time.perf_counter() - t_ref:.1f}s)", flush=True)
    loss_type, beta = args.loss, args.beta
    step_fn = make_train_step(lambda params, batch: dpo_loss(params, config, batch, loss_type, beta), optimizer,
                              lora_cfg)

    def make_batch(idx: list[int]) -> dict[str, np.ndarray]:
        batch = preference_batch(encoded, idx, args.batch_size, pad, args.max_length)
        return {**batch, "ref_logps": np.concatenate([ref[idx, 0], ref[idx, 1]])}

    logger = MetricLogger(args.out, ["jsonl", "tensorboard"], resume_step=first)
    meta = {"model": policy.name, "data": data_desc, "loss": loss_type, "beta": beta, "max_length": args.max_length,
            "lora_rank": args.lora_rank, "group_by_length": args.group_by_length}
    t_train = time.perf_counter()
    state, history = loop.run_steps(spec, state, frozen, step_fn, make_batch,
                                    lambda b: int(b["attention_mask"].sum()), lambda s: float(schedule(s)),
                                    logger.log, meta)
    train_seconds = time.perf_counter() - t_train
    logger.close()
    export = pol.export_policy(args.out, state, frozen, lora_cfg, policy)
    print(f"[train_dpo] wrote {export} (use it as model.path={export})", flush=True)
    summary = {**meta, "pairs": len(pairs), "kept": len(encoded), "dropped_too_long": encoded.dropped_too_long,
               "resumed_from_step": first, "steps": args.steps, "batch_size": args.batch_size, "history": history,
               "export": export, "train_seconds": train_seconds, "total_seconds": time.perf_counter() - t_start,
               "command": "python launch/train_dpo.py " + " ".join(args.argv)}
    with open(os.path.join(args.out, "dpo.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="defaults for a quick run (smoke: tiny)")
    p.add_argument("--pairs", default=None, help="preference pairs jsonl (default: build from GSM8K train)")
    p.add_argument("--gsm8k", default=gsm8k_data.default_gsm8k_dir(), help="GSM8K dir with train.jsonl")
    p.add_argument("--train-limit", type=int, default=None, help="use only the first N pairs")
    p.add_argument("--loss", choices=PREFERENCE_LOSSES, default="dpo", help="dpo (sigmoid) or ipo")
    p.add_argument("--beta", type=float, default=0.1, help="KL strength β (IPO: τ)")
    p.add_argument("--group-by-length", action="store_true",
                   help="batch pairs of similar length (less padding; HF Trainer's group_by_length)")
    add_training_args(p, steps=100, batch_help="pairs per step", max_length=512,
                      length_help="longest prompt + response kept (tokens)", lr=5e-7, weight_decay=0.0)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_training_args(build_parser(), sys.argv[1:] if argv is None else argv, PRESETS, "train_dpo")
    if not args.beta > 0:
        raise SystemExit(f"train_dpo: --beta must be > 0, got {args.beta}")
    try:
        return train(args)
    except PreferencePairError as exc:
        print(f"train_dpo: {exc}", file=sys.stderr)
        raise SystemExit(int(ExitCode.DATA)) from None
    except (ValueError, FileNotFoundError) as exc:  # bad options, missing files, a checkpoint that does not fit
        raise SystemExit(f"train_dpo: {exc}") from None


if __name__ == "__main__":
    main()
