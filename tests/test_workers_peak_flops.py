"""The measured peak FLOP/s behind perf/mfu/actor: a real matmul calibration, cached per machine."""

import json

import jax
import numpy as np
import pytest

from jaxrl_hf.workers import peak_flops as pf


def test_matmul_rate_is_a_plausible_flop_rate():
    rate = pf.matmul_rate(jax.local_devices()[0], np.float32, 256, repeats=2)
    assert 1e7 < rate < 1e14  # FLOP/s of any CPU this runs on; a unit slip (ms, n², ...) lands far outside


def test_peak_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(pf.CACHE_ENV, str(tmp_path / "peak.json"))
    monkeypatch.setitem(pf.MATMUL_SIZES, "cpu", (128,))
    device = jax.local_devices()[0]
    first = pf.peak_flops_per_device()
    cache = json.loads((tmp_path / "peak.json").read_text())
    assert list(cache) == [pf.machine_key(device, "float32")] and cache[pf.machine_key(device, "float32")] > 0
    # host devices share the host's cores: the per-device peak is the host's rate over the devices
    assert first == pytest.approx(cache[pf.machine_key(device, "float32")] / jax.local_device_count())
    (tmp_path / "peak.json").write_text(json.dumps({pf.machine_key(device, "float32"): 8e9}))
    assert pf.peak_flops_per_device(processes_per_host=2) == pytest.approx(8e9 / (2 * jax.local_device_count()))
    assert pf.peak_flops_per_device(5e12) == 5e12  # a configured peak is used as given
    pf.peak_flops_per_device(dtype="bfloat16")  # another dtype is another entry
    assert sorted(json.loads((tmp_path / "peak.json").read_text())) == sorted(
        [pf.machine_key(device, "float32"), pf.machine_key(device, "bfloat16")])


def test_a_damaged_cache_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv(pf.CACHE_ENV, str(tmp_path / "peak.json"))
    monkeypatch.setitem(pf.MATMUL_SIZES, "cpu", (128,))
    (tmp_path / "peak.json").write_text('{"torn')
    assert pf.peak_flops_per_device() > 0
    assert json.loads((tmp_path / "peak.json").read_text())
