"""Each GPU's memory budget (`jaxrl_hf.config.memory_budget`): the numbers derived from the config and the
environment, the load-time check naming the keys, and the variables reaching real Ray worker processes before
JAX starts in them."""

from __future__ import annotations

import os
import sys
import types

import pytest
import ray

import _host_malloc_helpers
from _host_malloc_helpers import faults_allocating_64mib_again
from jaxrl_hf.config import ConfigError, load_config
from jaxrl_hf.config.build import build_dataclass
from jaxrl_hf.config.loader import apply_overrides
from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.config.host_malloc import ENV_GLIBC_TUNABLES, KEEP_FREED_MEMORY
from jaxrl_hf.config.memory_budget import (DEFAULT_VLLM_GPU_SHARE, ENV_ALLOCATOR, ENV_MEM_FRACTION, ENV_PREALLOCATE,
                                           check_memory_budget, memory_budget, worker_env)
from jaxrl_hf.controller import Dispatch, Worker, WorkerGroup, register

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
ray.cloudpickle.register_pickle_by_value(_host_malloc_helpers)  # Ray workers need not import tests/
NO_ENV: dict[str, str] = {}


def _config(*overrides):
    return load_config("grpo", "smoke", list(overrides))


def _unchecked(*overrides):
    """The smoke config with ``overrides`` applied but not validated (so the budget check itself is tested)."""
    data = load_config("grpo", "smoke").to_dict()
    apply_overrides(data, list(overrides))
    return build_dataclass(RunConfig, data)


def test_vllm_colocated_gets_its_share_and_jax_the_rest_minus_the_margin():
    budget = memory_budget(_config("rollout.name=vllm", "rollout.gpu_memory_utilization=0.6"), NO_ENV)
    assert (budget.vllm_share, budget.jax_fraction, budget.margin) == (0.6, 0.35, 0.05)
    assert budget.env() == {ENV_MEM_FRACTION: "0.35", ENV_PREALLOCATE: "false"}
    text = budget.describe()
    assert "vLLM 0.60 (rollout.gpu_memory_utilization)" in text and "JAX up to 0.35" in text
    # verl's key spelling is the same setting
    verl = memory_budget(_config("rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6"), NO_ENV)
    assert verl == budget


def test_defaults_native_engine_and_pools_without_vllm():
    from jaxrl_hf.rollout.vllm_engine import VllmOptions

    assert DEFAULT_VLLM_GPU_SHARE == VllmOptions().gpu_memory_utilization  # the engine's own default
    default_vllm = memory_budget(_config("rollout.name=vllm"), NO_ENV)
    assert (default_vllm.vllm_share, default_vllm.jax_fraction) == (0.5, 0.45)
    native = memory_budget(_config(), NO_ENV)  # rollout.name=jax: JAX alone on the GPU
    assert (native.vllm_share, native.jax_fraction) == (None, 0.95)
    # a critic / reward pool of its own holds no vLLM even when the actor's rollout is vLLM
    assert worker_env(_config("rollout.name=vllm"), vllm_colocated=False, environ=NO_ENV)[ENV_MEM_FRACTION] == "0.95"


def test_explicit_settings_and_environment_win():
    config = _config("rollout.name=vllm", "placement.memory.jax_fraction=0.3", "placement.memory.preallocate=true")
    budget = check_memory_budget(config, NO_ENV)
    assert (budget.jax_fraction, budget.preallocate, budget.jax_source) == (0.3, True, "placement.memory.jax_fraction")
    env = {ENV_MEM_FRACTION: "0.2", ENV_PREALLOCATE: "false"}
    from_env = check_memory_budget(config, env)
    assert (from_env.jax_fraction, from_env.preallocate) == (0.2, False)
    assert from_env.jax_source == f"environment {ENV_MEM_FRACTION}"
    platform = memory_budget(_config("rollout.name=vllm", "placement.memory.allocator=platform"), NO_ENV)
    assert platform.jax_fraction is None and platform.env() == {ENV_ALLOCATOR: "platform", ENV_PREALLOCATE: "false"}


@pytest.mark.parametrize("overrides, environ, names", [
    (("rollout.name=vllm", "rollout.gpu_memory_utilization=0.6", "placement.memory.jax_fraction=0.5"), {},
     ("rollout.gpu_memory_utilization'=0.6", "placement.memory.jax_fraction'=0.5", "1.1", "0.95")),
    (("rollout.name=vllm",), {ENV_MEM_FRACTION: "0.75"},  # JAX's own default fraction next to vLLM's 0.5
     ("rollout.gpu_memory_utilization'=0.5", f"environment variable {ENV_MEM_FRACTION}=0.75")),
    (("rollout.name=vllm", "rollout.gpu_memory_utilization=0.97"), {},
     ("rollout.gpu_memory_utilization'=0.97", "placement.memory.margin'=0.05", "leave no GPU memory for JAX")),
    (("rollout.name=vllm", "rollout.gpu_memory_utilization=0.9", "placement.memory.margin=0.2"), {},
     ("leave no GPU memory for JAX",)),
    (("rollout.name=vllm", "rollout.gpu_memory_utilization=1.5"), {}, ("rollout.gpu_memory_utilization'=1.5",)),
    (("placement.memory.jax_fraction=0",), {}, ("placement.memory.jax_fraction'=0",)),
    ((), {ENV_MEM_FRACTION: "most"}, (f"{ENV_MEM_FRACTION}='most'",)),
])
def test_over_budget_is_an_error_naming_the_keys(overrides, environ, names):
    config = _unchecked(*overrides)
    with pytest.raises(ConfigError) as err:
        check_memory_budget(config, environ)
    for name in names:
        assert name in str(err.value), (name, str(err.value))


