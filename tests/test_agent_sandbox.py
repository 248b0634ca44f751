"""The ``python`` tool's sandbox: hostile code (a runaway loop, a 10 GB allocation, writing outside the scratch
directory, reading host files, opening a socket, starting processes, native calls, flooding stdout) comes back
as an error text within its limits; the host is untouched and nothing is left behind."""

from __future__ import annotations

import glob
import os
import tempfile
import time

import pytest

from jaxrl_hf.agent import get_tool, run_tool
from jaxrl_hf.agent.python_sandbox import PythonSandbox, network_namespace_prefix

SANDBOX = PythonSandbox(cpu_time_s=1, wall_timeout_s=4, memory_mb=256, max_output_chars=300)


def run(code, tool=SANDBOX):
    start = time.perf_counter()
    text, ok = run_tool(tool, {"code": code})
    return text, ok, time.perf_counter() - start


def leftovers():
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "jaxrl_hf_sandbox_*")))


def test_ordinary_code_runs_and_files_stay_in_a_fresh_scratch_dir():
    before = leftovers()
    assert run("print(sum(range(10)))")[:2] == ("45\n", True)
    assert run("import json, math\njson.dumps({'pi': round(math.pi, 3)})")[:2] == ("'{\"pi\": 3.142}'\n", True)
    text, ok, _ = run("import os\nopen('notes.txt', 'w').write('hi')\nprint(open('notes.txt').read(), os.listdir('.'))")
    assert ok and text == "hi ['notes.txt']\n"
    assert run("import os; print(os.path.exists('notes.txt'))")[:2] == ("False\n", True)  # every call starts empty
    assert run("x = 1")[:2] == ("(no output)", True)
    assert leftovers() == before  # the temporary directory is removed


def test_runaway_loop_hits_the_cpu_limit():
    text, ok, seconds = run("while True:\n    pass")
    assert not ok and "CPU" in text and seconds < 4


def test_sleeping_code_hits_the_wall_timeout():
    tool = PythonSandbox(cpu_time_s=5, wall_timeout_s=1)
    text, ok, seconds = run("import time\ntime.sleep(30)", tool)
    assert not ok and "timed out after 1 s" in text and seconds < 5


def test_huge_allocation_is_refused_by_the_memory_limit():
    text, ok, seconds = run("x = bytearray(10 * 2**30)\nprint('allocated')")
    assert not ok and "MemoryError" in text and "allocated" not in text and seconds < 4


def test_writing_outside_the_scratch_dir_is_refused_and_the_host_untouched(tmp_path):
    target = tmp_path / "escaped.txt"
    for code in (f"open({str(target)!r}, 'w').write('x')", "open('/tmp/../etc/jaxrl_hf_sandbox_probe', 'w')",
                 f"import os; os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
                 "open('../escaped.txt', 'w').write('x')", f"import os; os.remove({str(tmp_path)!r})",
                 f"import shutil; shutil.rmtree({str(tmp_path)!r})", "import os; os.chdir('/')"):
        text, ok, _ = run(code)
        assert not ok and "PermissionError: sandbox:" in text, (code, text)
    assert not target.exists() and not os.path.exists("/etc/jaxrl_hf_sandbox_probe") and tmp_path.is_dir()


def test_reading_host_files_is_refused():
    text, ok, _ = run("print(open('/etc/passwd').read())")
    assert not ok and "may not read '/etc/passwd'" in text


@pytest.mark.parametrize("code", [
    "import socket; socket.socket().connect(('127.0.0.1', 80))",
    "import socket; socket.create_connection(('example.com', 80), timeout=1)",
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:1')",
])
def test_network_is_refused(code):
    text, ok, seconds = run(code)
    assert not ok and "PermissionError: sandbox:" in text and seconds < 4


@pytest.mark.parametrize("code", [
    "import os; os.system('touch /tmp/x')", "import subprocess; subprocess.run(['true'])", "import os; os.fork()",
    "import os; os.execv('/bin/true', ['true'])", "import ctypes; ctypes.CDLL(None)",
    "import resource; resource.setrlimit(resource.RLIMIT_CPU, (100, 100))", "import os; os.kill(1, 9)",
    "import _posixsubprocess", "import multiprocessing as m; m.set_start_method('spawn'); m.Process(target=print).start()",
    "import os; os.forkpty()", "import os; os.posix_spawn('/bin/true', ['true'], {})",
])
def test_processes_native_calls_and_limit_changes_are_refused(code):
    text, ok, _ = run(code)
    assert not ok and "is not allowed" in text


def test_output_is_truncated_and_a_flood_is_bounded():
    text, ok, seconds = run("print('x' * 10**6)")
    assert ok and text.startswith("x" * 300) and text.endswith("[output truncated to 300 characters]")
    text, ok, seconds = run("while True:\n    print('y' * 10000)")
    assert not ok and text.count("y") <= 300 and seconds < 4


def test_errors_report_the_line_not_the_sandbox_internals():
    text, ok, _ = run("x = 1\ny = x / 0")
    assert (text, ok) == ("Error: line 2: ZeroDivisionError: division by zero", False)
    assert run_tool(SANDBOX, {}) == ("Error: python needs a non-empty 'code' string, got keys []", False)
    with pytest.raises(ValueError, match="max_output_chars must be > 0"):
        PythonSandbox(max_output_chars=0)


def test_network_namespace_when_the_kernel_allows_it():
    if not network_namespace_prefix():
        pytest.skip("no unprivileged network namespace here (the audit hook alone refuses sockets)")
    assert get_tool("python").prefix == network_namespace_prefix()
