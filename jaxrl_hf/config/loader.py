"""Load a run config: embedded defaults <- ``configs/<algo>.yaml`` <- presets <- ``a.b=c`` overrides.

``load_config("dapo", preset="smoke", overrides=["actor.clip_ratio_high=0.28"])`` returns a validated,
fully resolved ``RunConfig``; the modules in its ``imports`` are imported first (they may register names the
config uses). Every layer is checked key by key against the schema, so a typo in a YAML
file or on the command line fails with the file/argument, the dotted key and the valid keys there.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Union

import yaml

from jaxrl_hf.config.build import ConfigError, build_dataclass, field_types
from jaxrl_hf.config.resolve import resolve_defaults
from jaxrl_hf.config.schema import ALGOS, RunConfig
from jaxrl_hf.config.validate import validate_config
from jaxrl_hf.user_modules import UserModuleError, import_user_modules

# verl spellings accepted on the command line / in YAML, mapped to this schema's keys.
KEY_ALIASES: dict[str, str] = {
    "actor_rollout_ref.actor": "actor",
    "actor_rollout_ref.rollout": "rollout",
    "actor_rollout_ref.ref": "ref",
    "actor_rollout_ref.model": "model",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.default_local_dir": "trainer.run_dir",
}


def config_dir() -> Path:
    """``$JAXRL_HF_CONFIG_DIR``, else the installed package's ``jaxrl_hf/configs`` (a wheel ships the
    repository's ``configs/`` there: pyproject.toml ``package-dir``), else the checkout's ``configs/``."""
    env = os.environ.get("JAXRL_HF_CONFIG_DIR")
    if env:
        return Path(env)
    package = Path(__file__).resolve().parents[1]
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


def canonical_key(key: str) -> str:
    """Map a verl alias prefix (``actor_rollout_ref.actor.x``) to this schema's key (``actor.x``)."""
    for alias, target in sorted(KEY_ALIASES.items(), key=lambda kv: -len(kv[0])):
        if key == alias or key.startswith(alias + "."):
            return target + key[len(alias) :]
    return key


def _section_type(tp: Any) -> Any:
    """The dataclass inside ``Optional[...]`` (or ``tp`` itself)."""
    if typing.get_origin(tp) in (Union, getattr(__import__("types"), "UnionType")):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return tp


def _check_path(parts: Sequence[str], source: str) -> bool:
    """Check a dotted key against the schema; returns True when it ends inside a free-form dict field."""
    cls: Any = RunConfig
    for depth, part in enumerate(parts):
        if not dataclasses.is_dataclass(cls):
            if typing.get_origin(cls) is dict or cls is dict:
                return True
            parent = ".".join(parts[:depth])
            raise ConfigError(f"{source}: config key '{parent}' is a value, not a section; cannot set '{'.'.join(parts)}'")
        types_ = field_types(cls)
        if part not in types_:
            parent = ".".join(parts[:depth])
            where = f"under '{parent}'" if parent else "at the top level"
            raise ConfigError(
                f"{source}: unknown config key '{'.'.join(parts)}'; valid keys {where}: {list(types_)}"
            )
        cls = _section_type(types_[part])
    return False


def is_known_key(key: str) -> bool:
    """Whether the dotted ``key`` (verl aliases allowed) names a field of the schema (or a key inside a free-form
    mapping field)."""
    try:
        _check_path(tuple(canonical_key(key).split(".")), "key")
    except ConfigError:
        return False
    return True


