"""verl's per-update memory metrics of a training role, under its names (``<role>/perf/...``, as verl's trainer
prefixes its workers' ``perf/*``):

* ``perf/max_memory_allocated_gb``, ``perf/max_memory_reserved_gb``: the device allocator's peak bytes in use and
  peak bytes reserved (JAX's ``Device.memory_stats()``: ``peak_bytes_in_use``; ``peak_bytes_reserved``, else
  ``bytes_limit``, the pool the allocator holds), GiB; only where the backend keeps such counters (GPUs, not
  XLA:CPU);
* ``perf/cpu_memory_used_gb``: the host's used memory, GiB (psutil's ``virtual_memory().used`` where psutil is
  installed, as verl reads it; else ``MemTotal − MemAvailable`` of ``/proc/meminfo``).
"""

from __future__ import annotations

import jax

GIB = float(1 << 30)


def host_memory_used_bytes() -> float | None:
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return float(psutil.virtual_memory().used)
    try:
        with open("/proc/meminfo") as fh:
            fields = {line.split(":")[0]: float(line.split()[1]) * 1024 for line in fh if ":" in line}
        return fields["MemTotal"] - fields["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        return None


def memory_metrics(prefix: str) -> dict[str, float]:
    """The metrics of the module docstring, each named ``prefix + 'perf/...'`` (e.g. ``prefix='actor/'``)."""
    out: dict[str, float] = {}
    stats = jax.local_devices()[0].memory_stats()
    if stats:
        out[f"{prefix}perf/max_memory_allocated_gb"] = float(stats.get("peak_bytes_in_use", 0)) / GIB
        reserved = stats.get("peak_bytes_reserved", stats.get("bytes_limit", 0))
        out[f"{prefix}perf/max_memory_reserved_gb"] = float(reserved) / GIB
    used = host_memory_used_bytes()
    if used is not None:
        out[f"{prefix}perf/cpu_memory_used_gb"] = used / GIB
    return out
