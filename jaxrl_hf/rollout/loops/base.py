"""The rollout-loop seam: what the actor's ``generate_sequences`` hands a loop, what it gets back, and the
registry of loops by name (the config key ``rollout.loop``).

A loop turns one shard of prompt rows into ``n`` finished sequences per prompt by calling the engine's
``generate`` as often as it needs: once (``single_turn``), or generate -> parse a tool call -> run the tool ->
append the observation tokens (``response_mask`` 0) -> generate again, up to a turn limit (a multi-turn
agent loop). The worker owns the engine's lifecycle around a loop (the weights in the generation layout,
``sleep()`` afterwards): a loop only calls ``engine.generate`` and reads ``engine.pad_token_id`` /
``engine.eos_token_ids`` (`jaxrl_hf.rollout.base.RolloutEngine`).

Returned columns (`sequence_columns` builds them), ``B * n`` rows, sample ``j`` of prompt ``i`` at row ``i*n + j``:

* ``responses`` ``[B*n, R]`` int32: everything after the prompt — sampled tokens and (multi-turn) observation
  tokens — then pad;
* ``response_mask`` ``[B*n, R]`` int32: 1 on the tokens the model sampled (what the policy loss trains on),
  0 on observation tokens and pad;
* ``input_ids`` ``[B*n, P+R]``: the (left-padded) prompt row followed by ``responses``;
* ``attention_mask`` ``[B*n, P+R]``: ``prompt_mask`` followed by 1 on every real response token, sampled or
  observed; ``position_ids``: its cumulative sum minus one, clipped at 0;
* ``rollout_log_probs`` ``[B*n, R]`` float32: the sampler's log-probs, 0 outside ``response_mask``;
* every input column repeated ``n`` times (interleaved), and ``uid`` (the prompt's id: ``first_uid + i`` when
  the input has no ``uid`` column).

Seeds: a loop's first ``generate`` takes ``request.sampling`` as it is (``n`` samples per prompt, row ``r``
keyed by the engine from ``(seed, r)``); a later call over the already-expanded ``B*n`` rows takes
`follow_up_sampling` (``n=1``, a seed of its own per turn). Several JAX processes (native engine): every
process runs the loop on its own rows in lockstep, so a loop must call ``generate`` equally often on every
process (e.g. a fixed number of turns, finished rows carried along).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from jaxrl_hf.controller.batch import Batch
from jaxrl_hf.registry import Registry
from jaxrl_hf.rollout.base import GenerationOutput, RolloutEngine, SamplingParams

ROLLOUT_LOOPS: Registry[Callable[[], "RolloutLoop"]] = Registry("rollout loop")


def register_rollout_loop(name: str, *, override: bool = False) -> Callable[[type], type]:
    """Class decorator: make a `RolloutLoop` subclass selectable as ``rollout.loop: <name>`` (stack it for aliases)."""
    return ROLLOUT_LOOPS.register(name, override=override)


def make_rollout_loop(name: str) -> "RolloutLoop":
    """A fresh instance of the loop registered as ``name``; an unknown name raises listing the valid ones."""
    return ROLLOUT_LOOPS.get(name)()


@dataclasses.dataclass(frozen=True)
class RolloutRequest:
    """One ``generate_sequences`` call's rows, as a loop receives them.

    ``arrays``: the numeric input columns, ``B`` rows each, among them ``prompts`` (``[B, P]`` token ids,
    left-padded) and ``prompt_mask``; ``objects``: the non-tensor columns (numpy object arrays, e.g. raw prompts,
    ground truths, tool arguments); ``sampling``: this call's sampling params (``n`` samples per prompt, the
    seed); ``first_uid``: the ``uid`` of row 0 when the input has no ``uid`` column.
    """

    arrays: Mapping[str, np.ndarray]
    objects: Mapping[str, np.ndarray]
    sampling: SamplingParams
    first_uid: int = 0

    def __post_init__(self) -> None:
        for key in ("prompts", "prompt_mask"):
            if key not in self.arrays:
                raise KeyError(f"rollout loop: no {key!r} column; columns: {[*self.arrays, *self.objects]}")
        if np.shape(self.arrays["prompts"]) != np.shape(self.arrays["prompt_mask"]):
            raise ValueError(f"rollout loop: prompts {np.shape(self.arrays['prompts'])} and prompt_mask "
                             f"{np.shape(self.arrays['prompt_mask'])} differ in shape")

    @property
    def prompts(self) -> np.ndarray:
        return np.asarray(self.arrays["prompts"])

    @property
    def prompt_mask(self) -> np.ndarray:
        return np.asarray(self.arrays["prompt_mask"])

    @property
    def n(self) -> int:
        return self.sampling.n

    @property
    def num_prompts(self) -> int:
        return self.prompts.shape[0]

    def prompt_token_lists(self) -> list[list[int]]:
        """Each prompt's tokens without its padding (what ``engine.generate`` takes)."""
        return [row[m.astype(bool)].tolist() for row, m in zip(self.prompts, self.prompt_mask)]


@dataclasses.dataclass
class RolloutResult:
    """A loop's rows (module docstring) as the worker's output Batch columns, plus batch-level ``meta_info``
    (e.g. a multi-turn loop's turn counts), merged into the output's meta info."""

    arrays: dict[str, np.ndarray]
    objects: dict[str, np.ndarray]
    meta_info: dict[str, Any] = dataclasses.field(default_factory=dict)


