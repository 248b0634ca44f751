"""The built-in ``python`` tool: runs the model's code in a separate, limited process.

Each call: a fresh temporary directory; a child ``sys.executable -I`` (isolated: no user site, no ``PYTHON*``
environment variables, an empty environment otherwise) with working directory ``scratch/`` inside it, started
in its own session and, where the kernel allows an unprivileged one, in a new network namespace
(``unshare --net``: no interface but a down loopback). Before the user's code the child
(`jaxrl_hf.agent.sandbox_child`) sets ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_FSIZE`` and installs an audit hook
refusing sockets, subprocesses, ``fork``/``exec``, ``ctypes``, raising limits, opening files for writing outside
``scratch/`` and reading outside it and the Python installation. The parent kills the session at the wall
timeout and returns at most ``max_output_chars`` of stdout + stderr; the directory is removed afterwards.

What it does not protect against (docs/AGENT.md): an audit hook is not a security boundary — code that
corrupts the interpreter's memory or finds a path the hook does not see may escape it; only the rlimits, the
process boundary, the environment and (when available) the network namespace are enforced by the kernel. Run
untrusted models' code inside a container or VM as well.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from jaxrl_hf.agent.sandbox_child import CHILD_SOURCE
from jaxrl_hf.agent.tools import ToolError, function_schema, register_tool


@functools.lru_cache(maxsize=1)
def network_namespace_prefix() -> tuple[str, ...]:
    """``("unshare", "--net", "--map-root-user")`` when an unprivileged network namespace can be made here."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        probe = subprocess.run([unshare, "--net", "--map-root-user", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return (unshare, "--net", "--map-root-user") if probe.returncode == 0 else ()


def _read_head(path: str, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", errors="replace"), len(data) > limit


@register_tool("python")
class PythonSandbox:
    """Runs the ``code`` argument (its stdout, or the last expression's value, is the answer)."""

    name = "python"
    schema = function_schema(
        "python", "Run Python code in a sandbox (no network, no files outside a scratch directory) and return "
        "what it prints; the value of a final expression is printed too.",
        {"code": {"type": "string", "description": "Python source code."}}, ["code"])

    def __init__(self, cpu_time_s: int = 2, wall_timeout_s: float = 10.0, memory_mb: int = 512,
                 max_output_chars: int = 2000, max_file_mb: int = 16, network_namespace: bool | None = None) -> None:
        for key, value in (("cpu_time_s", cpu_time_s), ("wall_timeout_s", wall_timeout_s), ("memory_mb", memory_mb),
                           ("max_output_chars", max_output_chars), ("max_file_mb", max_file_mb)):
            if not value or value <= 0:
                raise ValueError(f"python tool: {key} must be > 0, got {value!r}")
        self.cpu_time_s, self.wall_timeout_s, self.memory_mb = int(cpu_time_s), float(wall_timeout_s), int(memory_mb)
        self.max_output_chars, self.max_file_mb = int(max_output_chars), int(max_file_mb)
        use_ns = network_namespace if network_namespace is not None else bool(network_namespace_prefix())
        if use_ns and not network_namespace_prefix():
            raise ValueError("python tool: network_namespace=true but this kernel refuses an unprivileged one "
                             "(`unshare --net --map-root-user` failed); set it false to rely on the audit hook")
        self.prefix = network_namespace_prefix() if use_ns else ()

    def command(self, scratch: str) -> list[str]:
        return [*self.prefix, sys.executable, "-I", "-c", CHILD_SOURCE, scratch, str(self.cpu_time_s),
                str(self.memory_mb * 2**20), str(self.max_file_mb * 2**20)]

    def execute(self, arguments: dict) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError(f"python needs a non-empty 'code' string, got keys {sorted(arguments)}")
        root = tempfile.mkdtemp(prefix="jaxrl_hf_sandbox_")
        try:
            scratch = os.path.join(root, "scratch")
            os.mkdir(scratch, 0o700)
            return self._run(code, scratch, os.path.join(root, "output"))
        finally:
            shutil.rmtree(root, ignore_errors=True)

    def _run(self, code: str, scratch: str, output: str) -> str:
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8"}
        with open(output, "wb") as out:
            proc = subprocess.Popen(self.command(scratch), stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                    cwd=scratch, env=env, start_new_session=True, close_fds=True)
            try:
                proc.communicate(code.encode("utf-8", errors="replace"), timeout=self.wall_timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        text, truncated = _read_head(output, self.max_output_chars)
        if truncated:
            text += f"\n[output truncated to {self.max_output_chars} characters]"
        status = proc.returncode
        if timed_out:
            raise ToolError(f"timed out after {self.wall_timeout_s:g} s (wall clock)\n{text}".rstrip())
        if status < 0:
            reason = {signal.SIGXCPU: f"CPU time limit ({self.cpu_time_s} s) exceeded",
                      signal.SIGKILL: f"killed (CPU limit {self.cpu_time_s} s or memory limit {self.memory_mb} MB)"}
            raise ToolError(f"{reason.get(-status, f'killed by signal {-status}')}\n{text}".rstrip())
        if status != 0:
            raise ToolError(text.strip() or f"exit status {status}")
        return text if text.strip() else "(no output)"
