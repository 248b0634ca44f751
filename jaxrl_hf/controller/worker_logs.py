"""The last lines a dead worker process wrote, for the message that names the dead worker (``WorkerDiedError``).

Ray writes each worker process's stdout/stderr to ``<session>/logs/worker-<worker id>-<job id>-<pid>.out|.err``
on the worker's node; the ``ActorDiedError`` it raises names the pid and Ray's exit detail and carries the actor
id, from which the GCS tells the node the process ran on. A process of this node: its log file is read here. A
process of another node: its log is fetched from that node, within ``REMOTE_LOG_TIMEOUT_S`` in all (a dead node
must not hang the error path):

1. through Ray's state API (``ray.util.state.get_log`` by node id and pid), which needs the cluster's dashboard
   (``ray[default]``; ``ray start`` runs it);
2. where that is unavailable (minimal Ray, or ``ray.init(include_dashboard=False)`` as a local run does), through
   a CPU-less Ray task pinned to that node (``NodeAffinitySchedulingStrategy``, not soft) that reads the file there.

When neither answers in time, only Ray's own text is reported, with the reason the log could not be fetched.
"""

from __future__ import annotations

import glob
import os
import re
import threading
import time
from typing import Any

_PID = re.compile(r"\bpid: (\d+)")
_EXIT_DETAIL = re.compile(r"Worker exit detail: (.*?)(?: Some common causes|$)", re.S)
_RAY_TAGS = (":job_id:", ":actor_name:", ":task_name:")
REMOTE_LOG_TIMEOUT_S = 10.0
"""Time for fetching a dead worker's log from another node, both ways together."""
STATE_API_TIMEOUT_S = 4.0
"""Of that, the most the state API may take (it fails at once without a dashboard)."""
TAIL_LINES = 8


def ray_logs_dir() -> str | None:
    """This machine's log directory of the running Ray session (None without one)."""
    try:
        import ray

        node = ray._private.worker._global_node  # noqa: SLF001 - the only handle on the session's paths
        if node is None:
            node = getattr(ray._private.worker.global_worker, "node", None)  # noqa: SLF001 - inside a worker
        return node.get_logs_dir_path() if node is not None else None
    except Exception:  # noqa: BLE001 - no Ray session, or another Ray version's internals
        return None


def kept_lines(text: str, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` non-empty lines of a worker log, without Ray's ``:job_id:``-style tags."""
    kept = [ln.rstrip() for ln in text.splitlines() if ln.strip() and not ln.startswith(_RAY_TAGS)]
    return kept[-lines:]


def log_tail(pid: int, logs_dir: str | None, lines: int = TAIL_LINES) -> tuple[str, list[str]] | None:
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
            kept = kept_lines(text, lines)
            if kept:
                return path, kept
    return None


def tail_on_this_node(pid: int, lines: int = TAIL_LINES) -> tuple[str, list[str]] | None:
    """``log_tail`` of ``pid`` in the log directory of the node this runs on (the body of the pinned task)."""
    return log_tail(pid, ray_logs_dir(), lines)


def actor_node(actor_id: str | None) -> str | None:
    """The node id (hex) an actor ran on, from the GCS (no dashboard needed); None when unknown."""
    if not actor_id:
        return None
    try:
        import ray

        info = ray._private.state.actors(actor_id)  # noqa: SLF001 - GCS actor table, works without a dashboard
        return (info.get("Address") or {}).get("NodeID") or None
    except Exception:  # noqa: BLE001 - the GCS is gone with the cluster, or another Ray version
        return None


def this_node() -> str | None:
    """The driver's node id (None without a Ray session)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001
        return None


def _with_deadline(fn, timeout_s: float) -> Any:
    """``fn()`` in a daemon thread, abandoned after ``timeout_s`` (raises ``TimeoutError``); the state API's HTTP
    requests have no client-side timeout of their own."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box["error"] = err

    thread = threading.Thread(target=target, name="jaxrl_hf-log-fetch", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _via_state_api(pid: int, node_id: str, timeout_s: float, lines: int) -> list[str]:
    import ray
    from ray.util.state import get_log

    address = ray.get_runtime_context().gcs_address
    for suffix in ("err", "out"):
        fetch = lambda suffix=suffix: "".join(get_log(  # noqa: E731
            address=address, node_id=node_id, pid=pid, suffix=suffix, tail=200, timeout=max(1, int(timeout_s)),
            errors="replace"))
        kept = kept_lines(_with_deadline(fetch, timeout_s), lines)
        if kept:
            return kept
    return []


def _via_pinned_task(pid: int, node_id: str, timeout_s: float, lines: int) -> tuple[str, list[str]] | None:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(tail_on_this_node).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), name="jaxrl_hf.fetch_worker_log")
    ref = task.remote(pid, lines)
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise TimeoutError(f"no answer within {timeout_s:g} s") from None


def _short(err: BaseException) -> str:
    """An error in a few words (a refused connection to the dashboard's HTTP port means there is no dashboard)."""
    if type(err).__name__ == "ConnectionError" and "/api/v0/logs" in str(err):  # requests' error, no dashboard
        return "no dashboard answers (minimal Ray, or started with include_dashboard=False)"
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {text[:160]}" if text else type(err).__name__


def remote_log_tail(pid: int, node_id: str, timeout_s: float = REMOTE_LOG_TIMEOUT_S,
                    lines: int = TAIL_LINES) -> tuple[str, list[str]] | str:
    """``(where it came from, its last lines)`` of the log of ``pid`` on node ``node_id``, or why it could not be
    fetched; at most ``timeout_s`` in all."""
    deadline = time.monotonic() + timeout_s
    short = node_id[:8]
    try:
        kept = _via_state_api(pid, node_id, min(STATE_API_TIMEOUT_S, timeout_s), lines)
        if kept:
            return f"on node {short}, fetched through Ray's state API", kept
        state_api = "it has no lines for that pid"
    except Exception as err:  # noqa: BLE001 - no dashboard (minimal Ray), a dead node, another Ray version
        state_api = _short(err)
    remaining = max(0.5, deadline - time.monotonic())
    try:
        found = _via_pinned_task(pid, node_id, remaining, lines)
    except Exception as err:  # noqa: BLE001 - the node is dead or unreachable
        return (f"could not fetch its log from node {short}: Ray's state API: {state_api}; a task on that node: "
                f"{_short(err)}")
    if found is None:
        return f"node {short} has no log lines of pid {pid} (Ray's state API: {state_api})"
    path, kept = found
    return f"{path} on node {short}, fetched by a task on that node (Ray's state API: {state_api})", kept


def describe_death(ray_message: str, logs_dir: str | None = None, actor_id: str | None = None) -> str:
    """One line of what Ray says (its first line, the pid and the exit detail), then the last lines of the
    worker's own log: read here when the process ran on this node, fetched from its node otherwise."""
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
    if not pid:
        return out
    node = actor_node(actor_id)
    if node is not None and node != this_node():
        fetched = remote_log_tail(int(pid.group(1)), node)
        if isinstance(fetched, str):
            return f"{out}\n  ({fetched})"
        where, lines = fetched
    else:
        tail = log_tail(int(pid.group(1)), logs_dir if logs_dir is not None else ray_logs_dir())
        if tail is None:
            return out
        where, lines = tail
    return f"{out}\n  last lines of its log {where}:\n" + "\n".join(f"    {ln}" for ln in lines)
