"""Load a run config: embedded defaults <- ``configs/<algo>.yaml`` [<- ``configs/laptop/<algo>.yaml``] <- presets
<- ``a.b=c`` overrides.

``configs/<algo>.yaml`` is the algorithm's recipe at its paper / verl sizing. The laptop layer holds the embedded
default run's sizing (a small model on a CPU); it is read only when the final ``model.path`` is one of
`LAPTOP_MODELS` (the default model or the tiny random one), so ``--algo dapo model.path=Qwen/Qwen2.5-32B`` gets the
recipe untouched.

``load_config("dapo", preset="smoke", overrides=["actor.clip_ratio_high=0.28"])`` returns a validated,
fully resolved ``RunConfig``; the modules in its ``imports`` are imported first (they may register names the
config uses). Every layer is checked key by key against the schema, so a typo in a YAML
file or on the command line fails with the file/argument, the dotted key and the valid keys there.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

from jaxrl_hf.config.build import ConfigError, build_dataclass
from jaxrl_hf.config.resolve import resolve_defaults
from jaxrl_hf.config.schema import ALGOS, RunConfig
from jaxrl_hf.config.schema_paths import check_path, is_schema_key, is_schema_section, schema_keys  # noqa: F401
from jaxrl_hf.config.validate import validate_config
from jaxrl_hf.config.verl_keys import KEY_ALIASES, KeyReport, canonical_key, classify_key  # noqa: F401
from jaxrl_hf.user_modules import UserModuleError, import_user_modules

LAPTOP_MODELS = ("smollm2-135m-instruct", "tiny-random")
"""``model.path`` values that read ``configs/laptop/<algo>.yaml`` (the embedded default model and the smoke one)."""


def config_dir() -> Path:
    """``$JAXRL_HF_CONFIG_DIR``, else the installed package's ``jaxrl_hf/configs`` (a wheel ships the
    repository's ``configs/`` there: pyproject.toml ``package-dir``), else the checkout's ``configs/``."""
    env = os.environ.get("JAXRL_HF_CONFIG_DIR")
    if env:
        return Path(env)
    package = Path(__file__).resolve().parents[1]
    installed = package / "configs"
    return installed if installed.is_dir() else package.parent / "configs"


def is_known_key(key: str) -> bool:
    """Whether the dotted ``key`` (verl aliases allowed) names a field of the schema (or a key inside a free-form
    mapping field)."""
    return is_schema_key(canonical_key(key))


def _set_key(base: dict[str, Any], key: str, value: Any, from_text: bool) -> None:
    """Set the dotted schema ``key`` in the nested dict ``base`` (a free-form mapping's text value is YAML-read)."""
    parts = key.split(".")
    free_form = check_path(parts, "")
    target = base
    for part in parts[:-1]:
        nxt = target.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            target[part] = nxt
        target = nxt
    if free_form and from_text:
        value = yaml.safe_load(value) if value else value
    target[parts[-1]] = copy.deepcopy(value)


def _apply_key(base: dict[str, Any], key: str, value: Any, source: str, report: KeyReport, from_text: bool) -> None:
    """Classify ``key=value`` (`jaxrl_hf.config.verl_keys.classify_key`), record it in ``report`` and set it."""
    verdict = classify_key(key, value)
    report.record(verdict, source)
    if verdict.kind == "set":
        _set_key(base, verdict.target, verdict.value, from_text and verdict.value is value)


def _flatten_layer(layer: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """``(dotted key, value)`` pairs of a YAML layer: mappings are descended into unless their key is a value
    field of the schema (a free-form mapping such as ``custom_reward_function.reward_kwargs`` is one value)."""
    out: list[tuple[str, Any]] = []
    for raw_key, value in layer.items():
        key = f"{prefix}{raw_key}"
        canon = canonical_key(key)
        if isinstance(value, dict) and value and (is_schema_section(canon) or not is_schema_key(canon)):
            out += _flatten_layer(value, key + ".")
        else:
            out.append((key, value))
    return out


def merge_layer(base: dict[str, Any], layer: dict[str, Any], source: str, report: KeyReport | None = None) -> None:
    """Deep-merge the YAML ``layer`` into ``base`` in place, every key checked; problems go to ``report`` (given)
    or are raised together at the end."""
    if not isinstance(layer, dict):
        raise ConfigError(f"{source}: expected a mapping at the top level, got {layer!r}")
    own = report if report is not None else KeyReport()
    for key, value in _flatten_layer(layer):
        _apply_key(base, key, value, source, own, from_text=False)
    if report is None:
        own.raise_errors()


def parse_override(text: str) -> tuple[str, str]:
    """``"a.b=c"`` -> ``("a.b", "c")`` (the value stays a string; the schema coerces it)."""
    key, sep, value = text.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form key.path=value (e.g. actor.optim.lr=1e-6)")
    return key, value


def apply_overrides(base: dict[str, Any], overrides: Iterable[str], report: KeyReport | None = None) -> None:
    """Apply dotted ``key=value`` overrides to the nested dict ``base`` in place; problems go to ``report``
    (given) or are raised together at the end."""
    own = report if report is not None else KeyReport()
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ConfigError as err:
            own.errors.append(str(err))
            continue
        _apply_key(base, key, value, f"override {text!r}", own, from_text=True)
    if report is None:
        own.raise_errors()


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


def load_config_with_report(algo: str, preset: str | Sequence[str] | None = None, overrides: Iterable[str] = (),
                            imports: Iterable[str] = (), check_paths: bool = True,
                            check_model: bool = True, laptop: bool | None = None) -> tuple[RunConfig, KeyReport]:
    """`load_config` and the `KeyReport` of its keys (verl keys renamed, accepted with no effect and why).

    Every key of every layer is checked before anything is raised: the ``ConfigError`` lists all unknown and
    unsupported keys at once. ``check_paths=False`` (``--dry-run``) skips the checks that files and directories
    exist (`jaxrl_hf.config.validate_paths`); ``check_model=False`` those against ``model.path``'s shape.
    ``laptop``: read ``configs/laptop/<algo>.yaml`` (True), not (False), or when the final ``model.path`` is one
    of `LAPTOP_MODELS` (None)."""
    if algo not in ALGOS:
        raise ConfigError(f"unknown algorithm {algo!r}; valid: {list(ALGOS)}")
    data = RunConfig(algo=algo).to_dict()
    algo_file = config_dir() / f"{algo}.yaml"
    if not algo_file.is_file():
        raise ConfigError(f"missing algorithm config {algo_file}")
    presets = [p for p in (preset.split(",") if isinstance(preset, str) else (preset or [])) if p]
    layers = [(source_name(algo_file), read_yaml(algo_file))]
    layers += [(source_name(path), read_yaml(path)) for path in (preset_path(name.strip()) for name in presets)]
    data, report = _merge_layers(data, layers, list(overrides))
    laptop_file = config_dir() / "laptop" / f"{algo}.yaml"
    if laptop is None:
        laptop = (data.get("model") or {}).get("path") in LAPTOP_MODELS
    if laptop and not report.errors and laptop_file.is_file():
        layers.insert(1, (source_name(laptop_file), read_yaml(laptop_file)))
        data, report = _merge_layers(RunConfig(algo=algo).to_dict(), layers, list(overrides))
    report.raise_errors()
    inherit_critic_model(data)
    if data.get("algo") != algo:
        raise ConfigError(f"config key 'algo' is {data.get('algo')!r} but --algo is {algo!r}; set the algorithm with --algo")
    try:
        config = build_dataclass(RunConfig, data)
        config = import_config_modules(dataclasses.replace(config, imports=[*config.imports, *imports]))
        config = resolve_defaults(config)
        validate_config(config, check_paths=check_paths, check_model=check_model)
    except ConfigError as err:
        origins = [f"'{target}' is verl's '{key}'" for key, target in report.renamed if f"'{target}'" in str(err)]
        raise ConfigError(f"{err} ({'; '.join(origins)})" if origins else str(err)) from None
    return config, report


def source_name(path: Path) -> str:
    """How a report names a config file: ``configs/...`` for the shipped ones, else the path as given."""
    try:
        return str(Path("configs") / path.resolve().relative_to(config_dir().resolve()))
    except ValueError:
        return str(path)


def _merge_layers(base: dict[str, Any], layers: list[tuple[str, dict[str, Any]]],
                  overrides: list[str]) -> tuple[dict[str, Any], KeyReport]:
    """``base`` with the YAML ``layers`` ((source, mapping), in order) and then the overrides merged in, and the
    report of every key."""
    report = KeyReport()
    for source, layer in layers:
        merge_layer(base, layer, source, report)
    apply_overrides(base, overrides, report)
    return base, report


def load_config(algo: str, preset: str | Sequence[str] | None = None, overrides: Iterable[str] = (),
                imports: Iterable[str] = (), check_model: bool = True, laptop: bool | None = None) -> RunConfig:
    """The validated ``RunConfig`` for ``algo`` with ``preset`` (name, comma list or paths) and overrides.

    ``imports`` (``launch/train.py --import``) are added to the config's ``imports``; all of them are imported
    before the config is validated (`import_config_modules`). verl keys accepted with no effect are logged as
    warnings, one each with its reason."""
    config, report = load_config_with_report(algo, preset, overrides, imports, check_model=check_model, laptop=laptop)
    for key, reason in report.ignored:
        logging.getLogger("jaxrl_hf.config").warning("config key '%s' is accepted but has no effect: %s", key, reason)
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
