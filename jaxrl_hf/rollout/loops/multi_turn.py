"""``multi_turn``: a tool-calling agent loop (verl's ``actor_rollout_ref.rollout.multi_turn``; docs/AGENT.md).

Per rollout row: generate -> parse ``<tool_call>`` blocks (`jaxrl_hf.agent.parser`) -> run the tools ->
append their answers as tool messages rendered by the chat template (`jaxrl_hf.agent.chat`) -> generate again
from the whole context, until a turn makes no tool call, ``multi_turn.max_assistant_turns`` model turns were
taken, or the response budget ``rollout.response_length`` (sampled + tool tokens) is spent.

Output (`sequence_columns`): ``responses`` hold every token after the prompt, the model's and the tools';
``response_mask`` is 1 only on the model's (the loss, advantages, entropy and length metrics use it),
``attention_mask`` covers both. Per-row columns ``num_turns``, ``num_tool_calls`` and ``num_tool_errors`` feed
the ``agent/*`` metrics. Every row's tool calls of a turn run concurrently in a thread pool.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from jaxrl_hf.agent import ToolCall, default_tools, load_tool_config, parse_tool_calls, run_tool
from jaxrl_hf.agent.chat import ToolMessageRenderer
from jaxrl_hf.rollout.base import RolloutEngine
from jaxrl_hf.rollout.loops.base import (RolloutLoop, RolloutRequest, RolloutResult, follow_up_sampling,
                                         register_rollout_loop, sequence_columns)

AGENT_COLUMNS = ("num_turns", "num_tool_calls", "num_tool_errors")


@dataclasses.dataclass
class Trajectory:
    """One row's conversation so far: the context fed to the engine and the response columns being built."""

    context: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    turns: int = 0
    rounds: int = 0
    calls: int = 0
    errors: int = 0
    done: bool = False

    def extend(self, ids: list[int], sampled: bool, log_probs: list[float] | None = None) -> None:
        self.context += ids
        self.tokens += ids
        self.mask += [int(sampled)] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)


def default_tokenizer() -> Any:
    """SmolLM2's tokenizer (what ``model.path=tiny-random`` runs with)."""
    from jaxrl_hf.models import Tokenizer
    from jaxrl_hf.models.pretrained import resolve_hf_dir

    return Tokenizer.from_dir(resolve_hf_dir("smollm2-135m-instruct"))


