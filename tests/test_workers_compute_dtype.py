"""``model.dtype=auto``: the faster compute dtype of the host, from the same cached matmul rates as the MFU peak
(`jaxrl_hf.workers.peak_flops`), resolved once in the driver; and the MFU peak is the best rate in any dtype."""

from __future__ import annotations

import json

import jax
import pytest

from jaxrl_hf.config import load_config
from jaxrl_hf.trainer.run import resolved_compute_dtype
from jaxrl_hf.workers import peak_flops


@pytest.fixture
def rates(tmp_path, monkeypatch):
    """A peak cache holding the given rates for this host's CPU (nothing is measured)."""
    path = tmp_path / "peak.json"
    monkeypatch.setenv(peak_flops.CACHE_ENV, str(path))

    def write(float32: float, bfloat16: float) -> None:
        device = jax.devices("cpu")[0]
        path.write_text(json.dumps({peak_flops.machine_key(device, "float32"): float32,
                                    peak_flops.machine_key(device, "bfloat16"): bfloat16}))
    return write


@pytest.mark.parametrize("f32, bf16, expected", [(2.3e11, 1.3e11, "float32"), (2.2e11, 3.6e11, "bfloat16")],
                         ids=["no_fast_bf16", "avx512_bf16"])
def test_auto_takes_the_faster_dtype_of_the_host(rates, f32, bf16, expected):
    rates(f32, bf16)
    dtype, why = peak_flops.resolve_compute_dtype("auto", accelerator=False)
    assert dtype == expected and "GFLOP/s" in why
    assert peak_flops.resolve_compute_dtype("auto", accelerator=True)[0] == "bfloat16"
    assert peak_flops.resolve_compute_dtype("float32", accelerator=False) == ("float32", "as configured")
    config = load_config("dapo", overrides=["trainer.device=cpu"])
    assert config.model.dtype == "auto"  # the recipe leaves it to the host
    assert resolved_compute_dtype(config).model.dtype == expected


def test_the_mfu_peak_is_the_best_rate_in_any_dtype(rates):
    from _models_helpers import random_params, tiny_config

    rates(2.3e11, 1.3e11)
    config = tiny_config()
    summary = peak_flops.mfu_summary(config.replace(dtype="bfloat16"), random_params(config), None, 1)
    assert summary["peak_flops_per_device"] == pytest.approx(2.3e11 / jax.local_device_count())
