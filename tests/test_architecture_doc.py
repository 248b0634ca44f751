"""docs/ARCHITECTURE.md's examples run as written: each ```python block is executed in order, in one namespace,
in a fresh interpreter (what they register stays out of this test process's registries), and the names they
register are then valid config values (a block that stops working fails here, so the five seams stay true)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "ARCHITECTURE.md")

RUN_BLOCKS = '''
import re, sys
blocks = re.findall(r"```python\\n(.*?)```", open(sys.argv[1]).read(), flags=re.S)
namespace = {}
for i, block in enumerate(blocks):
    exec(compile(block, f"docs/ARCHITECTURE.md[python block {i}]", "exec"), namespace)
for name in ("config", "doc_mean_baseline", "SingleTurnTwice", "MLP_OVER_DP", "doc_eager_twice_halved"):
    assert name in namespace, name
from jaxrl_hf.config import load_config
config = load_config("grpo", preset="smoke", overrides=[
    "algorithm.adv_estimator=doc_mean_baseline", "rollout.loop=doc_single_turn_twice",
    "actor.strategy=doc_mlp_over_dp", "model.attn_implementation=doc_eager_twice_halved"])
assert (config.algorithm.adv_estimator, config.rollout.loop, config.actor.strategy,
        config.model.attn_implementation) == (
    "doc_mean_baseline", "doc_single_turn_twice", "doc_mlp_over_dp", "doc_eager_twice_halved")
print("examples ok:", len(blocks))
'''


def _python_blocks() -> list[str]:
    with open(DOC) as fh:
        return re.findall(r"```python\n(.*?)```", fh.read(), flags=re.S)


def test_every_seam_has_an_example():
    blocks = _python_blocks()
    assert len(blocks) == 5
    for needle in ("load_config", "register_adv_estimator", "register_rollout_loop", "register_rule_set",
                   "ATTENTION_IMPLEMENTATIONS.register"):
        assert sum(needle in b for b in blocks) == 1, needle


def test_examples_run_and_register_valid_config_names():
    proc = subprocess.run([sys.executable, "-c", RUN_BLOCKS, DOC], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "examples ok: 5" in proc.stdout
