"""Prompt datasets for a run and their collation into the prompt-side ``Batch`` the workers consume.

Rows follow verl's schema (``jaxrl_hf.data``). ``collate_prompts`` applies the chat template, left-pads the
token ids to ``max_prompt_length`` and carries the row's ``data_source``, ``ground_truth``, ``extra_info``
and a ``uid`` (the prompt's group id: samples of one prompt share it) as per-sample objects.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.controller import Batch
from jaxrl_hf.data import (ArithmeticConfig, PromptLoader, filter_by_prompt_length, generate_arithmetic,
                           generate_calculator, make_sampler, prompt_token_ids, read_rows)
from jaxrl_hf.data import gsm8k as gsm8k_data
from jaxrl_hf.data.schema import DataFileError


def load_tokenizer(model_path: str) -> Any:
    """The tokenizer of ``model.path`` (SmolLM2's for ``tiny-random``: `tokenizer_dir`)."""
    from jaxrl_hf.models import Tokenizer
    from jaxrl_hf.models.pretrained import tokenizer_dir

    return Tokenizer.from_dir(tokenizer_dir(model_path))


def _builtin_rows(name: str, config: RunConfig, split: str, limit: int) -> list[dict]:
    d = config.data
    if name == "arithmetic":
        arith = ArithmeticConfig(min_digits=d.arithmetic.min_digits, max_digits=d.arithmetic.max_digits,
                                 operators=tuple(d.arithmetic.operators), num_operands=d.arithmetic.num_operands)
        count = d.train_size if split == "train" else limit
        # validation prompts come from a different split name, hence a disjoint random stream
        return generate_arithmetic(count, seed=d.seed, config=arith, split="train" if split == "train" else "test")
    if name == "calculator":
        from jaxrl_hf.agent import get_tool
        from jaxrl_hf.agent.chat import tools_system_prompt
        from jaxrl_hf.data.calculator import TOOL_INSTRUCTIONS

        # the tool's schema in the system prompt when the agent loop runs; the plain prompt otherwise (baseline)
        agent = config.rollout.loop == "multi_turn"
        prompt = tools_system_prompt([get_tool("calculator").schema], TOOL_INSTRUCTIONS) if agent else None
        return generate_calculator(d.train_size if split == "train" else limit, seed=d.seed, system_prompt=prompt,
                                   split="train" if split == "train" else "test", one_shot=agent and d.calculator_one_shot)
    if name == "gsm8k":
        file = "train.jsonl" if split == "train" else "test.jsonl"
        rows = gsm8k_data.to_rows(os.path.join(d.gsm8k_dir, file), split="train" if split == "train" else "test")
        return rows[:limit] if limit else rows
    rows = read_rows(name)
    return rows[:limit] if limit and split != "train" else rows


def load_split(config: RunConfig, split: str, tokenizer: Any) -> dict[str, list[dict]]:
    """``{dataset name: rows}`` for ``split`` ('train' or 'val'), overlong prompts filtered (and reported)."""
    files = config.data.train_files if split == "train" else config.data.val_files
    limit = 0 if split == "train" else config.data.val_size
    max_len = config.data.max_prompt_length if split == "train" else config.data.val_max_prompt_length
    out: dict[str, list[dict]] = {}
    for name in files:
        rows = _builtin_rows(name, config, split, config.data.val_size_per_source.get(name, limit) if limit else limit)
        if config.data.filter_overlong_prompts:
            rows, report = filter_by_prompt_length(rows, tokenizer, max_len, source=f"{split}:{name}")
        if not rows:
            key = "max_prompt_length" if split == "train" else "val_max_prompt_length"
            raise DataFileError(f"data.{split}_files: dataset {name!r} has no rows with prompts <= data.{key}={max_len} "
                                f"tokens: raise data.{key}")
        out[name] = rows
    return out


def ptx_pairs(config: RunConfig) -> list[tuple[list[dict], str]]:
    """(prompt messages, target text) pairs for the ptx loss: GSM8K question -> worked solution, arithmetic
    expression -> answer, or rows of files with a ``response``/``text`` field."""
    pairs: list[tuple[list[dict], str]] = []
    for name in config.data.ptx_files:
        if name == "gsm8k":
            for row in gsm8k_data.to_rows(os.path.join(config.data.gsm8k_dir, "train.jsonl"), split="train"):
                pairs.append((row["prompt"], gsm8k_data.clean_solution(row["extra_info"]["answer"])))
        elif name == "arithmetic":
            for row in generate_arithmetic(config.data.train_size, seed=config.data.seed + 1, split="ptx"):
                pairs.append((row["prompt"], f"Answer: {row['reward_model']['ground_truth']}"))
        else:
            for row in read_rows(name, validate=False):
                pairs.append((row["prompt"], str(row.get("response") or row.get("text") or "")))
    return pairs


def sequence_columns(prompts: np.ndarray, prompt_mask: np.ndarray, responses: np.ndarray,
                     response_mask: np.ndarray) -> dict[str, np.ndarray]:
    """``input_ids``/``attention_mask``/``position_ids`` of left-padded prompts + right-padded responses."""
    input_ids = np.concatenate([prompts, responses], axis=1).astype(np.int32)
    attention_mask = np.concatenate([prompt_mask, response_mask], axis=1).astype(np.int32)
    position_ids = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0).astype(np.int32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


def ptx_examples(config: RunConfig, tokenizer: Any) -> Batch:
    """All ptx pairs as a Batch shaped like a rollout (prompt + response columns), responses truncated."""
    width = config.rollout.response_length
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompt_ids, response_ids = [], []
    for messages, target in ptx_pairs(config):
        ids = prompt_token_ids(messages, tokenizer)
        if len(ids) <= config.data.max_prompt_length and target:
            prompt_ids.append(ids)
            response_ids.append(tokenizer.encode(target)[:width])
    if not prompt_ids:
        raise ValueError(f"data.ptx_files={config.data.ptx_files}: no example fits data.max_prompt_length")
    prompts, prompt_mask = left_pad(prompt_ids, config.data.max_prompt_length, pad_id)
    responses = np.full((len(response_ids), width), pad_id, np.int32)
    response_mask = np.zeros_like(responses)
    for i, ids in enumerate(response_ids):
        responses[i, : len(ids)] = ids
        response_mask[i, : len(ids)] = 1
    return Batch.from_dict({"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses,
                            "response_mask": response_mask,
                            **sequence_columns(prompts, prompt_mask, responses, response_mask)})


def make_train_loader(config: RunConfig, rows: Sequence[dict], batch_size: int) -> PromptLoader:
    """A resumable loader over the training rows (``data.sampler``; ``data.shuffle=False`` -> sequential)."""
    kind = config.data.sampler if config.data.shuffle else "sequential"
    return PromptLoader(rows, batch_size, make_sampler(kind, len(rows), seed=config.data.seed), drop_last=True)


def left_pad(sequences: Sequence[Sequence[int]], width: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``[B, width]`` int32 ids left-padded with ``pad_id`` and the matching 0/1 mask."""
    ids = np.full((len(sequences), width), pad_id, np.int32)
    mask = np.zeros((len(sequences), width), np.int32)
    for i, seq in enumerate(sequences):
        if len(seq) > width:
            raise ValueError(f"prompt {i} has {len(seq)} tokens > data.max_prompt_length={width}")
        if seq:
            ids[i, width - len(seq):] = seq
            mask[i, width - len(seq):] = 1
    return ids, mask


def collate_prompts(rows: Sequence[dict], tokenizer: Any, max_prompt_length: int, uid_base: int) -> Batch:
    """The prompt-side ``Batch`` of ``rows``: ``prompts``/``prompt_mask`` + per-sample objects (uid = uid_base + i)."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids, mask = left_pad([prompt_token_ids(r["prompt"], tokenizer) for r in rows], max_prompt_length, pad_id)
    return Batch.from_dict(
        {
            "prompts": ids,
            "prompt_mask": mask,
            "uid": np.arange(uid_base, uid_base + len(rows), dtype=np.int64),
            "dataset_index": np.asarray([int(r.get("dataset_index", -1)) for r in rows], np.int64),
            "data_source": [r["data_source"] for r in rows],
            "ground_truth": [r["reward_model"]["ground_truth"] for r in rows],
            "extra_info": [dict(r.get("extra_info") or {}) for r in rows],
        }
    )
