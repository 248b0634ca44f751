"""Config keys whose value is a name in a registry: the registries (``jaxrl_hf.registry.Registry``) are the only
lists of valid names, so a name registered by a module in ``imports`` is as valid as a built-in one.

``REGISTERED_KEYS`` maps a dotted config key to its registry as ``"module:ATTRIBUTE"``; the module is imported
when a config is validated (importing the config package stays free of JAX). Checking another key against a
registry is one more line in the table.
"""

from __future__ import annotations

import importlib
from typing import Any

from jaxrl_hf.config.build import ConfigError
from jaxrl_hf.registry import Registry

REGISTERED_KEYS: dict[str, str] = {
    "algorithm.adv_estimator": "jaxrl_hf.algos.advantages:ADV_ESTIMATORS",
    "actor.policy_loss.loss_mode": "jaxrl_hf.algos.policy_losses:POLICY_LOSSES",
    "algorithm.kl_penalty": "jaxrl_hf.algos.kl:KL_ESTIMATORS",
    "actor.kl_loss_type": "jaxrl_hf.algos.kl:KL_ESTIMATORS",
    "rollout.loop": "jaxrl_hf.rollout.loops:ROLLOUT_LOOPS",
    "actor.strategy": "jaxrl_hf.mesh.rule_sets:RULE_SETS",
    "critic.strategy": "jaxrl_hf.mesh.rule_sets:RULE_SETS",
    "model.attn_implementation": "jaxrl_hf.models.attention:ATTENTION_IMPLEMENTATIONS",
    "critic.model.attn_implementation": "jaxrl_hf.models.attention:ATTENTION_IMPLEMENTATIONS",
}
CHOICES_BESIDE_NAMES: dict[str, tuple[str, ...]] = {
    "model.attn_implementation": ("auto",),
    "critic.model.attn_implementation": ("auto",),
}
"""Values a key accepts that are not entries of its registry (``auto``: the run picks an entry)."""


def registry_for(key: str) -> Registry:
    """The registry named for ``key`` in `REGISTERED_KEYS` (its module imported on first use)."""
    module_name, _, attribute = REGISTERED_KEYS[key].partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def config_value(config: Any, key: str) -> Any:
    """The value at dotted ``key`` of a config dataclass (``"actor.policy_loss.loss_mode"``); ``None`` below an
    unset optional section (``critic.model``)."""
    for part in key.split("."):
        if config is None:
            return None
        config = getattr(config, part)
    return config


def check_registered_names(config: Any) -> None:
    """Every `REGISTERED_KEYS` value (unless null) must be registered; the error names the key, the registry's
    kind and its valid names."""
    for key in REGISTERED_KEYS:
        value = config_value(config, key)
        registry = registry_for(key)
        extra = CHOICES_BESIDE_NAMES.get(key, ())
        if value is not None and value not in registry and value not in extra:
            raise ConfigError(
                f"config key '{key}'={value!r}: not a registered {registry.kind}; valid names: "
                f"{[*extra, *registry.names()]} "
                "(a name registered by your own module needs --import FILE_OR_MODULE, or the config key 'imports')"
            )
