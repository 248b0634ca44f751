"""verl command-line keys, as written, sorted into what the memory plan does with each.

Every ``key=value`` (verl's spelling: ``actor_rollout_ref.actor.X`` is ``actor.X``, `jaxrl_hf.config.loader`'s
``KEY_ALIASES``) lands in exactly one of:

* **applied**: a key of the schema in a section that shapes the planned programs (``model``, ``actor``,
  ``rollout``, ``ref``, ``placement``, the batch and length keys of ``data``, ``trainer.nnodes`` /
  ``trainer.n_gpus_per_node``, ``algorithm.use_kl_in_reward``): handed to `jaxrl_hf.config.load_config` as an
  override, so the loader's own checks and the worker's own config drive the programs.
* **mapped**: verl keys the loader does not know that the plan needs (`PLAN_MAPPED`), turned into loader
  keys or plan settings: rollout ``tensor_model_parallel_size`` -> ``placement.generate.tp``; the FSDP offload
  flags -> ``actor.offload_optimizer`` and the plan's param-offload settings; ``*_per_gpu`` micro-batch sizes
  -> ``*_per_device``.
  A key the schema knows is never mapped here: once the loader learns a key, it is applied as is.
* **ignored**: keys that do not change the planned memory: schema keys of other sections (file paths,
  logging, rewards, ...), ``model.path`` (the plan's model is ``--model``), and the verl keys in
  `IGNORED_VERL_KEYS` (exact keys, or prefixes for a key resembling no known key under the same prefix); also
  a key unknown to both that resembles no known key (listed, not an error).
* **not modelled**: verl keys that would change memory but that neither the schema nor the plan handles yet
  (`NOT_MODELLED`); listed with a warning, the plan is computed without them.
* an **error** (``ValueError`` naming the key and the key it resembles): an unknown key within
  `difflib`'s ratio ``TYPO_CUTOFF`` of a known one (of one under the same ignored prefix, if it has one).
"""

from __future__ import annotations

import dataclasses
import difflib

from jaxrl_hf.config.build import ConfigError, coerce
from jaxrl_hf.config.loader import canonical_key, is_known_key, parse_override, schema_keys

TYPO_CUTOFF = 0.85

# schema keys (canonical) whose values shape the compiled programs; exact keys or prefixes ending in '.'
APPLIED_SCHEMA_KEYS = ("model.", "actor.", "rollout.", "ref.", "placement.", "data.max_prompt_length",
                       "data.max_response_length", "data.train_batch_size", "data.gen_batch_size", "trainer.nnodes",
                       "trainer.n_gpus_per_node", "algorithm.use_kl_in_reward")
IGNORED_SCHEMA_KEYS = {"model.path": "the plan's model is --model"}

# verl key (canonical) -> (target, kind): kind "loader" sets the target config key to the value, "setting" sets a
# PlanKeys field (a bool)
PLAN_MAPPED: dict[str, tuple[str, str]] = {
    "rollout.tensor_model_parallel_size": ("placement.generate.tp", "loader"),
    "actor.fsdp_config.optimizer_offload": ("actor.offload_optimizer", "loader"),
    "actor.ppo_micro_batch_size_per_gpu": ("actor.ppo_micro_batch_size_per_device", "loader"),
    "rollout.log_prob_micro_batch_size_per_gpu": ("actor.log_prob_micro_batch_size_per_device", "loader"),
    "actor.fsdp_config.param_offload": ("offload_params", "setting"),
    "ref.fsdp_config.param_offload": ("offload_ref_params", "setting"),
}

# verl keys (canonical) that do not change the planned programs' memory; exact keys or prefixes ending in '.'
IGNORED_VERL_KEYS: dict[str, str] = {
    "data.prompt_key": "data", "data.truncation": "data", "data.return_raw_chat": "data",
    "data.filter_overlong_prompts_workers": "data", "data.dataloader_num_workers": "data",
    "trainer.total_epochs": "schedule", "trainer.val_before_train": "schedule", "trainer.test_freq": "schedule",
    "trainer.save_freq": "schedule", "trainer.device": "schedule",
    "actor.optim.lr_warmup_steps": "learning-rate schedule", "actor.optim.lr_warmup_steps_ratio":
    "learning-rate schedule", "actor.optim.warmup_style": "learning-rate schedule",
    "actor.use_token_level_loss": "loss aggregation (verl's old spelling of loss_agg_mode=token-mean)",
    "actor.fsdp_config.fsdp_size": "-1 (verl's default): FSDP over all devices, as placement.train.dp",
    "actor.fsdp_config.": "FSDP wrapper options", "actor.checkpoint.": "checkpoint contents",
    "ref.fsdp_config.": "FSDP wrapper options", "ref.log_prob_micro_batch_size_per_gpu":
    "the reference forward is not a planned program (log_prob is the same forward on the actor's params)",
    "model.override_config.": "dropout overrides (no shape change)", "model.trust_remote_code": "loading",
    "model.use_shm": "loading", "model.external_lib": "loading",
    "rollout.val_kwargs.": "validation sampling", "rollout.enable_chunked_prefill": "vLLM scheduling",
    "rollout.max_num_batched_tokens": "vLLM prefill scheduling (prefill is not a planned program)",
    "rollout.mode": "sync/async rollout", "rollout.free_cache_engine": "vLLM", "rollout.load_format": "vLLM",
    "rollout.do_sample": "sampling", "rollout.ignore_eos": "sampling", "rollout.calculate_log_probs": "sampling",
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


def _known_universe() -> list[str]:
    keys = set(schema_keys()) | set(PLAN_MAPPED) | set(NOT_MODELLED)
    keys |= {k for k in IGNORED_VERL_KEYS if not k.endswith(".")}
    return sorted(keys)


def classify_keys(args: list[str]) -> PlanKeys:
    """Sort verl ``key=value`` arguments (module docstring); raises ``ValueError`` naming a malformed argument,
    a bad value of a mapped key, or a likely typo and the key it resembles."""
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
        elif key in PLAN_MAPPED:
            target, kind = PLAN_MAPPED[key]
            if kind == "loader":
                out.overrides.append(f"{target}={value}")
            else:
                try:
                    flag = coerce(value, bool, raw)
                except ConfigError as err:
                    raise ValueError(str(err)) from None
                setattr(out, target, flag)
            out.mapped.append((raw, target))
        elif key in IGNORED_VERL_KEYS:
            out.ignored.append((raw, IGNORED_VERL_KEYS[key]))
        elif key in NOT_MODELLED:
            out.not_modelled.append((raw, NOT_MODELLED[key]))
        else:  # a typo is caught before an ignored prefix could swallow it: compared with the known keys under
            # the same prefix (all known keys when none matches)
            prefix = _matches(key, IGNORED_VERL_KEYS)
            candidates = [k for k in _known_universe() if prefix is None or k.startswith(prefix)]
            close = difflib.get_close_matches(key, candidates, n=1, cutoff=TYPO_CUTOFF)
            if close:
                raise ValueError(f"unknown key {raw!r} (read as {key!r}): did you mean {close[0]!r}?")
            note = IGNORED_VERL_KEYS[prefix] if prefix else "unknown to jaxrl_hf and to the plan; assumed not " \
                "to change memory"
            out.ignored.append((raw, note))
    return out
