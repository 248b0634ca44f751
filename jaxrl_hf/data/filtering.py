"""Drop prompts that are too long once the chat template is applied — and say how many were dropped."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class ChatTokenizer(Protocol):
    """Anything with ``apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``
    returning token ids (a list, or a mapping with ``input_ids`` as ``transformers`` >= 5 returns)."""

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> Any: ...


@dataclasses.dataclass(frozen=True)
class FilterReport:
    """What ``filter_by_prompt_length`` did: counts, the dropped row indices and the longest prompt."""

    source: str
    max_prompt_length: int
    total: int
    kept: int
    dropped_indices: tuple[int, ...]
    longest: int

    @property
    def dropped(self) -> int:
        """Number of rows removed."""
        return len(self.dropped_indices)

    def summary(self) -> str:
        """One line for logs."""
        return (
            f"{self.source}: dropped {self.dropped}/{self.total} prompts longer than {self.max_prompt_length} tokens"
            f" with the chat template applied (longest: {self.longest})"
        )


def prompt_token_ids(messages: Sequence[Mapping[str, str]], tokenizer: ChatTokenizer) -> list[int]:
    """Token ids of ``messages`` with the chat template and the generation prompt applied."""
    out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    ids = list(out)
    if ids and isinstance(ids[0], (list, tuple)):  # a batch of one
        ids = list(ids[0])
    return [int(t) for t in ids]


def filter_by_prompt_length(
    rows: Sequence[Mapping[str, Any]],
    tokenizer: ChatTokenizer,
    max_prompt_length: int,
    *,
    source: str = "dataset",
) -> tuple[list[dict], FilterReport]:
    """Rows whose templated prompt has at most ``max_prompt_length`` tokens, and a ``FilterReport``.

    The count of dropped rows is always logged (a warning when any were dropped): never silent.
    """
    if max_prompt_length <= 0:
        raise ValueError(f"data.max_prompt_length must be > 0, got {max_prompt_length}")
    kept: list[dict] = []
    dropped: list[int] = []
    longest = 0
    for i, row in enumerate(rows):
        length = len(prompt_token_ids(row["prompt"], tokenizer))
        longest = max(longest, length)
        if length <= max_prompt_length:
            kept.append(dict(row))
        else:
            dropped.append(i)
    report = FilterReport(source, max_prompt_length, len(rows), len(kept), tuple(dropped), longest)
    (logger.warning if dropped else logger.info)(report.summary())
    return kept, report
