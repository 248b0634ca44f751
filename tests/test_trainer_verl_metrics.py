"""Our step metrics against verl 0.9.1's own ``metric_utils`` on the same batch (values, not only names): data
statistics with an aborted (empty) response among the rows, timing per token, throughput. The names a whole run
logs are checked by tests/test_trainer_e2e.py (PPO and GRPO)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_hf.controller import Batch
from jaxrl_hf.trainer.metrics import data_metrics, throughput_metrics, timing_metrics

torch = pytest.importorskip("torch")
pytest.importorskip("verl", reason="verl 0.9.1 (scripts/setup.sh installs it) is the reference")


def step_batch(lengths=(6, 3, 0, 1, 6), prompt_lengths=(5, 2, 4, 5, 3), width=6, prompt_width=5, seed=0) -> Batch:
    rng = np.random.default_rng(seed)
    b = len(lengths)
    response_mask = (np.arange(width)[None] < np.asarray(lengths)[:, None]).astype(np.float32)
    prompt_mask = (np.arange(prompt_width)[None] >= prompt_width - np.asarray(prompt_lengths)[:, None]).astype(np.int32)
    cols = {k: (rng.normal(size=(b, width)) * response_mask).astype(np.float32)
            for k in ("token_level_scores", "token_level_rewards", "advantages", "returns", "values")}
    return Batch.from_dict({
        "prompts": rng.integers(3, 50, (b, prompt_width)), "prompt_mask": prompt_mask,
        "responses": rng.integers(3, 50, (b, width)), "response_mask": response_mask,
        "attention_mask": np.concatenate([prompt_mask, response_mask.astype(np.int32)], 1), **cols})


def as_data_proto(batch: Batch):
    from verl import DataProto

    names = ("prompts", "responses", "attention_mask", "response_mask", "token_level_scores", "token_level_rewards",
             "advantages", "returns", "values")
    data = DataProto.from_single_dict({k: torch.as_tensor(np.asarray(batch[k])) for k in names})
    data.meta_info["global_token_num"] = np.asarray(batch["attention_mask"]).sum(-1).tolist()
    return data


def assert_same(ours: dict, verl: dict, names) -> None:
    for name in names:
        a, b = ours[name], float(verl[name])
        assert (np.isnan(a) and np.isnan(b)) or a == pytest.approx(b, rel=1e-6, abs=1e-6), (name, a, b)


@pytest.mark.parametrize("lengths", [(6, 3, 0, 1, 6), (0, 0, 0, 0, 0)], ids=["one_aborted", "all_aborted"])
def test_data_metrics_equal_verls_with_aborted_responses(lengths):
    from verl.trainer.ppo.metric_utils import compute_data_metrics

    batch = step_batch(lengths=lengths)
    verl = compute_data_metrics(as_data_proto(batch), use_critic=True)
    ours = data_metrics(batch, use_critic=True)
    if any(lengths):
        names = list(verl)
    else:  # nothing valid: verl's advantage/return/value statistics are NaN, ours absent (nothing to average)
        names = [n for n in verl if not n.startswith(("critic/advantages", "critic/returns", "critic/values",
                                                       "critic/vf_"))]
    assert_same(ours, verl, names)
    assert ours["response/aborted_ratio"] == sum(n == 0 for n in lengths) / len(lengths)


def test_timing_and_throughput_metrics_equal_verls():
    from verl.trainer.ppo.metric_utils import compute_throughout_metrics, compute_timing_metrics

    batch = step_batch()
    timings = {"gen": 2.0, "ref": 0.5, "values": 0.25, "adv": 0.01, "update_critic": 0.75, "update_actor": 1.5,
               "step": 6.0}
    data = as_data_proto(batch)
    verl = {**compute_timing_metrics(data, timings), **compute_throughout_metrics(data, timings, n_gpus=2)}
    ours = {**timing_metrics(timings, batch), **throughput_metrics(batch, timings, num_devices=2)}
    assert_same(ours, verl, verl)


def test_memory_metrics_read_the_device_allocator_where_it_counts(monkeypatch):
    """verl's ``<role>/perf/*`` memory names: the host's used memory everywhere; the device allocator's peaks from
    JAX's ``memory_stats()`` where the backend keeps them (a GPU's counters, given here as a GPU reports them)."""
    import jax

    from jaxrl_hf.workers import memory_metrics as mm

    host = mm.memory_metrics("actor/")
    assert 0 < host["actor/perf/cpu_memory_used_gb"] < 1e4
    if jax.local_devices()[0].memory_stats() is None:
        assert "actor/perf/max_memory_allocated_gb" not in host

    class Device:
        def memory_stats(self):
            return {"peak_bytes_in_use": 3 << 30, "bytes_limit": 70 << 30}

    monkeypatch.setattr(mm.jax, "local_devices", lambda: [Device()])
    gpu = mm.memory_metrics("critic/")
    assert gpu["critic/perf/max_memory_allocated_gb"] == 3.0 and gpu["critic/perf/max_memory_reserved_gb"] == 70.0
