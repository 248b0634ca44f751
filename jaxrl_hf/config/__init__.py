"""Run configuration: dataclass schema with verl key names, YAML layers, dotted overrides, validation.

``load_config(algo, preset=None, overrides=())`` -> ``RunConfig`` (validated, derived defaults filled).
Errors are ``ConfigError`` naming the dotted key and listing the valid keys or values.
"""

from jaxrl_hf.config.build import ConfigError, build_dataclass, coerce, valid_keys
from jaxrl_hf.config.loader import (KEY_ALIASES, apply_overrides, canonical_key, config_dir, config_from_dict,
                                    dump_config, load_config, load_config_with_report, merge_layer, parse_override,
                                    preset_path, read_yaml)
from jaxrl_hf.config.resolve import critic_enabled, resolve_defaults
from jaxrl_hf.config.schema import ALGOS, RunConfig
from jaxrl_hf.config.validate import check_batch_arithmetic, train_dp_size, validate_config

__all__ = [
    "ALGOS", "ConfigError", "KEY_ALIASES", "RunConfig", "apply_overrides", "build_dataclass", "canonical_key",
    "check_batch_arithmetic", "coerce", "config_dir", "config_from_dict", "critic_enabled", "dump_config",
    "load_config", "load_config_with_report", "merge_layer", "parse_override", "preset_path", "read_yaml", "resolve_defaults",
    "train_dp_size", "valid_keys", "validate_config",
]
