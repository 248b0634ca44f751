"""Two processes x 4 CPU devices under `jax.distributed` (gloo collectives): the same reshard works,
and where the layout allows the micro-DP all-gather stays inside one process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("mesh_multiprocess_worker.py")
CONFIGS = ["1-4-2->1-2", "2-2-2->1-2", "1-8-1->1-1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_reshard():
    address = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(WORKER.parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(i), "2", address, *CONFIGS], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"worker failed (rc {proc.returncode}):\n{err[-3000:]}"
            outputs.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rows in outputs:
        assert [r["config"] for r in rows] == CONFIGS
        for r in rows:
            assert r["num_devices"] == 8 and r["local_devices"] == 4
            assert r["shards_ok"] and r["round_trip"], r
            assert r["kinds"] == ["all-gather"]
            assert r["groups"] == r["micro_dp_groups"]
        by = {r["config"]: r for r in rows}
        M = by["1-4-2->1-2"]["param_bytes"]
        assert by["1-4-2->1-2"]["bytes"] == (2 - 1) * M / 4
        assert by["2-2-2->1-2"]["bytes"] == (2 - 1) * M / 4
        assert by["1-8-1->1-1"]["bytes"] == (8 - 1) * M / 8
        # micro-DP groups inside one training replica = inside one process here ...
        assert by["1-4-2->1-2"]["process_local"] and by["2-2-2->1-2"]["process_local"]
        # ... but d_g = 8 spans both processes and still works over gloo
        assert not by["1-8-1->1-1"]["process_local"]
