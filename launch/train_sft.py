"""Supervised fine-tuning (SFT) of a causal LM on chat data, loss on the assistant tokens only.

    python launch/train_sft.py --out runs/sft                        # GSM8K train: question -> reference solution
    python launch/train_sft.py --preset smoke --out /tmp/sft         # tiny random model, a few steps (CI, < 30 s)
    python launch/train_sft.py --data chats.jsonl|.parquet --model smollm2-135m-instruct --out runs/sft \\
        [--messages-key messages --prompt-key prompt --response-key response] [--steps 200 --batch-size 8 \\
        --max-length 1024 --lr 1e-5 --lr-scheduler cosine --warmup-steps 10 --lora-rank 8 --target-modules all-linear \\
        --resume]

Rows hold chat ``messages`` (every assistant turn is learned, nothing else) or ``prompt`` + ``response``
(`jaxrl_hf.finetune.sft_data`; the keys are verl's ``data.messages_key`` / ``prompt_key`` / ``response_key``);
a malformed row stops the run naming the file and row. Conversations are rendered with the tokenizer's chat
template and packed first-fit decreasing into ``--max-length`` buffers with segment ids; the only padding computed
is each buffer's unused tail (``train/padding_ratio``: 0.026 on GSM8K at the default length 1024 and batch 8). The
loss is the token-mean NLL over the batch's assistant tokens. Writes ``OUT/metrics.jsonl`` (``train/loss``,
``train/lr``, ``train/grad_norm``, ``train/padding_ratio``, ``perf/tokens_per_s`` ...), ``OUT/checkpoint`` (atomic;
``--resume`` continues it) and the final model as ``OUT/hf`` (HF safetensors + tokenizer: usable as the RL actor's
``model.path=OUT/hf``); with ``--lora-rank`` the adapters alone also go to ``OUT/hf/lora_adapter`` in PEFT's format.
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


from jaxrl_hf.data.gsm8k import default_gsm8k_dir  # noqa: E402
from jaxrl_hf.errors import ExitCode  # noqa: E402
from jaxrl_hf.finetune.cli_args import add_training_args, parse_training_args  # noqa: E402
from jaxrl_hf.finetune import loop, policy as pol  # noqa: E402
from jaxrl_hf.finetune.sft_data import (RowKeys, SFTRowError, encode_conversations, gsm8k_conversations,  # noqa: E402
                                        pack_buffers, read_sft_rows)
from jaxrl_hf.finetune.steps import make_train_step, sft_loss  # noqa: E402
from jaxrl_hf.trainer.logging import MetricLogger  # noqa: E402

PRESETS = {"smoke": dict(model="tiny", steps=6, batch_size=2, train_limit=16, max_length=256, lr=3e-3,
                         warmup_steps=0, lr_scheduler="constant", save_every=3)}


def load_conversations(args: argparse.Namespace) -> tuple[list, str]:
    """``([(where, messages)], description)`` from ``--data`` or GSM8K's train split."""
    if args.data is None:
        src = os.path.join(args.gsm8k, "train.jsonl")
        return gsm8k_conversations(src, args.train_limit), f"gsm8k train ({src})"
    keys = RowKeys(args.messages_key, args.prompt_key, args.response_key)
    return read_sft_rows(args.data, keys)[: args.train_limit], args.data


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole job; returns the run summary (also written to ``OUT/sft.json``)."""
    t_start = time.perf_counter()
    conversations, data_desc = load_conversations(args)
    policy = pol.load_policy(args.model, args.seed, args.dtype, args.remat, args.num_layers)
    config = policy.config
    encoded = encode_conversations(conversations, policy.tokenizer, args.max_length)
    if not len(encoded):
        raise SFTRowError(f"every one of the {len(conversations)} conversations of {data_desc} is longer than "
                          f"--max-length {args.max_length} tokens")
    buffers = pack_buffers(encoded, args.max_length, policy.pad_id)
    n_buffers = len(buffers["input_ids"])
    fill = float((buffers["segment_ids"] > 0).mean())
    print(f"[train_sft] {data_desc}: {len(conversations)} conversations, kept {len(encoded)}, dropped "
          f"{encoded.dropped_too_long} longer than --max-length {args.max_length}; packed into {n_buffers} buffers "
          f"({fill:.1%} real tokens), {int(buffers['loss_mask'].sum())} learned tokens", flush=True)
    print(f"[train_sft] model {policy.name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"compute {config.dtype}", flush=True)

    lora_cfg = pol.lora_config(args.lora_rank, args.lora_alpha, args.target_modules)
    trainable, frozen = pol.split_trainable(policy.params, lora_cfg, args.seed)
    schedule = pol.lr_schedule(args.lr, args.warmup_steps, args.steps, args.lr_scheduler)
    optimizer = pol.make_optimizer(schedule, args.weight_decay, args.max_grad_norm)
    spec = loop.LoopSpec("sft", args.out, args.steps, args.batch_size, n_buffers, args.seed, args.save_every,
                         args.log_every, args.resume)
    state, first = loop.start_state(spec, pol.init_state(trainable, optimizer))
    step_fn = make_train_step(lambda params, batch: sft_loss(params, config, batch), optimizer, lora_cfg)
    logger = MetricLogger(args.out, ["jsonl", "tensorboard"], resume_step=first)
    take = lambda idx: {k: v[idx] for k, v in buffers.items()}  # noqa: E731
    count = lambda batch: int((batch["segment_ids"] > 0).sum())  # noqa: E731
    meta = {"model": policy.name, "data": data_desc, "max_length": args.max_length, "lora_rank": args.lora_rank}
    t_train = time.perf_counter()
    state, history = loop.run_steps(spec, state, frozen, step_fn, take, count, lambda s: float(schedule(s)),
                                    logger.log, meta)
    train_seconds = time.perf_counter() - t_train
    logger.close()
    export = pol.export_policy(args.out, state, frozen, lora_cfg, policy)
    print(f"[train_sft] wrote {export} (use it as model.path={export})", flush=True)
    summary = {**meta, "conversations": len(conversations), "kept": len(encoded),
               "dropped_too_long": encoded.dropped_too_long, "buffers": n_buffers, "buffer_fill": fill,
               "resumed_from_step": first, "steps": args.steps, "batch_size": args.batch_size,
               "history": history, "export": export, "train_seconds": train_seconds,
               "total_seconds": time.perf_counter() - t_start,
               "command": "python launch/train_sft.py " + " ".join(args.argv)}
    with open(os.path.join(args.out, "sft.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    return summary


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="defaults for a quick run (smoke: tiny)")
    p.add_argument("--data", default=None, help="SFT rows, .jsonl or .parquet (default: GSM8K train)")
    p.add_argument("--messages-key", default="messages", help="row key of the chat messages (verl data.messages_key)")
    p.add_argument("--prompt-key", default="prompt", help="row key of the prompt when there are no messages")
    p.add_argument("--response-key", default="response", help="row key of the response when there are no messages")
    p.add_argument("--gsm8k", default=default_gsm8k_dir(), help="GSM8K dir with train.jsonl (the default data)")
    p.add_argument("--train-limit", type=int, default=None, help="use only the first N rows")
    add_training_args(p, steps=200, batch_help="packed buffers per step", max_length=1024,
                      length_help="buffer length (tokens)", lr=1e-5, weight_decay=0.01)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_training_args(build_parser(), sys.argv[1:] if argv is None else argv, PRESETS, "train_sft")
    try:
        return train(args)
    except SFTRowError as exc:
        print(f"train_sft: {exc}", file=sys.stderr)
        raise SystemExit(int(ExitCode.DATA)) from None
    except (ValueError, FileNotFoundError) as exc:  # bad options, missing files, a checkpoint that does not fit
        raise SystemExit(f"train_sft: {exc}") from None


if __name__ == "__main__":
    main()