def test_load_config_checks_the_budget(monkeypatch):
    monkeypatch.delenv(ENV_MEM_FRACTION, raising=False)
    with pytest.raises(ConfigError, match="rollout.gpu_memory_utilization'=0.7.*placement.memory.jax_fraction'=0.4"):
        _config("rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.7",
                "placement.memory.jax_fraction=0.4")
    monkeypatch.setenv(ENV_MEM_FRACTION, "0.9")
    with pytest.raises(ConfigError, match=f"environment variable {ENV_MEM_FRACTION}=0.9"):
        _config("rollout.name=vllm")


class EnvReport(Worker):
    """Reports what its process sees: the budget variables, JAX's backend, and whether glibc keeps freed
    memory (its tunables are read when the process starts: a later ``os.environ`` change would be too late)."""

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def report(self) -> dict:
        import jax

        return {"env": {k: os.environ.get(k) for k in (ENV_MEM_FRACTION, ENV_PREALLOCATE, ENV_ALLOCATOR)},
                "backend": jax.default_backend(), "glibc_tunables": os.environ.get(ENV_GLIBC_TUNABLES),
                "faults_allocating_64mib_again": faults_allocating_64mib_again()}


def test_budget_reaches_every_worker_process_before_jax(ray_cluster, monkeypatch):
    """The pool built from the config (`make_pool`) hands the budget to its Ray processes' runtime_env; JAX
    reads these variables when its backend starts, so they must be there at process start."""
    from jaxrl_hf.trainer.preflight import check_pool_backend
    from jaxrl_hf.trainer.roles import make_pool

    monkeypatch.delenv(ENV_MEM_FRACTION, raising=False)
    monkeypatch.delenv(ENV_GLIBC_TUNABLES, raising=False)
    config = _config("rollout.name=vllm", "rollout.gpu_memory_utilization=0.6", "placement.num_processes=2",
                     "placement.train.dp=2", "trainer.device=cpu")
    pool = make_pool(config, "budget")
    try:
        reports = WorkerGroup(pool, EnvReport).report()
        assert len(reports) == 2
        for report in reports:
            assert report["env"] == {ENV_MEM_FRACTION: "0.35", ENV_PREALLOCATE: "false", ENV_ALLOCATOR: None}
            assert report["backend"] == "cpu"
            assert report["glibc_tunables"] == KEEP_FREED_MEMORY  # host_malloc=auto on a CPU pool ...
            assert report["faults_allocating_64mib_again"] < 1024  # ... and in effect (16 Ki faults without)
        assert [info["backend"] for info in pool.process_info] == ["cpu", "cpu"]
        assert pool.platform == "cpu"  # trainer.device=cpu
        check_pool_backend(pool)  # a CPU pool on CPU: fine
    finally:
        pool.shutdown()


def test_gpu_pool_whose_jax_is_on_the_cpu_is_an_error():
    """The check run after a pool starts; a GPU pool cannot start here, so its facts are given as such."""
    from jaxrl_hf.trainer.preflight import PreflightError, check_pool_backend

    pool = types.SimpleNamespace(platform="gpu", name="actor",
                                 process_info=[{"backend": "gpu", "node_ip": "10.0.0.1"},
                                               {"backend": "cpu", "node_ip": "10.0.0.2"}])
    with pytest.raises(PreflightError, match="pool 'actor' rank 1 on node 10.0.0.2.*backend there is 'cpu'.*"
                                             "JAXRL_HF_ACCEL=cuda"):
        check_pool_backend(pool)
    pool.process_info[1]["backend"] = "gpu"
    check_pool_backend(pool)


def test_float32_models_ask_every_worker_for_float32_matmuls(monkeypatch):
    """XLA:GPU runs float32 dots on TF32 by default (measured on an H200: log-probs 6e-3 from transformers'
    float32); a float32 run sets JAX_DEFAULT_MATMUL_PRECISION=highest, which every pool process receives."""
    from jaxrl_hf.controller.node_placement import forwarded_env
    from jaxrl_hf.trainer.run import MATMUL_PRECISION_ENV, enable_float32_matmuls

    monkeypatch.delenv(MATMUL_PRECISION_ENV, raising=False)
    enable_float32_matmuls("bfloat16")
    assert MATMUL_PRECISION_ENV not in os.environ
    enable_float32_matmuls("float32")
    assert os.environ[MATMUL_PRECISION_ENV] == "highest"
    assert forwarded_env()[MATMUL_PRECISION_ENV] == "highest"
    monkeypatch.setenv(MATMUL_PRECISION_ENV, "tensorfloat32")  # the user's own choice wins
    enable_float32_matmuls("float32")
    assert os.environ[MATMUL_PRECISION_ENV] == "tensorfloat32"
