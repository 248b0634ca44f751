"""verl's dotted ``key=value`` spellings for the fine-tuning entry points (``train_sft.py``, ``train_dpo.py``,
``train_rm.py``, ``train_prm.py``), so they take command lines the way ``launch/train.py`` does.

``launch/train_sft.py trainer.default_local_dir=runs/sft optim.lr=1e-5 data.train_batch_size=8`` is
``launch/train_sft.py --out runs/sft --lr 1e-5 --batch-size 8``: `to_flags` rewrites each dotted word into the
option it names (`DOTTED_KEYS`: verl's SFT-trainer keys, ``fsdp_sft_trainer.yaml``), before argparse reads the
line. A key the entry point has no option for is refused with the keys it does take.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

DOTTED_KEYS = {
    "model.partial_pretrain": "model",
    "model.path": "model",
    "model.lora_rank": "lora_rank",
    "model.lora_alpha": "lora_alpha",
    "model.target_modules": "target_modules",
    "model.enable_gradient_checkpointing": "remat",
    "data.train_files": "data",
    "data.train_batch_size": "batch_size",
    "data.max_length": "max_length",
    "data.prompt_key": "prompt_key",
    "data.response_key": "response_key",
    "data.messages_key": "messages_key",
    "optim.lr": "lr",
    "optim.lr_scheduler": "lr_scheduler",
    "optim.weight_decay": "weight_decay",
    "optim.clip_grad": "max_grad_norm",
    "optim.lr_warmup_steps": "warmup_steps",
    "trainer.default_local_dir": "out",
    "trainer.total_training_steps": "steps",
    "trainer.save_freq": "save_every",
    "trainer.seed": "seed",
    "trainer.resume_mode": "resume",
}
"""verl's dotted key -> the argparse destination it sets (where the entry point has that option)."""


def _option(parser: argparse.ArgumentParser, dest: str) -> argparse.Action | None:
    return next((a for a in parser._actions if a.dest == dest and a.option_strings), None)


def _flag_words(action: argparse.Action, key: str, value: str, prog: str) -> list[str]:
    """The option words for ``key=value`` (booleans and verl's enums mapped onto this parser's options)."""
    flag = action.option_strings[-1]
    if key == "model.enable_gradient_checkpointing":
        return [flag, "full" if _truthy(value, key, prog) else "none"]
    if key == "trainer.resume_mode":
        if value not in ("auto", "disable"):
            raise SystemExit(f"{prog}: {key}={value!r}: valid values here are 'auto' (resume from OUT/checkpoint) "
                             "and 'disable'")
        return [flag] if value == "auto" else []
    if isinstance(action, argparse._StoreTrueAction):
        return [flag] if _truthy(value, key, prog) else []
    if key == "data.train_files":
        value = value.strip("[]'\" ")
        if "," in value:
            raise SystemExit(f"{prog}: {key}: one file here, got {value!r}")
    if key == "model.target_modules":
        value = value.strip("[]").replace("'", "").replace('"', "").replace(" ", "")
    return [flag, value]


def _truthy(value: str, key: str, prog: str) -> bool:
    lowered = value.strip().lower()
    if lowered not in ("true", "false", "1", "0"):
        raise SystemExit(f"{prog}: {key}={value!r}: expected true or false")
    return lowered in ("true", "1")


def to_flags(parser: argparse.ArgumentParser, argv: Sequence[str], prog: str) -> list[str]:
    """``argv`` with every ``key=value`` word (a dotted key, optionally ``+``-prefixed as in Hydra) replaced by the
    option words it names; the other words are kept. ``SystemExit`` names a key this entry point does not take
    and lists those it does."""
    out: list[str] = []
    valid = sorted(k for k, dest in DOTTED_KEYS.items() if _option(parser, dest) is not None)
    for word in argv:
        key, sep, value = word.partition("=")
        key = key.lstrip("+")
        if word.startswith("-") or not sep or "." not in key:
            out.append(word)
            continue
        action = _option(parser, DOTTED_KEYS.get(key, ""))
        if action is None:
            raise SystemExit(f"{prog}: unknown key {key!r} (from {word!r}); the dotted keys taken here: {valid} "
                             "(or the --options of --help)")
        out += _flag_words(action, key, value, prog)
    return out
