"""``placement.memory.host_malloc`` (`jaxrl_hf.config.host_malloc`): which processes get the glibc tunables, that
the driver's own ``GLIBC_TUNABLES`` wins, the config error for a bad value, and what the tunables do to a real
process: a freed large block is reused instead of being faulted in and zeroed again on every allocation."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

from jaxrl_hf.config import ConfigError, load_config
from jaxrl_hf.config.host_malloc import (ENV_GLIBC_TUNABLES, KEEP_FREED_MEMORY, describe_host_malloc,
                                         host_malloc_env)

_FAULTS = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
           "from _host_malloc_helpers import faults_allocating_64mib_again as f; print(json.dumps(f()))")


def test_modes_pick_which_processes_get_the_tunables():
    keep = {ENV_GLIBC_TUNABLES: KEEP_FREED_MEMORY}
    assert host_malloc_env("auto", {}) == ({}, keep)  # CPU pools only
    assert host_malloc_env("reuse", {}) == (keep, {})  # every pool
    assert host_malloc_env("system", {}) == ({}, {})
    assert "glibc.malloc.arena_max=1" in KEEP_FREED_MEMORY and "glibc.malloc.mmap_max=0" in KEEP_FREED_MEMORY
    own = {ENV_GLIBC_TUNABLES: "glibc.malloc.arena_max=2"}  # the user's own setting is forwarded and wins
    for mode in ("auto", "reuse", "system"):
        assert host_malloc_env(mode, own) == (own, {})
    with pytest.raises(ValueError, match="'sometimes'"):
        host_malloc_env("sometimes", {})


def test_the_doctors_line_says_what_each_pool_gets_and_whether_glibc_reads_it():
    glibc = ("glibc", "2.36")
    assert describe_host_malloc("auto", {}, glibc) == (
        f"host allocator (placement.memory.host_malloc=auto): pools on CPUs get GLIBC_TUNABLES={KEEP_FREED_MEMORY} "
        "(XLA's freed buffers reused); C library: glibc 2.36")
    assert "every pool gets GLIBC_TUNABLES=x=1 (the driver's own)" in describe_host_malloc(
        "system", {ENV_GLIBC_TUNABLES: "x=1"}, glibc)
    assert "glibc's defaults" in describe_host_malloc("system", {}, glibc)
    assert "musl, not glibc: the tunables do nothing" in describe_host_malloc("reuse", {}, ("musl", ""))


def test_config_key_default_and_bad_value():
    assert load_config("dapo").placement.memory.host_malloc == "auto"
    assert load_config("dapo", None, ["placement.memory.host_malloc=system"]).placement.memory.host_malloc == "system"
    with pytest.raises(ConfigError, match="placement.memory.host_malloc"):
        load_config("dapo", None, ["placement.memory.host_malloc=sometimes"])


def test_pools_from_the_config_carry_the_tunables(monkeypatch):
    """`make_pool` puts them where the mode says (the start-up itself: test_gpu_memory_budget's pool test)."""
    from jaxrl_hf.trainer.roles import make_pool

    monkeypatch.delenv(ENV_GLIBC_TUNABLES, raising=False)
    auto = make_pool(load_config("grpo", "smoke"), "auto")
    assert ENV_GLIBC_TUNABLES not in auto.env_vars and auto.cpu_env_vars == {ENV_GLIBC_TUNABLES: KEEP_FREED_MEMORY}
    system = make_pool(load_config("grpo", "smoke", ["placement.memory.host_malloc=system"]), "system")
    assert ENV_GLIBC_TUNABLES not in system.env_vars and system.cpu_env_vars == {}


def _faults_in_a_process(tunables: str | None) -> float:
    env = {k: v for k, v in os.environ.items() if k != ENV_GLIBC_TUNABLES}
    if tunables is not None:
        env[ENV_GLIBC_TUNABLES] = tunables
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _FAULTS, here], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_tunables_stop_a_freed_block_from_being_faulted_in_again():
    """glibc serves a 64 MiB block with a fresh mmap and unmaps it when freed: 16 Ki pages faulted (and zeroed)
    per allocation. With the tunables the freed block stays in the heap and the next allocation reuses it. (A
    jitted call's output buffer showed the same in a quiet process but not always under the test suite, where
    JAX's asynchronous frees can interleave; the effect on XLA's temporaries is measured by
    bench_host_malloc.py (removed; docs/perf_log/2026-11.md).)"""
    system = _faults_in_a_process(None)
    reuse = _faults_in_a_process(KEEP_FREED_MEMORY)
    page = os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError):  # transparent huge pages for every mapping: 2 MiB per fault
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as fh:
            page = 2 << 20 if "[always]" in fh.read() else page
    assert system > 0.9 * (64 << 20) / page, system
    assert reuse < 0.05 * system, (reuse, system)
