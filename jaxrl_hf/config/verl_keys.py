"""verl's spellings of config keys: aliases, renames, and what happens to each key this schema does not hold.

`canonical_key` maps a key as written to this schema's key (``actor_rollout_ref.actor.x`` -> ``actor.x``, a
`RENAMED` key -> its target, ``*_per_gpu`` <-> ``*_per_device`` where only the other names a schema key).
`classify_key` decides each ``key=value`` in one step (`KeyVerdict`): a schema key to set, a verl key accepted
with no effect (and why), or an error (why, with "did you mean" for a likely typo: `difflib` ratio >=
`SUGGEST_CUTOFF` against the known keys). `KeyReport` gathers the verdicts of a whole config so that every
problem is reported at once. The tables are in `jaxrl_hf.config.verl_key_tables`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any

import yaml

from jaxrl_hf.config.build import ConfigError
from jaxrl_hf.config.schema_paths import check_path, is_schema_key, schema_keys
from jaxrl_hf.config.verl_key_tables import CONVERTED, IGNORED, RENAMED, UNSUPPORTED

KEY_ALIASES: dict[str, str] = {
    "actor_rollout_ref.actor": "actor",
    "actor_rollout_ref.rollout": "rollout",
    "actor_rollout_ref.ref": "ref",
    "actor_rollout_ref.model": "model",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.default_local_dir": "trainer.run_dir",
}
"""verl's section prefixes (and renamed keys) -> this schema's: ``actor_rollout_ref.actor.x`` is ``actor.x``."""

SUGGEST_CUTOFF = 0.75
"""`difflib.SequenceMatcher` ratio from which an unknown key is reported with "did you mean"."""


def matching_entry(key: str, table: dict[str, Any]) -> str | None:
    """The entry of ``table`` (exact keys, or prefixes ending in '.' or '_') that ``key`` falls under, longest
    first."""
    if key in table:
        return key
    prefixes = [entry for entry in table if entry.endswith((".", "_")) and key.startswith(entry)]
    return max(prefixes, key=len) if prefixes else None


def _swap_device_suffix(key: str) -> str:
    """``x_per_gpu`` <-> ``x_per_device`` when only the other spelling is a schema key (verl vs. this schema)."""
    for old, new in (("_per_gpu", "_per_device"), ("_per_device", "_per_gpu")):
        if key.endswith(old) and not is_schema_key(key) and is_schema_key(key[: -len(old)] + new):
            return key[: -len(old)] + new
    return key


def alias_only(key: str) -> str:
    """``key`` with verl's section prefix replaced by this schema's (`KEY_ALIASES`), nothing else."""
    for alias, target in sorted(KEY_ALIASES.items(), key=lambda kv: -len(kv[0])):
        if key == alias or key.startswith(alias + "."):
            return target + key[len(alias):]
    return key


def canonical_key(key: str) -> str:
    """This schema's spelling of ``key``: verl's prefix aliases, then `RENAMED` keys, then the device suffix."""
    key = alias_only(key)
    entry = matching_entry(key, RENAMED)
    if entry is not None:
        return RENAMED[entry] + key[len(entry):]
    return _swap_device_suffix(key)


@dataclasses.dataclass(frozen=True)
class KeyVerdict:
    """What one ``key=value`` does: ``kind`` ``set`` (``target`` = ``value``), ``ignored``, ``error`` (a verl key
    that is not supported) or ``unknown`` (a key nobody knows, with "did you mean" when one is close); ``note``
    says why."""

    key: str
    kind: str
    target: str = ""
    value: Any = None
    note: str = ""


def parsed_value(value: Any) -> Any:
    """A command-line string as YAML reads it (``"false"`` -> False, ``"-1"`` -> -1); other values as they are."""
    if not isinstance(value, str):
        return value
    try:
        return yaml.safe_load(value) if value.strip() else value
    except yaml.YAMLError:
        return value


def _same(value: Any, harmless: Any) -> bool:
    """Equality that keeps bools apart from 0/1 (``True`` is not the harmless ``1``)."""
    if isinstance(value, bool) or isinstance(harmless, bool):
        return isinstance(value, bool) and isinstance(harmless, bool) and value == harmless
    return value == harmless


@functools.lru_cache(maxsize=1)
def known_keys() -> tuple[str, ...]:
    """Every key a user may write (canonical spelling): schema keys and the exact keys of the verl tables."""
    tables = (*RENAMED, *CONVERTED, *IGNORED, *UNSUPPORTED)
    return tuple(sorted(set(schema_keys()) | {k for k in tables if not k.endswith((".", "_"))}))


def suggestion(key: str, within: str = "") -> str | None:
    """The known key closest to ``key`` (`SUGGEST_CUTOFF`), or None; with ``within`` (a prefix of ``key``) only
    keys under that prefix, compared by the rest of the key (a long shared prefix does not make keys alike)."""
    rest = {k[len(within):]: k for k in known_keys() if k.startswith(within) and k != key}
    close = difflib.get_close_matches(key[len(within):], list(rest), n=1, cutoff=SUGGEST_CUTOFF)
    return rest[close[0]] if close else None


def classify_key(raw: str, value: Any) -> KeyVerdict:
    """The verdict on ``raw=value`` (``raw`` as written; ``value`` a command-line string or a YAML value)."""
    key = canonical_key(raw)
    if key in CONVERTED:
        target, convert = CONVERTED[key]
        new = convert(parsed_value(value))
        if new is None:
            return KeyVerdict(raw, "ignored", note=f"{value!r} is verl's 'unset' ({target} keeps its value)")
        return KeyVerdict(raw, "set", target, new)
    try:
        check_path(tuple(key.split(".")), "")
        return KeyVerdict(raw, "set", key, value)
    except ConfigError as err:
        unknown = str(err)
    ignored, unsupported = matching_entry(key, IGNORED), matching_entry(key, UNSUPPORTED)
    if unsupported is not None and len(unsupported) >= len(ignored or ""):
        reason, harmless = UNSUPPORTED[unsupported]
        parsed = parsed_value(value)
        if any(_same(parsed, h) for h in harmless):
            return KeyVerdict(raw, "ignored",
                              note=f"{parsed!r} is the behaviour here; other values are refused: {reason}")
        return KeyVerdict(raw, "error", note=f"verl key '{raw}={value}' is not supported: {reason}")
    if ignored is not None and (ignored == key or suggestion(key, within=ignored) is None):
        return KeyVerdict(raw, "ignored", note=IGNORED[ignored])
    close = suggestion(key, within=ignored or "")
    read_as = f" (read as '{key}')" if key != raw else ""
    if close is not None:
        unknown = unknown.replace(f"unknown config key '{key}';",
                                  f"unknown config key '{raw}'{read_as}: did you mean '{close}'? -", 1)
    return KeyVerdict(raw, "unknown", note=unknown)


def key_kind(key: str) -> str:
    """How a key is handled whatever its value (for coverage counts): ``schema`` (a schema key, aliases and
    renames included), ``ignored`` (accepted with no effect), ``conditional`` (accepted at this framework's own
    behaviour, an error otherwise), ``unsupported`` (an error, with its reason) or ``unknown``."""
    canon = canonical_key(key)
    if canon in CONVERTED or is_schema_key(canon):
        return "schema"
    ignored, unsupported = matching_entry(canon, IGNORED), matching_entry(canon, UNSUPPORTED)
    if unsupported is not None and len(unsupported) >= len(ignored or ""):
        return "conditional" if UNSUPPORTED[unsupported][1] else "unsupported"
    return "ignored" if classify_key(key, None).kind == "ignored" else "unknown"


@dataclasses.dataclass
class KeyReport:
    """The verdicts on all keys of one config: ``renamed`` (key as written, schema key), ``ignored`` (key as
    written, reason), ``errors`` (one message each, naming its source) and ``sources`` (schema key -> every
    source that set it, in order: the last one's value stands)."""

    renamed: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    ignored: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    sources: dict[str, list[str]] = dataclasses.field(default_factory=dict)

    def record(self, verdict: KeyVerdict, source: str) -> None:
        """Note ``verdict`` (from ``source``: a file or an override) in the lists it belongs to."""
        if verdict.kind in ("error", "unknown"):
            self.errors.append(f"{source}: {verdict.note}")
        elif verdict.kind == "ignored":
            self.ignored.append((verdict.key, verdict.note))
        elif verdict.target != alias_only(verdict.key):
            self.renamed.append((verdict.key, verdict.target))
        if verdict.kind == "set":
            self.sources.setdefault(verdict.target, []).append(source)

    def raise_errors(self) -> None:
        """One ``ConfigError`` listing every error (nothing when there is none)."""
        if len(self.errors) == 1:
            raise ConfigError(self.errors[0])
        if self.errors:
            raise ConfigError(f"{len(self.errors)} config key problems:\n  - " + "\n  - ".join(self.errors))
