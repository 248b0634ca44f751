"""Seeing what the policy writes: per-step JSONL dumps of rollouts and validation generations, and samples shown
on the console / in TensorBoard / wandb.

* ``trainer.rollout_data_dir`` (verl's key): ``<dir>/<step>.jsonl``, one line per trained response: ``input``
  (the prompt text), ``output`` (the response text: the model's own tokens and, in a multi-turn rollout, the tool
  results it saw), ``gts`` (the ground truth), ``score`` (the scorer's), ``acc``, ``reward`` (the sequence reward
  trained on: score with the overlong penalty and reward-model score), ``advantage`` (the mean advantage over the
  response's loss tokens: the group advantage for GRPO/DAPO, which is the same on every token), ``step``,
  ``data_source``, ``uid`` and ``response_length``.
* ``trainer.validation_data_dir`` (verl's key): ``<dir>/<step>.jsonl`` for each validation (step 0 = before
  training), ``input``/``output``/``gts``/``score``/``acc``/``step``/``data_source``/``uid``.
* ``trainer.log_val_generations`` (verl's key): that many validation samples (the first prompts, one sample
  each) printed after each validation and written to TensorBoard as text / to wandb as a table.

A resumed run rewrites the files of the steps it repeats (each file is written whole, atomically).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_hf.controller import Batch


def _texts(ids: np.ndarray, mask: np.ndarray, tokenizer: Any) -> list[str]:
    return [tokenizer.decode(row[m != 0].tolist()) for row, m in zip(ids, mask)]


def _response_mask(batch: Batch) -> np.ndarray:
    """The response tokens to show: every attended response token (tool results included), else the loss mask."""
    mask = np.asarray(batch["response_mask"])
    if "attention_mask" in batch:
        return np.asarray(batch["attention_mask"])[:, -mask.shape[1]:]
    return mask


def generation_records(batch: Batch, tokenizer: Any, step: int) -> list[dict[str, Any]]:
    """One JSON-ready dict per row of a generated (and scored) batch; see the module docstring for the fields.
    Columns the batch lacks (``advantages`` in validation, say) are left out."""
    n = len(batch)
    records: list[dict[str, Any]] = [{"step": int(step)} for _ in range(n)]
    columns = {"input": _texts(np.asarray(batch["prompts"]), np.asarray(batch["prompt_mask"]), tokenizer),
               "output": _texts(np.asarray(batch["responses"]), _response_mask(batch), tokenizer)}
    for name, key in (("gts", "ground_truth"), ("data_source", "data_source"), ("uid", "uid"), ("score", "score"),
                      ("acc", "acc"), ("reward", "seq_score")):
        if key in batch:
            columns[name] = np.asarray(batch[key]).tolist()
    mask = np.asarray(batch["response_mask"], np.float64)
    columns["response_length"] = mask.sum(-1).astype(int).tolist()
    if "advantages" in batch:
        adv = np.asarray(batch["advantages"], np.float64)
        columns["advantage"] = ((adv * mask).sum(-1) / np.maximum(mask.sum(-1), 1.0)).tolist()
    for name, values in columns.items():
        for record, value in zip(records, values):
            record[name] = _json_ready(value)
    return records


def _json_ready(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value


def dump_generations(directory: str, step: int, records: Sequence[dict[str, Any]]) -> str:
    """Write ``records`` to ``<directory>/<step>.jsonl`` atomically (tmp file + rename); returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{int(step)}.jsonl")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return path


def show_samples(records: Sequence[dict[str, Any]], count: int, step: int, *, stream: Any = None,
                 max_chars: int = 600) -> list[dict[str, Any]]:
    """Print the first ``count`` records (one per prompt ``uid`` where present) as ``[prompt]``/``[response]``/
    ``[ground_truth]``/``[score]`` blocks; returns the records shown."""
    stream = stream or sys.stderr
    shown, seen = [], set()
    for record in records:
        if len(shown) >= count:
            break
        if record.get("uid") is not None and record["uid"] in seen:
            continue
        seen.add(record.get("uid"))
        shown.append(record)
    for i, record in enumerate(shown):
        stream.write(f"--- validation sample {i + 1}/{len(shown)} at step {step} ({record.get('data_source')})\n"
                     f"[prompt] {str(record['input'])[-max_chars:]}\n[response] {str(record['output'])[:max_chars]}\n"
                     f"[ground_truth] {record.get('gts')}\n[score] {record.get('score')}  [acc] {record.get('acc')}\n")
    stream.flush()
    return shown
