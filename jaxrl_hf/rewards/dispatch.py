"""``compute_score``: pick the rule scorer from a sample's ``data_source`` (verl's ``default_compute_score``).

Return types follow verl so a user's code and configs carry over: a float for GSM8K, MATH and
arithmetic, a dict (``score``, ``acc``, ``pred``) for DAPO math. ``compute_score_details`` always
returns the dict. A user scorer is a Python file holding a function with the same signature
(``custom_reward_function.path`` / ``.name`` / ``.reward_kwargs`` in the config), loaded by path — the
model's text is only ever passed to scorers as data, never evaluated.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl_hf.rewards import arithmetic, gsm8k, hendrycks_math, math_dapo

GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
DAPO_SOURCE_PREFIX = "aime"
ARITHMETIC_SOURCES = ("arithmetic",)
CALCULATOR_SOURCES = ("calculator",)

ScoreFn = Callable[..., "float | dict"]


def known_data_sources() -> list[str]:
    """The data sources ``compute_score`` handles (plus any name starting with ``aime``)."""
    return [*GSM8K_SOURCES, *MATH_SOURCES, *DAPO_SOURCES, f"{DAPO_SOURCE_PREFIX}*", *ARITHMETIC_SOURCES,
            *CALCULATOR_SOURCES]


def _details_fn(data_source: str) -> tuple[Callable[..., dict], bool]:
    """(detailed scorer, whether verl returns its dict rather than a float) for ``data_source``."""
    if data_source in GSM8K_SOURCES:
        return gsm8k.score_details, False
    if data_source in MATH_SOURCES:
        return hendrycks_math.score_details, False
    if data_source in DAPO_SOURCES or data_source.startswith(DAPO_SOURCE_PREFIX):
        return math_dapo.score_details, True
    if data_source in ARITHMETIC_SOURCES:
        return arithmetic.score_details, False
    if data_source in CALCULATOR_SOURCES:
        return arithmetic.strict_score_details, False
    raise NotImplementedError(
        f"no rule scorer for data_source={data_source!r}; known sources: {known_data_sources()}"
        " (or set custom_reward_function.path to a Python file with your own compute_score)"
    )


def compute_score_details(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping | None = None, **kwargs: Any
) -> dict:
    """``{"score", "acc", "pred"}`` from the scorer for ``data_source``; ``kwargs`` go to the scorer
    (e.g. ``method="flexible"`` for GSM8K, ``strict_box_verify=True`` for DAPO math)."""
    del extra_info  # the built-in scorers do not use it; custom ones receive it
    fn, _ = _details_fn(data_source)
    return fn(solution_str, ground_truth, **kwargs)


def default_compute_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping | None = None, **kwargs: Any
) -> float | dict:
    """The reward of one response, dispatched on ``data_source`` like verl's ``default_compute_score``:
    a float (GSM8K, MATH, arithmetic) or a dict with ``score``/``acc``/``pred`` (DAPO math)."""
    fn, returns_dict = _details_fn(data_source)
    details = fn(solution_str, ground_truth, **kwargs)
    return details if returns_dict else float(details["score"])


compute_score = default_compute_score


def as_score_dict(result: float | int | bool | Mapping) -> dict:
    """Normalise a scorer's result to a dict with a float ``score`` (and ``acc``, ``pred`` when absent).

    A plain number becomes ``{"score": x, "acc": x, "pred": ""}`` (verl logs the score as ``acc`` too).
    """
    if isinstance(result, Mapping):
        if "score" not in result:
            raise ValueError(f"a scorer returned a dict without 'score': keys {sorted(result)}")
        out = dict(result)
        out["score"] = float(out["score"])
        out.setdefault("acc", out["score"])
        out.setdefault("pred", "")
        return out
    if isinstance(result, (int, float)):  # bool is an int
        return {"score": float(result), "acc": float(result), "pred": ""}
    raise TypeError(f"a scorer must return a number or a dict with 'score', got {type(result).__name__}")


@dataclasses.dataclass(frozen=True)
class ScoreFnSpec:
    """Which scoring function to use, in a form that can be sent to worker processes.

    ``path=None`` means the built-in dispatch (``compute_score_details``). Otherwise ``path`` is a Python
    file and ``name`` a function in it, called as ``fn(data_source=..., solution_str=..., ground_truth=...,
    extra_info=..., **reward_kwargs)``; ``reward_kwargs`` also go to the built-in scorers.
    """

    path: str | None = None
    name: str = "compute_score"
    reward_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    scorer: str = "auto"
    """Built-in scorer when ``path`` is None: ``auto`` (by data source) or ``math_verify`` (every source;
    `jaxrl_hf.rewards.math_verify_scorer`)."""

    VALID_KEYS = ("path", "name", "reward_kwargs")

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | None) -> "ScoreFnSpec":
        """From a ``custom_reward_function`` config section (None or ``path: null``: built-in)."""
        if not config:
            return cls()
        unknown = sorted(set(config) - set(cls.VALID_KEYS))
        if unknown:
            raise ValueError(f"custom_reward_function: unknown keys {unknown}; valid keys: {list(cls.VALID_KEYS)}")
        kwargs = config.get("reward_kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise ValueError(f"custom_reward_function.reward_kwargs must be a mapping, got {type(kwargs).__name__}")
        return cls(path=config.get("path") or None, name=config.get("name") or "compute_score", reward_kwargs=dict(kwargs))

    def resolve(self) -> Callable[..., dict]:
        """A callable ``(data_source, solution_str, ground_truth, extra_info) -> dict`` (see ``as_score_dict``)."""
        base = load_custom_score_fn(self.path, self.name) if self.path is not None else builtin_scorer(self.scorer)
        bound = functools.partial(base, **self.reward_kwargs) if self.reward_kwargs else base

        def scored(data_source: str, solution_str: str, ground_truth: Any, extra_info: Mapping | None = None) -> dict:
            return as_score_dict(
                bound(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
            )

        return scored


BUILTIN_SCORERS = ("auto", "math_verify")


def builtin_scorer(name: str) -> Callable[..., dict]:
    """The built-in scorer ``reward_model.scorer`` names (`BUILTIN_SCORERS`)."""
    if name == "auto":
        return compute_score_details
    if name == "math_verify":
        from jaxrl_hf.rewards import math_verify_scorer

        math_verify_scorer.warm_up()  # imports outside any score's time limit
        return math_verify_scorer.compute_score_details
    raise ValueError(f"reward_model.scorer={name!r}: not a built-in scorer; valid: {list(BUILTIN_SCORERS)}")


@functools.lru_cache(maxsize=32)
def load_custom_score_fn(path: str, name: str = "compute_score") -> ScoreFn:
    """Import function ``name`` from the Python file ``path`` (``custom_reward_function.path`` / ``.name``)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"custom_reward_function.path: no such file {path!r}")
    module_name = f"jaxrl_hf_custom_reward_{abs(hash(os.path.abspath(path)))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"custom_reward_function.path: cannot import {path!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ImportError(f"custom_reward_function.path: importing {path!r} failed: {exc!r}") from exc
    fn = getattr(module, name, None)
    if fn is None:
        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise AttributeError(f"custom_reward_function.name: {path!r} has no {name!r}; callables there: {public}")
    if not callable(fn):
        raise TypeError(f"custom_reward_function.name: {path}:{name} is a {type(fn).__name__}, not a function")
    return fn
