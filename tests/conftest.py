import os

# SPMD tests need several devices; must be set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _unoptimized_backend() -> None:
    """Compile the suite's programs with XLA's backend optimization level 0 (``XLA_FLAGS``, inherited by the
    xdist workers, Ray workers and subprocesses). The suite's models are tiny: LLVM's optimization passes are most
    of their compile time and save little of their run time (matrix products are library calls at any level).
    Comparisons within the suite are of programs compiled under the same flags, and those against references (numpy,
    transformers, vLLM) use tolerances of dtype and reduction size, which hold at any level. An explicit ``--xla_backend_optimization_level`` in ``XLA_FLAGS`` wins."""
    flags = os.environ["XLA_FLAGS"]
    if "--xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_backend_optimization_level=0"


_unoptimized_backend()


def _run_compilation_cache() -> None:
    """One persistent XLA compilation cache for the whole test run, made empty by the pytest process that starts
    the run and inherited by its xdist workers and every process they start (Ray workers, subprocesses of
    ``launch/*.py``): a program that several tests, modules or processes compile (the tiny models' forward, update
    and generation programs) is compiled once. A fresh directory per run, so a run's time does not depend on an
    earlier one; an explicit ``JAX_COMPILATION_CACHE_DIR`` wins."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxrl_hf_tests_xla_")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


_run_compilation_cache()


import pytest  # noqa: E402

PROCESS_MODULES = frozenset({
    # vLLM engines (in this process or a child)
    "test_rollout_vllm", "test_rollout_vllm_tp", "test_rollout_vllm_families", "test_rollout_multi_turn_vllm", "test_export_hf",
    "test_workers_hybrid_offload", "test_workers_multiprocess_rollout", "test_rollout_vllm_moe",
    # the trainer with its Ray workers, or in a subprocess
    "test_trainer_e2e", "test_trainer_async", "test_trainer_agent", "test_trainer_lora", "test_reliability_signals",
    "test_reliability_restore", "test_reliability_nonfinite", "test_reliability_worker", "test_reliability_bad_input",
    "test_config_verl_cli", "test_trainer_verl_format", "test_packaging", "test_user_imports",
    # Ray clusters of several worker processes
    "test_controller_multinode", "test_controller_failures", "test_controller_groups", "test_workers_groups",
    "test_rewards_prm", "test_gpu_doctor", "test_gpu_memory_budget", "test_controller_gpu_devices",
})
"""Test modules that start Ray clusters, vLLM engines or trainer processes, several GiB each. Under pytest-xdist's
``--dist loadfile`` (`make test` runs two workers) they form one unit of work, so one runs at a time beside the
in-process tests (`pytest_xdist_make_scheduler`). Benchmarks run at toy size in a subprocess without Ray or vLLM
(``test_bench_gpu``, ``test_bench_trl_grpo``) are not among them: they run beside this scope."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with the `PROCESS_MODULES` as one scope: each other module is a scope of its own (its
    tests and module-scoped fixtures on one worker). Other ``--dist`` modes: xdist's own scheduler."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndProcesses(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "processes" if os.path.splitext(os.path.basename(module))[0] in PROCESS_MODULES else module

    return ModulesAndProcesses(config, log)


@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray cluster for the module (started through the controller's own ``ensure_ray``); shut down only if
    this fixture started it, so an outer cluster is left alone."""
    import ray

    from jaxrl_hf.controller import ensure_ray

    started_here = not ray.is_initialized()
    ensure_ray()
    yield ray.get_runtime_context().gcs_address
    if started_here:
        ray.shutdown()


@pytest.fixture(scope="module")
def trainer_session():
    """For modules that run the trainer in-process: Ray shut down after the module (each run starts its own
    worker processes; the run's compilation cache, `_run_compilation_cache`, serves their programs). Use with
    ``pytestmark = [..., pytest.mark.usefixtures("trainer_session")]``."""
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()
