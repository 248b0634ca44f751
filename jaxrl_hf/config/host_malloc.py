"""How the C allocator of a CPU worker process treats the buffers XLA frees: returned to the kernel, or kept.

XLA:CPU allocates the temporaries of every executable call in one block (``posix_memalign``; ~1 GB for the
default run's actor update) and frees it when the call ends. glibc serves a block that large with a fresh
``mmap`` and gives it back with ``munmap``, so every call page-faults its whole working set in again and the
kernel zeroes every page (minor faults and system time in proportion to the working set, every call). Three glibc
tunables keep such memory for reuse instead:

* ``glibc.malloc.arena_max=1``: one arena, the ``brk`` heap (a block bigger than a thread arena's 64 MB heap
  would be ``mmap``-ed whatever the other settings);
* ``glibc.malloc.mmap_max=0``: no block is served by its own ``mmap``;
* ``glibc.malloc.trim_threshold``: the heap's free top is not returned to the kernel.

The price: a process keeps its high-water mark of host memory until it exits. ``placement.memory.host_malloc``
chooses: ``auto`` sets the tunables for pools whose JAX runs on CPUs (where these buffers are the device
memory), ``reuse`` for every pool, ``system`` never. A ``GLIBC_TUNABLES`` already in the driver's environment
wins. glibc reads the variable when a process starts, so it reaches the workers through Ray's ``runtime_env``
(`jaxrl_hf.trainer.roles.make_pool`); other C libraries ignore it. Pure: no JAX, no Ray.
"""

from __future__ import annotations

import platform
from collections.abc import Mapping

ENV_GLIBC_TUNABLES = "GLIBC_TUNABLES"
KEEP_FREED_MEMORY = ":".join((
    "glibc.malloc.arena_max=1",
    "glibc.malloc.mmap_max=0",
    f"glibc.malloc.trim_threshold={1 << 62}",
))
"""The ``GLIBC_TUNABLES`` value of ``host_malloc=reuse``."""
HOST_MALLOC_MODES = ("auto", "reuse", "system")


def host_malloc_env(mode: str, environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """``(every process, CPU processes only)``: the variables a pool's processes get for ``mode``.

    ``environ`` is the driver's environment: a ``GLIBC_TUNABLES`` there is forwarded as it is and wins."""
    if mode not in HOST_MALLOC_MODES:
        raise ValueError(f"host_malloc mode {mode!r} not in {HOST_MALLOC_MODES}")
    if ENV_GLIBC_TUNABLES in environ:
        return {ENV_GLIBC_TUNABLES: environ[ENV_GLIBC_TUNABLES]}, {}
    tunables = {ENV_GLIBC_TUNABLES: KEEP_FREED_MEMORY}
    return {"auto": ({}, tunables), "reuse": (tunables, {}), "system": ({}, {})}[mode]


def describe_host_malloc(mode: str, environ: Mapping[str, str], libc: tuple[str, str] | None = None) -> str:
    """One line for the doctor's report: what the worker processes' allocator gets, and whether the C library
    is glibc (``libc``: ``platform.libc_ver()``; other C libraries ignore the tunables)."""
    every, cpu_only = host_malloc_env(mode, environ)
    if every:
        source = " (the driver's own)" if ENV_GLIBC_TUNABLES in environ else ""
        what = f"every pool gets {ENV_GLIBC_TUNABLES}={every[ENV_GLIBC_TUNABLES]}{source}"
    elif cpu_only:
        what = f"pools on CPUs get {ENV_GLIBC_TUNABLES}={cpu_only[ENV_GLIBC_TUNABLES]} (XLA's freed buffers reused)"
    else:
        what = "glibc's defaults (freed blocks over 32 MB go back to the kernel)"
    name, version = libc if libc is not None else platform.libc_ver()
    c_library = f"glibc {version}" if name == "glibc" else f"{name or 'unknown'}, not glibc: the tunables do nothing"
    return f"host allocator (placement.memory.host_malloc={mode}): {what}; C library: {c_library}"


__all__ = ["ENV_GLIBC_TUNABLES", "HOST_MALLOC_MODES", "KEEP_FREED_MEMORY", "describe_host_malloc", "host_malloc_env"]
