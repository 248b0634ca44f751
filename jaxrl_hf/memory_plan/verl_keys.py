"""verl command-line keys, as written, sorted into what the memory plan does with each.

Every ``key=value`` (verl's spelling, read by the loader's `jaxrl_hf.config.verl_keys`: ``actor_rollout_ref.actor.X``
is ``actor.X``, ``*_per_gpu`` is ``*_per_device``, rollout ``tensor_model_parallel_size`` is
``placement.generate.tp``, ...) lands in exactly one of:

* **applied**: a key of the schema (verl's renamed keys included) in a section that shapes the planned programs
  (``model``, ``actor``, ``rollout``, ``ref``, ``placement``, the batch and length keys of ``data``,
  ``trainer.nnodes`` / ``trainer.n_gpus_per_node``, ``algorithm.use_kl_in_reward``): handed to
  `jaxrl_hf.config.load_config` as an override, so the loader's own checks and the worker's own config drive the
  programs.
* **mapped**: verl keys only the plan reads (`PLAN_SETTINGS`: the FSDP param-offload flags), and the plan's own
  changes to the layout (`jaxrl_hf.memory_plan.plan`).
* **ignored**: keys that do not change the planned memory: schema keys of other sections (file paths,
  logging, rewards, ...), ``model.path`` (the plan's model is ``--model``), the verl keys the loader accepts
  with no effect or refuses (with the loader's reason), unknown keys under `IGNORED_VERL_PREFIXES`, and a key
  unknown to both that resembles no known key (listed, not an error).
* **not modelled**: verl keys that would change memory but that neither the schema nor the plan handles yet
  (`NOT_MODELLED`); listed with a warning, the plan is computed without them.
* an **error** (``ValueError`` naming the key and the key it resembles): an unknown key close to a known one
  (`jaxrl_hf.config.verl_keys.suggestion`; under the same ignored prefix, if it has one).
"""

from __future__ import annotations

import dataclasses

from jaxrl_hf.config.build import ConfigError, coerce
from jaxrl_hf.config.loader import canonical_key, is_known_key, parse_override
from jaxrl_hf.config.verl_keys import classify_key, suggestion

# schema keys (canonical) whose values shape the compiled programs; exact keys or prefixes ending in '.'
APPLIED_SCHEMA_KEYS = ("model.", "actor.", "rollout.", "ref.", "placement.", "data.max_prompt_length",
                       "data.max_response_length", "data.train_batch_size", "data.gen_batch_size", "trainer.nnodes",
                       "trainer.n_gpus_per_node", "algorithm.use_kl_in_reward")
IGNORED_SCHEMA_KEYS = {"model.path": "the plan's model is --model"}

# verl key (canonical) -> plan setting (a PlanKeys bool field); renamed verl keys are the loader's
# (`jaxrl_hf.config.verl_key_tables`) and reach the plan as schema keys
PLAN_SETTINGS: dict[str, str] = {
    "actor.fsdp_config.param_offload": "offload_params",
    "ref.fsdp_config.param_offload": "offload_ref_params",
}

# unknown verl keys (canonical) under these prefixes do not change the planned programs' memory; the loader's own
# table (`jaxrl_hf.config.verl_key_tables`) gives the reason for the keys it knows
IGNORED_VERL_PREFIXES: dict[str, str] = {
    "data.": "data", "actor.fsdp_config.": "FSDP wrapper options", "actor.checkpoint.": "checkpoint contents",
    "ref.fsdp_config.": "FSDP wrapper options", "model.override_config.": "model config overrides (no shape change)",
    "rollout.multi_turn.": "agent loop", "rollout.agent.": "agent loop", "rollout.engine_kwargs.": "vLLM",
    "reward_model.": "reward", "custom_reward_function.": "reward", "algorithm.": "advantage / reward shaping",
    "trainer.": "driver options", "critic.": "no critic program is planned",
}

# verl keys (canonical) that change memory but are not modelled yet (until the schema learns them)
NOT_MODELLED: dict[str, str] = {
    "actor.fsdp_config.model_dtype": "FSDP parameter dtype (this framework keeps float32 master params)",
}


@dataclasses.dataclass
class PlanKeys:
    """The classified keys: ``overrides`` for the loader, the plan's own settings, and what was done with each
    key, as ``(key as written, note)`` pairs for the report."""

    overrides: list[str] = dataclasses.field(default_factory=list)
    offload_params: bool = False
    offload_ref_params: bool = False
    applied: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    mapped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    ignored: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    not_modelled: list[tuple[str, str]] = dataclasses.field(default_factory=list)

    def raw_value(self, key: str) -> str | None:
        """The last value given to the canonical ``key`` among the loader overrides (``None`` if absent)."""
        value = None
        for text in self.overrides:
            k, v = parse_override(text)
            if canonical_key(k) == key:
                value = v
        return value


def _matches(key: str, table: tuple[str, ...] | dict) -> str | None:
    """The entry of ``table`` (exact keys, or prefixes ending in '.') that ``key`` falls under, longest first."""
    for entry in sorted(table, key=len, reverse=True):
        if key == entry or (entry.endswith(".") and key.startswith(entry)):
            return entry
    return None


def classify_keys(args: list[str]) -> PlanKeys:
    """Sort verl ``key=value`` arguments (module docstring); raises ``ValueError`` naming a malformed argument,
    a bad value of a plan setting, or a likely typo and the key it resembles."""
    out = PlanKeys()
    for text in args:
        try:
            raw, value = parse_override(text)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        key = canonical_key(raw)
        if is_known_key(key):
            if key in IGNORED_SCHEMA_KEYS:
                out.ignored.append((raw, IGNORED_SCHEMA_KEYS[key]))
            elif _matches(key, APPLIED_SCHEMA_KEYS):
                out.overrides.append(f"{key}={value}")
                out.applied.append((raw, key))
            else:
                out.ignored.append((raw, "does not change the planned programs"))
        elif key in PLAN_SETTINGS:
            try:
                flag = coerce(value, bool, raw)
            except ConfigError as err:
                raise ValueError(str(err)) from None
            setattr(out, PLAN_SETTINGS[key], flag)
            out.mapped.append((raw, PLAN_SETTINGS[key]))
        elif key in NOT_MODELLED:
            out.not_modelled.append((raw, NOT_MODELLED[key]))
        else:
            _classify_other(raw, key, value, out)
    return out


def _classify_other(raw: str, key: str, value: str, out: PlanKeys) -> None:
    """A key neither the schema nor the plan holds: the loader's verdict (a verl key it converts is applied, one it
    ignores or refuses is ignored: it does not change memory); an unknown key is a typo when a known key is close
    (under the same ignored prefix, if any), else ignored."""
    verdict = classify_key(raw, value)
    if verdict.kind == "set":
        if _matches(verdict.target, APPLIED_SCHEMA_KEYS):
            out.overrides.append(f"{verdict.target}={verdict.value}")
            out.applied.append((raw, verdict.target))
        else:
            out.ignored.append((raw, "does not change the planned programs"))
    elif verdict.kind == "ignored":
        out.ignored.append((raw, verdict.note))
    elif verdict.kind == "error":
        out.ignored.append((raw, f"does not change memory (a run refuses it: {verdict.note})"))
    else:
        prefix = _matches(key, IGNORED_VERL_PREFIXES)
        close = suggestion(key, within=prefix or "")
        if close is not None:
            raise ValueError(f"unknown key {raw!r} (read as {key!r}): did you mean {close!r}?")
        out.ignored.append((raw, IGNORED_VERL_PREFIXES[prefix] if prefix else
                            "unknown to jaxrl_hf and to the plan; assumed not to change memory"))
