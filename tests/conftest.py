import os

# SPMD tests need several devices; must be set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402


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
def trainer_session(tmp_path_factory):
    """For modules that run the trainer in-process: one persistent XLA compilation cache (runs after the first
    reuse the tiny model's compiled programs) and Ray shut down after the module (each run still starts its own
    worker processes). Use with ``pytestmark = [..., pytest.mark.usefixtures("trainer_session")]``."""
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path_factory.mktemp("xla_cache"))
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    yield
    import ray

    if ray.is_initialized():
        ray.shutdown()
