"""Asynchronous training on a split placement (``placement.rollout.colocate=false``, ``trainer.max_staleness``),
end to end on the smoke preset with real Ray worker groups.

* ``max_staleness=0`` on a rollout group of its own logs exactly the synchronous (colocated) trainer's metrics:
  the rollout group samples the same tokens once it has the actor's weights after every update;
* ``max_staleness=1``: from step 2 on, each batch was generated one update behind while the actor trained
  (``async/staleness/mean`` = 1), the weights move to the rollout group through the object store (bytes =
  the model's f32 parameters), and truncated importance sampling is on by default;
* the configuration rules (staleness >= 0; π_old recomputed, since TIS is on; no hybrid generation layout).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxrl_hf.config import ConfigError, load_config
from jaxrl_hf.trainer.metrics import is_wall_clock_metric

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("trainer_session")]
SPLIT = "placement.rollout.colocate=false"


def train(run_dir, *overrides: str) -> list[dict]:
    from jaxrl_hf.trainer import run

    assert run("grpo", preset="smoke", overrides=[f"trainer.run_dir={run_dir}", "trainer.save_freq=0",
                                                  *overrides]) == 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("sync"))


def test_staleness_zero_on_a_split_group_equals_the_synchronous_trainer(sync_run, tmp_path):
    split = train(tmp_path, SPLIT)
    assert [r["step"] for r in split] == [r["step"] for r in sync_run] == [1, 2]
    for ours, reference in zip(split, sync_run):
        assert ours["async/staleness/mean"] == 0.0
        compared = [k for k in reference if not is_wall_clock_metric(k)]
        assert len(compared) > 30
        assert {k: ours[k] for k in compared} == {k: reference[k] for k in compared}


def test_staleness_one_overlaps_generation_with_training(sync_run, tmp_path):
    records = train(tmp_path, "trainer.max_staleness=1")  # implies the split group
    assert [r["async/staleness/mean"] for r in records] == [0.0, 1.0]
    second = records[1]
    num_params = second["perf/weight_sync_bytes"] / 4  # f32 weights of the tiny model, handed over once
    assert num_params == pytest.approx(sum(np.prod(s) for s in _tiny_param_shapes()))
    for key in ("timing_s/wait_rollout", "timing_s/wait_train", "timing_s/weight_sync_rollout"):
        assert second[key] >= 0.0
    # step 1 is synchronous (nothing was generated ahead): the same numbers as the synchronous trainer
    assert records[0]["critic/score/mean"] == sync_run[0]["critic/score/mean"]
    assert records[0]["response_length/mean"] == sync_run[0]["response_length/mean"]
    # step 2 sampled with the initial weights while the actor had one update: the sampler's and the actor's
    # log-probs now differ (TIS weighs them), where a synchronous step has them equal to float rounding
    assert abs(second["rollout_corr/ppl_ratio"] - 1.0) > 1e-5 > abs(sync_run[1]["rollout_corr/ppl_ratio"] - 1.0)
    with open(os.path.join(tmp_path, "config.yaml")) as fh:
        saved = fh.read()
    assert "level: token" in saved and "colocate: false" in saved


def _tiny_param_shapes() -> list[tuple[int, ...]]:
    import jax

    from jaxrl_hf.workers.common import load_model

    params = load_model(load_config("grpo", preset="smoke").model).params
    return [np.shape(x) for x in jax.tree.leaves(params)]


@pytest.mark.parametrize("overrides, fragments", [
    ([SPLIT, "trainer.max_staleness=-1"], ["trainer.max_staleness'=-1", ">= 0"]),
    ([SPLIT, "trainer.max_staleness=2", "actor.rollout_correction.bypass_mode=true"],
     ["bypass_mode", "nothing to correct"]),
    ([SPLIT, "placement.devices_per_process=2", "placement.generate.tp=1"], ["placement.generate", "colocated"]),
])
def test_async_configuration_errors_name_the_key(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        load_config("grpo", preset="smoke", overrides=overrides)
    for fragment in fragments:
        assert fragment in str(err.value)
