"""verl's RL dataset row schema, validated row by row with errors naming the file and row.

A row::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],          # chat messages
     "ability": "math",                                       # optional
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0, ...}}       # optional
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

REQUIRED_KEYS = ("data_source", "prompt", "reward_model")
OPTIONAL_KEYS = ("ability", "extra_info")
ROLES = ("system", "user", "assistant", "tool")


class DatasetRowError(ValueError):
    """A dataset row does not follow the schema; the message names the file and row."""


class DataFileError(DatasetRowError):
    """A dataset file cannot be used as a whole (empty, unreadable, an unknown format); the message names it."""


def _where(source: str, index: int) -> str:
    return f"{source}: row {index}"


def validate_row(row: Any, *, source: str = "<rows>", index: int = 0) -> dict:
    """Check one row against the schema and return it; raise ``DatasetRowError`` naming ``source``/``index``.

    ``ground_truth`` may be a string or a number (numbers are accepted for hand-written files and
    scored through their string form); ``extra_info``, when present, must be a mapping.
    """
    where = _where(source, index)
    if not isinstance(row, Mapping):
        raise DatasetRowError(f"{where}: expected an object, got {type(row).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in row]
    if missing:
        raise DatasetRowError(f"{where}: missing keys {missing} (required: {list(REQUIRED_KEYS)})")
    source_name = row["data_source"]
    if not isinstance(source_name, str) or not source_name:
        raise DatasetRowError(f"{where}: data_source must be a non-empty string, got {source_name!r}")
    prompt = row["prompt"]
    if isinstance(prompt, str) or not isinstance(prompt, Iterable):
        raise DatasetRowError(f"{where}: prompt must be a list of chat messages, got {type(prompt).__name__}")
    messages = list(prompt)
    if not messages:
        raise DatasetRowError(f"{where}: prompt has no messages")
    for j, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise DatasetRowError(f"{where}: prompt[{j}] must be a {{'role', 'content'}} message, got {message!r}")
        if message["role"] not in ROLES:
            raise DatasetRowError(f"{where}: prompt[{j}].role {message['role']!r} is not one of {list(ROLES)}")
        if not isinstance(message["content"], str):
            raise DatasetRowError(f"{where}: prompt[{j}].content must be a string, got {type(message['content']).__name__}")
    reward = row["reward_model"]
    if not isinstance(reward, Mapping) or "ground_truth" not in reward:
        raise DatasetRowError(f"{where}: reward_model must be an object with a ground_truth, got {reward!r}")
    truth = reward["ground_truth"]
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)) or (isinstance(truth, str) and not truth.strip()):
        raise DatasetRowError(f"{where}: reward_model.ground_truth must be a non-empty string or a number, got {truth!r}")
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, Mapping):
        raise DatasetRowError(f"{where}: extra_info must be an object, got {type(extra).__name__}")
    ability = row.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise DatasetRowError(f"{where}: ability must be a string, got {type(ability).__name__}")
    return dict(row)


def make_row(
    data_source: str,
    user_content: str,
    ground_truth: str,
    *,
    ability: str = "math",
    extra_info: Mapping[str, Any] | None = None,
    system_prompt: str | None = None,
) -> dict:
    """A schema-valid row with a single user message (and an optional system message)."""
    prompt = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": user_content}
    ]
    return {
        "data_source": data_source,
        "prompt": prompt,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": str(ground_truth)},
        "extra_info": dict(extra_info or {}),
    }