def schema_keys(cls: Any = RunConfig, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the schema (sections expanded, free-form mappings as their own key)."""
    out: list[str] = []
    for name, tp in field_types(cls).items():
        section = _section_type(tp)
        if dataclasses.is_dataclass(section):
            out += schema_keys(section, f"{prefix}{name}.")
        else:
            out.append(f"{prefix}{name}")
    return out


def merge_layer(base: dict[str, Any], layer: dict[str, Any], source: str, prefix: tuple[str, ...] = ()) -> None:
    """Deep-merge ``layer`` into ``base`` in place, checking every key against the schema."""
    if not isinstance(layer, dict):
        raise ConfigError(f"{source}: expected a mapping at '{'.'.join(prefix) or '<root>'}', got {layer!r}")
    for raw_key, value in layer.items():
        key = str(raw_key)
        parts = tuple(canonical_key(".".join((*prefix, key))).split("."))
        free_form = _check_path(parts, source)
        target = base
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        if isinstance(value, dict) and isinstance(target.get(parts[-1]), dict) and not free_form:
            merge_layer(base, value, source, parts)
        else:
            target[parts[-1]] = copy.deepcopy(value)


def parse_override(text: str) -> tuple[str, str]:
    """``"a.b=c"`` -> ``("a.b", "c")`` (the value stays a string; the schema coerces it)."""
    key, sep, value = text.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form key.path=value (e.g. actor.optim.lr=1e-6)")
    return key, value


def apply_overrides(base: dict[str, Any], overrides: Iterable[str]) -> None:
    """Apply dotted ``key=value`` overrides to the nested dict ``base`` in place."""
    for text in overrides:
        key, value = parse_override(text)
        parts = canonical_key(key).split(".")
        free_form = _check_path(parts, f"override {text!r}")
        target = base
        for part in parts[:-1]:
            nxt = target.get(part)
            if not isinstance(nxt, dict):
                nxt = {}
                target[part] = nxt
            target = nxt
        if free_form:
            value = yaml.safe_load(value) if value else value
        target[parts[-1]] = value


def inherit_critic_model(data: dict[str, Any]) -> None:
    """A ``critic.model`` section given in part (e.g. only verl's ``critic.model.use_remove_padding``) takes its
    other keys, ``path`` included, from ``model`` (verl: the critic's model defaults to the actor's), in place."""
    partial = (data.get("critic") or {}).get("model")
    if not isinstance(partial, dict):
        return

    def overlay(base: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
        for key, value in layer.items():
            base[key] = overlay(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) \
                else value
        return base

    data["critic"]["model"] = overlay(copy.deepcopy(data["model"]), partial)


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file as a dict (an empty file is ``{}``); errors name the file."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def preset_path(name: str) -> Path:
    """``configs/presets/<name>.yaml`` or a path to a YAML file; unknown names list the available presets."""
    candidate = Path(name)
    if candidate.suffix in (".yaml", ".yml") and candidate.is_file():
        return candidate
    path = config_dir() / "presets" / f"{name}.yaml"
    if not path.is_file():
        available = sorted(p.stem for p in (config_dir() / "presets").glob("*.yaml"))
        raise ConfigError(f"unknown preset {name!r}; available presets: {available} (or pass a path to a .yaml file)")
    return path


def load_config(algo: str, preset: str | Sequence[str] | None = None, overrides: Iterable[str] = (),
                imports: Iterable[str] = ()) -> RunConfig:
    """The validated ``RunConfig`` for ``algo`` with ``preset`` (name, comma list or paths) and overrides.

    ``imports`` (``launch/train.py --import``) are added to the config's ``imports``; all of them are imported
    before the config is validated (`import_config_modules`)."""
    if algo not in ALGOS:
        raise ConfigError(f"unknown algorithm {algo!r}; valid: {list(ALGOS)}")
    data = RunConfig(algo=algo).to_dict()
    algo_file = config_dir() / f"{algo}.yaml"
    if not algo_file.is_file():
        raise ConfigError(f"missing algorithm config {algo_file}")
    merge_layer(data, read_yaml(algo_file), str(algo_file))
    presets = [p for p in (preset.split(",") if isinstance(preset, str) else (preset or [])) if p]
    for name in presets:
        path = preset_path(name.strip())
        merge_layer(data, read_yaml(path), str(path))
    apply_overrides(data, list(overrides))
    inherit_critic_model(data)
    if data.get("algo") != algo:
        raise ConfigError(f"config key 'algo' is {data.get('algo')!r} but --algo is {algo!r}; set the algorithm with --algo")
    config = build_dataclass(RunConfig, data)
    config = import_config_modules(dataclasses.replace(config, imports=[*config.imports, *imports]))
    config = resolve_defaults(config)
    validate_config(config)
    return config


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """A validated ``RunConfig`` from a full nested dict (e.g. a run's saved ``config.yaml``)."""
    config = resolve_defaults(import_config_modules(build_dataclass(RunConfig, copy.deepcopy(data))))
    validate_config(config)
    return config


def import_config_modules(config: RunConfig) -> RunConfig:
    """Import ``config.imports`` in this process (what they register becomes valid config values); returns the
    config with each entry in canonical form (``.py`` paths absolute), as the worker processes import them."""
    try:
        imports = import_user_modules(config.imports)
    except UserModuleError as err:
        raise ConfigError(f"{err} (from --import or the config key 'imports')") from None
    return dataclasses.replace(config, imports=imports)


def dump_config(config: RunConfig, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (``run_dir/config.yaml``)."""
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(config.to_dict(), fh, sort_keys=False)
