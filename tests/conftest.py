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
