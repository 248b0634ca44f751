"""docs/ARCHITECTURE.md's examples run as written: each ```python block is executed in order, in one namespace
(a block that stops working fails here, so the doc's four seams stay true)."""

from __future__ import annotations

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python_blocks() -> list[str]:
    with open(os.path.join(REPO, "docs", "ARCHITECTURE.md")) as fh:
        return re.findall(r"```python\n(.*?)```", fh.read(), flags=re.S)


def test_every_seam_has_an_example():
    blocks = _python_blocks()
    assert len(blocks) == 4
    for needle in ("load_config", "register_adv_estimator", "register_rollout_loop", "register_rule_set"):
        assert sum(needle in b for b in blocks) == 1, needle


@pytest.fixture(scope="module")
def doc_namespace() -> dict:
    """The namespace after running every block once (a registration cannot run twice)."""
    namespace: dict = {}
    for i, block in enumerate(_python_blocks()):
        exec(compile(block, f"docs/ARCHITECTURE.md[python block {i}]", "exec"), namespace)  # noqa: S102
    return namespace


def test_examples_run(doc_namespace):
    for name in ("config", "doc_mean_baseline", "SingleTurnTwice", "MLP_OVER_DP"):
        assert name in doc_namespace


def test_registered_names_are_valid_config_values(doc_namespace):
    """What the examples registered is valid by name in a config (validated against the registries)."""
    from jaxrl_hf.config import load_config

    config = load_config("grpo", preset="smoke", overrides=[
        "algorithm.adv_estimator=doc_mean_baseline", "rollout.loop=doc_single_turn_twice",
        "actor.strategy=doc_mlp_over_dp"])
    assert (config.algorithm.adv_estimator, config.rollout.loop, config.actor.strategy) == (
        "doc_mean_baseline", "doc_single_turn_twice", "doc_mlp_over_dp")
