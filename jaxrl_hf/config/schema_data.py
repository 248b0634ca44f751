"""The ``data`` section: datasets, batch sizes, prompt lengths (verl's ``data.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional
from jaxrl_hf.data.gsm8k import default_gsm8k_dir


@dataclass
class ArithmeticDataConfig:
    """Synthetic arithmetic prompts (``jaxrl_hf.data.generate_arithmetic``). The default (1–2 digit ±) leaves
    SmolLM2-135M-Instruct room to learn: ~13% mean@4 before training (1-digit problems start at ~80%)."""

    min_digits: int = 1
    max_digits: int = 2
    operators: list[str] = field(default_factory=lambda: ["+", "-"])
    num_operands: int = 2


@dataclass
class DataConfig:
    """Prompts. ``train_files`` / ``val_files``: ``"arithmetic"`` / ``"calculator"`` (generated), ``"gsm8k"``
    (the bundled GSM8K split) or a list of parquet/jsonl paths in verl's schema."""

    train_files: list[str] = field(default_factory=lambda: ["arithmetic"])
    val_files: list[str] = field(default_factory=lambda: ["arithmetic", "gsm8k"])
    train_size: int = 4096
    """Rows generated for ``arithmetic`` / ``calculator`` training data (ignored for files)."""
    val_size: int = 32
    """Rows per validation source (first N of each; 0 = all)."""
    val_size_per_source: dict[str, int] = field(default_factory=lambda: {"gsm8k": 16})
    """Per-dataset override of ``val_size`` (keys: names in ``val_files``)."""
    gsm8k_dir: str = field(default_factory=default_gsm8k_dir)
    """Directory holding GSM8K ``train.jsonl`` / ``test.jsonl`` (default: the copy shipped in the package)."""
    train_batch_size: int = 4
    """Prompts per RL step (each sampled ``rollout.n`` times)."""
    gen_batch_size: Optional[int] = None
    """Prompts per generation round in DAPO dynamic sampling (default: ``train_batch_size``)."""
    val_batch_size: Optional[int] = None
    """Prompts per validation generation call (default: all at once)."""
    ptx_files: list[str] = field(default_factory=list)
    """Pre-training (ptx) texts for Safe-RLHF's ptx loss: ``"gsm8k"`` (question + worked answer) or paths."""
    max_prompt_length: int = 64
    max_response_length: int = 32
    val_max_prompt_length: Optional[int] = 256
    """Prompt length limit of validation prompts (default: ``max_prompt_length``); validation only generates,
    so longer prompts (GSM8K) there do not widen the training batches."""
    filter_overlong_prompts: bool = True
    shuffle: bool = True
    sampler: Literal["random", "sequential", "curriculum"] = "random"
    seed: int = 0
    arithmetic: ArithmeticDataConfig = field(default_factory=ArithmeticDataConfig)
    calculator_one_shot: bool = False
    """``calculator`` prompts with the agent loop on: add one worked tool-call exchange before the problem
    (SmolLM2-135M calls the tool only with it; docs/AGENT.md)."""


# --------------------------------------------------------------------------------------------- actor