def truncate(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters keeping its head (``left``), tail (``right``) or both (``middle``)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    return text[: limit // 2] + "...(truncated)..." + text[len(text) - (limit - limit // 2):]


def _turn_budget(remaining: int, limit: int) -> int:
    """``max_new_tokens`` of a turn: the largest remaining budget rounded up to a power of two (<= ``limit``),
    so the native engine compiles a handful of programs, not one per length."""
    return min(limit, 1 << max(int(remaining) - 1, 0).bit_length())


@register_rollout_loop("multi_turn")
class MultiTurnLoop(RolloutLoop):
    """The agent loop (module docstring); `setup` loads the tools and the chat renderer."""

    def __init__(self) -> None:
        self.tools: dict[str, Any] = {}
        self.tokenizer: Any = None
        self.renderer: ToolMessageRenderer | None = None
        self.max_turns: int | None = None
        self.max_user_turns: int | None = None
        self.max_parallel_calls, self.max_tool_chars, self.truncate_side = 1, 256, "middle"

    def setup(self, rollout_config: Any, tokenizer: Any) -> None:
        mt = rollout_config.multi_turn
        try:
            tools = load_tool_config(mt.tool_config_path) if mt.tool_config_path else default_tools()
        except ValueError as err:
            raise ValueError(f"rollout.multi_turn.tool_config_path: {err}") from None
        self.tools = {tool.name: tool for tool in tools}
        self.tokenizer = tokenizer if tokenizer is not None else default_tokenizer()
        self.renderer = ToolMessageRenderer(self.tokenizer)
        self.max_turns, self.max_user_turns = mt.max_assistant_turns, mt.max_user_turns
        self.max_parallel_calls, self.max_tool_chars = int(mt.max_parallel_calls), int(mt.max_tool_response_length)
        self.truncate_side = mt.tool_response_truncate_side

    # ------------------------------------------------------------------------------ tools
    def call(self, call: Any) -> tuple[str, bool]:
        """``(answer, ok)`` of one parsed call; malformed or unknown calls answer with an error text."""
        if not isinstance(call, ToolCall):
            return f"Error: {call.message}", False
        tool = self.tools.get(call.name)
        if tool is None:
            return f"Error: unknown tool {call.name!r}; available: {sorted(self.tools)}", False
        text, ok = run_tool(tool, call.arguments)
        return truncate(text, self.max_tool_chars, self.truncate_side), ok

    def _run_calls(self, pending: list[tuple[int, list[Any]]]) -> list[list[tuple[str, bool]]]:
        flat = [call for _, calls in pending for call in calls]
        if not flat:
            return []
        with ThreadPoolExecutor(max_workers=min(16, len(flat))) as pool:
            answers = list(pool.map(self.call, flat))
        out, k = [], 0
        for _, calls in pending:
            out.append(answers[k:k + len(calls)])
            k += len(calls)
        return out

    # ------------------------------------------------------------------------------ the loop
    def run(self, engine: RolloutEngine, request: RolloutRequest) -> RolloutResult:
        if self.renderer is None:
            raise RuntimeError("multi_turn loop: setup(rollout_config, tokenizer) was not called")
        budget, n = request.sampling.max_new_tokens, request.n
        rows = [Trajectory(list(p)) for p in request.prompt_token_lists() for _ in range(n)]
        prompt_lengths = [len(t.context) for t in rows]
        lockstep = bool(getattr(engine, "multi_process", False))  # every process must call generate as often
        if lockstep and self.max_turns is None:
            raise ValueError("multi_turn loop over several processes needs rollout.multi_turn.max_assistant_turns")
        max_turns = self.max_turns or budget
        for turn in range(max_turns):
            live = [i for i, t in enumerate(rows) if not t.done]
            if not live and not lockstep:
                break
            if turn == 0:
                picked, out = list(range(len(rows))), engine.generate(request.prompt_token_lists(), request.sampling)
            else:  # in lockstep: every row (finished ones as their prompt, ignored) and the full budget, so all
                # processes run the same program
                picked = list(range(len(rows))) if lockstep else live
                longest = max((budget - len(rows[i].tokens) for i in live), default=1)
                max_new = budget if lockstep else _turn_budget(longest, budget)
                contexts = [rows[i].context if not rows[i].done else rows[i].context[:prompt_lengths[i]]
                            for i in picked]
                out = engine.generate(contexts, follow_up_sampling(request.sampling, turn, max_new_tokens=max_new))
            pending = []
            for k, i in enumerate(picked):
                calls = self._take_turn(rows[i], out, k, budget, engine.eos_token_ids, last=turn + 1 >= max_turns)
                if calls:
                    pending.append((i, calls))
            for (i, _), answers in zip(pending, self._run_calls(pending)):
                self._observe(rows[i], answers, budget)
        return self._columns(request, rows, budget, engine.pad_token_id)

    def _take_turn(self, row: Trajectory, out: Any, k: int, budget: int, eos: tuple[int, ...],
                   last: bool) -> list[Any]:
        """Append row ``k`` of ``out`` to ``row``; its tool calls if the conversation continues, else ``[]``."""
        if row.done:
            return []
        sampled = np.asarray(out.response_mask[k]) > 0
        room = budget - len(row.tokens)
        ids = [int(x) for x in np.asarray(out.response_ids[k])[sampled]][:room]
        row.extend(ids, True, [float(x) for x in np.asarray(out.log_probs[k])[sampled]][:len(ids)])
        row.turns += 1
        stopped = bool(ids) and ids[-1] in eos and len(ids) == int(sampled.sum())
        calls = parse_tool_calls(self.tokenizer.decode(ids, skip_special_tokens=False)) if stopped else []
        out_of_rounds = self.max_user_turns is not None and row.rounds >= self.max_user_turns
        if not calls or last or out_of_rounds or len(row.tokens) >= budget:
            row.done = True
            return []
        return calls[: self.max_parallel_calls]

    def _observe(self, row: Trajectory, answers: list[tuple[str, bool]], budget: int) -> None:
        """Append the tool answers (``response_mask`` 0), cut to the budget; no room left ends the row."""
        row.calls += len(answers)
        row.rounds += 1
        row.errors += sum(not ok for _, ok in answers)
        ids = self.renderer.observation_ids([text for text, _ in answers], row.tokens[-1] if row.tokens else None)
        row.extend(ids[: budget - len(row.tokens)], False)
        row.done = len(row.tokens) >= budget

    def _columns(self, request: RolloutRequest, rows: list[Trajectory], budget: int, pad: int) -> RolloutResult:
        shape = (len(rows), budget)
        tokens, mask = np.full(shape, pad, np.int32), np.zeros(shape, np.int32)
        attended, logp = np.zeros(shape, np.int32), np.zeros(shape, np.float32)
        for r, t in enumerate(rows):
            k = len(t.tokens)
            tokens[r, :k], mask[r, :k], attended[r, :k], logp[r, :k] = t.tokens, t.mask, 1, t.log_probs
        result = sequence_columns(request, tokens, mask, logp, attended)
        for name, values in zip(AGENT_COLUMNS, ([t.turns for t in rows], [t.calls for t in rows],
                                                [t.errors for t in rows])):
            result.arrays[name] = np.asarray(values, np.int32)
        return result
