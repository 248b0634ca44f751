"""The last lines a dead worker process wrote, read from Ray's log files on this machine, for the message that
names the dead worker (``WorkerDiedError``).

Ray writes each worker process's stdout/stderr to ``<session>/logs/worker-<worker id>-<job id>-<pid>.out|.err``;
the ``ActorDiedError`` it raises names the pid and Ray's exit detail. Logs of a process on another node are not on
this machine: then only Ray's own text is reported.
"""

from __future__ import annotations

import glob
import os
import re

_PID = re.compile(r"\bpid: (\d+)")
_EXIT_DETAIL = re.compile(r"Worker exit detail: (.*?)(?: Some common causes|$)", re.S)
_RAY_TAGS = (":job_id:", ":actor_name:", ":task_name:")


def ray_logs_dir() -> str | None:
    """This machine's log directory of the running Ray session (None without one)."""
    try:
        import ray

        node = ray._private.worker._global_node  # noqa: SLF001 - the only handle on the session's paths
        return node.get_logs_dir_path() if node is not None else None
    except Exception:  # noqa: BLE001 - no Ray session, or another Ray version's internals
        return None


def log_tail(pid: int, logs_dir: str | None, lines: int = 8) -> tuple[str, list[str]] | None:
    """``(path, its last non-empty lines)`` of the worker log of ``pid``: its stderr, or stdout when that is empty."""
    if not logs_dir:
        return None
    for suffix in ("err", "out"):
        for path in sorted(glob.glob(os.path.join(logs_dir, f"worker-*-{pid}.{suffix}"))):
            try:
                with open(path, encoding="utf-8", errors="replace") as fh:
                    text = fh.read()[-20000:]
            except OSError:
                continue
            kept = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not ln.startswith(_RAY_TAGS)]
            if kept:
                return path, kept[-lines:]
    return None


def describe_death(ray_message: str, logs_dir: str | None = None) -> str:
    """One line of what Ray says (its first line, the pid and the exit detail), then the last lines of the
    worker's own log when this machine has it."""
    text = ray_message.strip()
    first = text.splitlines()[0] if text else "the worker process died"
    pid = _PID.search(text)
    detail = _EXIT_DETAIL.search(text)
    parts = [first]
    if pid:
        parts.append(f"(pid {pid.group(1)})")
    if detail and detail.group(1).strip():
        parts.append(f"exit detail: {detail.group(1).strip().rstrip('.')}")
    out = " ".join(parts)
    tail = log_tail(int(pid.group(1)), logs_dir if logs_dir is not None else ray_logs_dir()) if pid else None
    if tail is not None:
        path, lines = tail
        out += f"\n  last lines of its log {path}:\n" + "\n".join(f"    {ln}" for ln in lines)
    return out
