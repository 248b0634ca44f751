"""Step-labelled data for process reward models (PRMs): the row format, a GSM8K construction, tokenisation.

Row format (jsonl, Math-Shepherd / PRM800K style)::

    {"prompt": "<question>" | [chat messages], "steps": ["step 1 text", "step 2 text", ...], "labels": [1, 0, ...]}

one 0/1 label per step (1 = the solution is still correct after this step). A sequence is
``chat_template(prompt) + tok(step_1 + STEP_TAG) + tok(step_2 + STEP_TAG) + ...``: each step is tokenised on its
own with the step tag appended, and the PRM's score of a step is read at the last token of its segment (the
*boundary token*). A response generated in RL is split into steps the same way (`split_steps`: on the step tag,
empty pieces dropped), so training and scoring see identical layouts.

GSM8K construction (`gsm8k_step_rows`): a reference solution's lines before ``####`` are its steps and
``#### N`` is the last step. Each line's calculator annotations ``<<expr=c>>`` are checked by evaluating ``expr``
(`check_annotation`); a step's label is 1 iff every annotation up to and including it is correct (an error
poisons the later steps, Math-Shepherd's "can still reach the answer" semantics without rollouts). A negative
copy of a solution has one annotated step's result ``c`` replaced by a nearby wrong ``c'`` both inside the
annotation and in the visible text after it, so the labeler marks that step (and the rest) 0 by the same check.
Shown steps have the annotations removed (the model sees ``48/2 = 25``, not ``<<48/2=25>>``).
"""

from __future__ import annotations

import ast
import json
import operator
import os
import random
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from jaxrl_hf.data.gsm8k import INSTRUCTION, clean_solution, final_answer, read_source
from jaxrl_hf.data.schema import DatasetRowError
from jaxrl_hf.rewards.rm_data import bucket_length, normalize_prompt, pad_right

STEP_TAG = "\n"
"""Default step boundary: GSM8K solutions are one step per line."""

_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Mod: operator.mod,
        ast.FloorDiv: operator.floordiv}


def evaluate_arithmetic(expr: str) -> float | None:
    """Value of a plain arithmetic expression (numbers, + - * / // % **, parentheses), ``None`` if it is not one."""
    try:
        tree = ast.parse(expr.replace(",", "").strip(), mode="eval")
    except SyntaxError:
        return None

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            right = ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](ev(node.left), right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("not arithmetic")

    try:
        return ev(tree)
    except (ValueError, ZeroDivisionError, OverflowError, TypeError):
        return None


def check_annotation(expr: str, result: str) -> bool | None:
    """Whether ``expr`` evaluates to ``result`` (relative 1e-6, GSM8K rounds some divisions); ``None`` if either
    side is not a number/expression (such annotations are not judged)."""
    value, claimed = evaluate_arithmetic(expr), evaluate_arithmetic(result)
    if value is None or claimed is None:
        return None
    return abs(value - claimed) <= 1e-6 * max(1.0, abs(value)) or round(value, 2) == round(claimed, 2)


def step_labels(annotated_steps: Sequence[str]) -> list[int]:
    """1 for each step while every ``<<expr=c>>`` so far checks out, 0 from the first wrong one on."""
    labels, ok = [], True
    for step in annotated_steps:
        ok = ok and all(check_annotation(e, r) is not False for e, r in _ANNOTATION.findall(step))
        labels.append(int(ok))
    return labels


def _nearby(value: str, rng: random.Random) -> str:
    number = evaluate_arithmetic(value) or 0.0
    delta = rng.choice([1, 2, 3, 5, 10, -1, -2])
    wrong = number + delta if rng.random() < 0.7 else number * rng.choice([2, 10])
    if wrong == number:
        wrong = number + 1
    return str(int(wrong)) if float(wrong).is_integer() else f"{wrong:.10g}"


def corrupt_step(step: str, rng: random.Random) -> str:
    """``step`` with its first annotation's result ``c`` (and the visible copy right after ``>>``) made wrong."""
    match = _ANNOTATION.search(step)
    if match is None:
        return step
    result = match.group(2)
    wrong = _nearby(result, rng)
    after = step[match.end():]
    if after.startswith(result):
        after = wrong + after[len(result):]
    return step[:match.start()] + f"<<{match.group(1)}={wrong}>>" + after


@dataclass(frozen=True)
class StepRow:
    """One validated step-labelled example (``source``/``row`` name it in errors)."""

    prompt: tuple[dict[str, Any], ...]
    steps: tuple[str, ...]
    labels: tuple[int, ...]
    source: str = "<rows>"
    row: int = 0


def validate_step_row(raw: Any, *, source: str = "<rows>", index: int = 0) -> StepRow:
    """A `StepRow` from a mapping; a malformed row raises ``DatasetRowError`` naming ``source`` and ``index``."""
    where = f"{source}: row {index}"
    if not isinstance(raw, Mapping):
        raise DatasetRowError(f"{where}: expected an object with 'prompt', 'steps', 'labels'")
    steps, labels = raw.get("steps"), raw.get("labels")
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) and s.strip() for s in steps):
        raise DatasetRowError(f"{where}: 'steps' must be a non-empty list of non-empty strings")
    if not isinstance(labels, list) or len(labels) != len(steps) or any(lab not in (0, 1) for lab in labels):
        raise DatasetRowError(f"{where}: 'labels' must be a list of 0/1 with one label per step "
                              f"({len(steps)} steps, got {labels!r})")
    if any(STEP_TAG in s.strip("\n") for s in steps):
        raise DatasetRowError(f"{where}: a step contains the step tag {STEP_TAG!r}; split it into separate steps")
    prompt = normalize_prompt(raw.get("prompt"), where)
    return StepRow(prompt, tuple(s.strip("\n") for s in steps), tuple(int(x) for x in labels), source, index)


