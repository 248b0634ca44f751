"""What glibc does with a freed large block in this process: the check shared by the allocator tests (run in a
subprocess started with or without the tunables, and inside real Ray worker processes)."""

from __future__ import annotations


def faults_allocating_64mib_again() -> int:
    """Minor page faults of malloc'ing and filling 64 MiB after the same size was freed three times: 16 Ki
    pages when glibc maps a fresh block, ~0 when the tunables of `jaxrl_hf.config.host_malloc` are in effect.
    (libc's malloc itself: numpy asks for huge pages on large arrays, which hides the difference.)"""
    import ctypes
    import resource

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def fill_and_free() -> None:
        block = libc.malloc(64 << 20)
        ctypes.memset(block, 1, 64 << 20)
        libc.free(block)

    for _ in range(3):
        fill_and_free()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fill_and_free()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