class RolloutLoop(abc.ABC):
    """One way of turning prompt rows into sequences (module docstring). The worker builds one per process with
    `make_rollout_loop` (no arguments) and calls ``run`` once per ``generate_sequences``."""

    def setup(self, rollout_config: Any, tokenizer: Any) -> None:
        """Called once by the worker after its model is loaded, before any ``run``: the ``rollout`` config
        section and the model's tokenizer (``None`` for ``tiny-random``). Single-turn loops need neither."""

    @abc.abstractmethod
    def run(self, engine: RolloutEngine, request: RolloutRequest) -> RolloutResult:
        """``request.n`` sequences per prompt row, generated with ``engine`` (`sequence_columns` assembles them)."""


def follow_up_sampling(sampling: SamplingParams, turn: int, **changes: Any) -> SamplingParams:
    """Sampling params for a loop's ``generate`` call number ``turn`` (>= 1) over already-expanded rows: ``n=1``
    and a seed derived from ``(sampling.seed, turn)``, so each turn draws its own stream, reproducibly;
    ``changes`` override other fields (e.g. ``max_new_tokens``)."""
    if turn < 1:
        raise ValueError(f"follow_up_sampling: turn must be >= 1 (turn 0 uses the request's sampling), got {turn}")
    seed = int(np.random.SeedSequence([int(sampling.seed) & 0xFFFFFFFF, int(turn)]).generate_state(1)[0])
    return dataclasses.replace(sampling, **{"n": 1, "seed": seed, **changes})


def engine_routing_columns(request: RolloutRequest, out: GenerationOutput) -> np.ndarray:
    """``out.routed_experts`` (the engine's prompt layout, then the responses) in the request's columns, ``[B*n, P+R,
    layers, k]``: each row's prompt tokens' experts at that row's prompt columns (0 at padding), then the responses'."""
    routed, engine_mask = np.asarray(out.routed_experts), np.asarray(out.prompt_mask) != 0
    engine_width = engine_mask.shape[1]
    request_mask = np.repeat(np.asarray(request.prompt_mask) != 0, request.n, axis=0)
    prompt = np.zeros((routed.shape[0], request_mask.shape[1], *routed.shape[2:]), np.int32)
    for row in range(routed.shape[0]):
        prompt[row, np.flatnonzero(request_mask[row])] = routed[row, np.flatnonzero(engine_mask[row])]
    return np.concatenate([prompt, routed[:, engine_width:]], axis=1).astype(np.int32)


def sequence_columns(request: RolloutRequest, responses: np.ndarray, response_mask: np.ndarray,
                     rollout_log_probs: np.ndarray, response_attention_mask: np.ndarray | None = None,
                     meta_info: Mapping[str, Any] | None = None,
                     routed_experts: np.ndarray | None = None) -> RolloutResult:
    """The output rows (module docstring) from ``[B*n, R]`` responses, their loss mask and sampler log-probs.

    ``response_attention_mask``: 1 on every real response token (sampled or observed); defaults to
    ``response_mask`` (single turn: every real token was sampled). ``routed_experts [B*n, P+R, layers, k]``: the
    rollout engine's routing (`engine_routing_columns`), kept as the ``routed_experts`` column. An input column
    named like a generated one must hold the same values (else ``ValueError``)."""
    rows = request.num_prompts * request.n
    responses = np.asarray(responses).astype(np.int32)
    response_mask = np.asarray(response_mask).astype(np.int32)
    attended = (response_mask if response_attention_mask is None
                else np.asarray(response_attention_mask).astype(np.int32))
    for name, value in (("responses", responses), ("response_mask", response_mask),
                        ("rollout_log_probs", np.asarray(rollout_log_probs)), ("response_attention_mask", attended)):
        if value.ndim != 2 or value.shape[0] != rows or value.shape != responses.shape:
            raise ValueError(f"rollout loop: {name} has shape {value.shape}; expected [{rows}, R] "
                             f"({request.num_prompts} prompts x n={request.n}) like responses {responses.shape}")
    if np.any(response_mask > attended):
        raise ValueError("rollout loop: response_mask marks tokens that response_attention_mask leaves out")
    n = request.n
    attention_mask = np.concatenate([np.repeat(request.prompt_mask, n, axis=0).astype(np.int32), attended], axis=1)
    generated = Batch.from_dict({
        "responses": responses, "response_mask": response_mask,
        "input_ids": np.concatenate([np.repeat(request.prompts, n, axis=0).astype(np.int32), responses], axis=1),
        "attention_mask": attention_mask,
        "position_ids": np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0).astype(np.int32),
        "rollout_log_probs": np.asarray(rollout_log_probs).astype(np.float32),
        **({} if routed_experts is None else {"routed_experts": np.asarray(routed_experts, np.int32)}),
    })
    expanded = Batch(dict(request.arrays), dict(request.objects)).repeat(n, interleave=True)
    if "uid" not in expanded:
        uid = request.first_uid + np.arange(request.num_prompts)
        expanded = expanded.union(Batch.from_dict({"uid": np.repeat(uid, n).astype(object)}))
    try:
        merged = expanded.union(generated)
    except ValueError as err:  # an input column named like a generated one holds other values
        raise ValueError(f"rollout loop: an input column clashes with the generated ones: {err}") from None
    return RolloutResult(merged.arrays, merged.objects, dict(meta_info or {}))
