"""Tool results as tokens: what a multi-turn rollout appends after an assistant turn that called tools.

The chat template renders the conversation; the tokens appended are the difference between the conversation
with the turn's tool messages (and the next assistant header, ``add_generation_prompt``) and without them,
plus whatever the template writes after an assistant message's content that the model did not sample (e.g.
the newline after ``<|im_end|>``). So a template that wraps tool results (Qwen's ``<tool_response>``) or groups
several into one message is followed exactly. Also: the system prompt listing the tools for templates that
ignore ``tools=`` (SmolLM2's), in the Qwen/Hermes wording.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

_PLACEHOLDER = "\u2063ASSISTANT_CONTENT\u2063"


class ToolMessageRenderer:
    """``observation_ids(results, last_token)``: the token ids of a turn's tool messages (module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._base = [{"role": "user", "content": "question"}, {"role": "assistant", "content": _PLACEHOLDER}]
        before = self._render(self._base, False)
        self._tail = before[before.rindex(_PLACEHOLDER) + len(_PLACEHOLDER):]
        self._before = before
        self.observation_ids(["probe"], None)  # a template that cannot render tool messages fails here, at setup

    def _render(self, messages: Sequence[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=generation_prompt)

    def observation_ids(self, results: Sequence[str], last_token: int | None) -> list[int]:
        """Tokens after an assistant turn whose last sampled token is ``last_token`` (``None``: none), for its
        tool ``results`` in call order, ending with the next assistant turn's header."""
        after = self._render([*self._base, *({"role": "tool", "content": r} for r in results)], True)
        if not after.startswith(self._before):
            raise ValueError("chat template: rendering tool messages changes the earlier turns; this template "
                             "cannot be continued turn by turn")
        tail = self._tail
        if last_token is not None:
            sampled_end = self.tokenizer.decode([int(last_token)], skip_special_tokens=False)
            if sampled_end and tail.startswith(sampled_end):
                tail = tail[len(sampled_end):]
        return list(self.tokenizer.encode(tail + after[len(self._before):]))


def tools_system_prompt(schemas: Sequence[dict], instructions: str = "") -> str:
    """A system prompt describing ``schemas`` and the ``<tool_call>`` format (Qwen/Hermes wording)."""
    listing = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return (f"{instructions}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>').strip()