def read_step_rows(path: str | os.PathLike) -> list[StepRow]:
    """Validated rows of a jsonl file (rows numbered from 1)."""
    path = os.fspath(path)
    rows = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DatasetRowError(f"{path}: row {i}: invalid JSON ({exc.msg})") from None
                rows.append(validate_step_row(raw, source=path, index=i))
    return rows


def gsm8k_step_rows(path: str, seed: int = 0, limit: int | None = None, negative_fraction: float = 0.5) -> list[StepRow]:
    """Step-labelled rows from GSM8K solutions (see the module docstring): each solution as is, plus (for a
    ``negative_fraction`` of them that have an annotation) a copy with one annotated step corrupted."""
    rng = random.Random(f"jaxrl_hf.prm_gsm8k:{seed}")
    rows: list[StepRow] = []
    for raw in read_source(path)[:limit]:
        final_answer(raw["answer"], where=f"{path}: line {raw['line']}")
        body, _, tail = raw["answer"].rpartition("####")
        steps = [s for s in body.split("\n") if s.strip()] + [f"#### {tail.strip()}"]
        prompt = ({"role": "user", "content": raw["question"] + " " + INSTRUCTION},)
        variants = [steps]
        annotated = [i for i, s in enumerate(steps) if _ANNOTATION.search(s)]
        if annotated and rng.random() < negative_fraction:
            k = rng.choice(annotated)
            variants.append(steps[:k] + [corrupt_step(steps[k], rng)] + steps[k + 1:])
        for variant in variants:
            rows.append(StepRow(prompt, tuple(clean_solution(s) for s in variant), tuple(step_labels(variant)),
                                path, raw["line"]))
    return rows


def split_steps(response: str, step_tag: str = STEP_TAG) -> list[str]:
    """A response's steps: the pieces between step tags, blank pieces dropped (the training layout's inverse)."""
    return [s for s in response.split(step_tag) if s.strip()]


def step_end_offsets(response: str, step_tag: str = STEP_TAG) -> list[int]:
    """Character offset just past each step of ``split_steps(response, step_tag)``, one per step in order: the
    end of the step's step tag when one follows it (the PRM reads a step after ``step + step_tag``), else the
    end of the text (a last step with no tag, e.g. a truncated response)."""
    pieces = response.split(step_tag)
    ends, pos = [], 0
    for j, piece in enumerate(pieces):
        pos += len(piece)
        if piece.strip():
            ends.append(pos + (len(step_tag) if j < len(pieces) - 1 else 0))
        pos += len(step_tag)
    return ends


def encode_steps(tokenizer: Any, prompt: Sequence[Mapping[str, Any]] | Sequence[int] | str, steps: Sequence[str],
                 step_tag: str = STEP_TAG) -> tuple[list[int], list[int]]:
    """``(ids, boundary positions)``: the chat-templated prompt (or ``prompt`` itself when it is already token ids),
    then each ``step + step_tag`` tokenised separately; the boundary of a step is the index of its segment's last
    token."""
    if not isinstance(prompt, str) and len(prompt) and all(isinstance(t, (int, np.integer)) for t in prompt):
        ids = [int(t) for t in prompt]
    else:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    boundaries = []
    for step in steps:
        segment = tokenizer.encode(step + step_tag)
        if not segment:
            raise ValueError(f"step {step!r} encodes to no tokens")
        ids.extend(segment)
        boundaries.append(len(ids) - 1)
    return ids, boundaries


@dataclass(frozen=True)
class EncodedSteps:
    """Token ids, boundary positions and labels of the rows that fit ``max_length`` (+ how many did not)."""

    ids: list[list[int]]
    boundaries: list[list[int]]
    labels: list[list[int]]
    dropped_too_long: int

    def __len__(self) -> int:
        return len(self.ids)


def encode_step_rows(rows: Sequence[StepRow], tokenizer: Any, max_length: int,
                     step_tag: str = STEP_TAG) -> EncodedSteps:
    """Tokenise rows; a row longer than ``max_length`` is dropped, never truncated."""
    ids, bounds, labels, dropped = [], [], [], 0
    for row in rows:
        seq, b = encode_steps(tokenizer, row.prompt, row.steps, step_tag)
        if len(seq) > max_length:
            dropped += 1
            continue
        ids.append(seq)
        bounds.append(b)
        labels.append(list(row.labels))
    return EncodedSteps(ids, bounds, labels, dropped)


def make_step_batch(encoded: EncodedSteps, indices: Sequence[int], batch_size: int, pad_id: int,
                    bucket: int = 64, max_length: int = 1 << 30) -> dict[str, np.ndarray]:
    """A right-padded batch: ``input_ids``/``attention_mask`` ``[B, T]`` int32, ``step_mask`` ``[B, T]`` float32
    (1 at boundary tokens of real rows) and ``step_labels`` ``[B, T]`` float32 (the label there, else 0)."""
    indices = list(indices)
    if not indices or len(indices) > batch_size:
        raise ValueError(f"a batch needs 1..{batch_size} row indices, got {len(indices)}")
    chosen = indices + [indices[0]] * (batch_size - len(indices))
    seqs = [encoded.ids[i] for i in chosen]
    length = bucket_length(max(len(s) for s in seqs), bucket, max_length)
    ids, mask = pad_right(seqs, length, pad_id)
    step_mask = np.zeros((batch_size, length), np.float32)
    step_labels_ = np.zeros((batch_size, length), np.float32)
    for row, i in enumerate(indices):
        step_mask[row, encoded.boundaries[i]] = 1.0
        step_labels_[row, encoded.boundaries[i]] = encoded.labels[i]
    return {"input_ids": ids, "attention_mask": mask, "step_mask": step_mask, "step_labels": step_labels_}
