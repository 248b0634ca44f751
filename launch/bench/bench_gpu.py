"""One-shot GPU benchmark: environment, matmul peak, the real actor update, and generation vs transformers.

    PYTHONPATH=. python3 launch/bench/bench_gpu.py --out DIR [--budget-s 360] [--sections env,peak,update,generate]
        [--variants bf16-auto-none,...] [--log-prob-all] [--no-plan] [--quick]

Written to run once on a borrowed GPU (H100 / H200) within a few minutes; ``--quick`` runs the same code at toy
sizes on a CPU (tests/test_bench_gpu.py). Nothing imports Ray or vLLM.

Sections, in this order (markdown table each; ``DIR/bench_gpu.json`` rewritten after every sub-measurement):

1. ``env``: package versions, ``jax.devices()``, device kind, ``memory_stats()``, nvidia-smi.
2. ``peak``: `jaxrl_hf.workers.peak_flops` calibration in bfloat16 and float32, and a torch 8192^3 bf16 matmul.
3. ``update``: `ActorRolloutRefWorker.update_actor` in-process on a random Qwen2.5-1.5B-shaped model, 16 rows x
   (512 + 512) tokens, bf16 compute: per variant compile, step time, tokens/s, MFU, peak device bytes vs the
   project's AOT memory plan (`_gpu_plan.py`, XLA:CPU, running beside the GPU work); ``compute_log_prob`` time.
4. ``generate``: `JaxGenerationEngine` vs transformers ``generate`` on the same random Qwen2-0.5B-shaped bf16
   weights, 64 x 128 prompt tokens x 128 new tokens, greedy, no EOS.
5. ``colocate`` (`_gpu_colocate.py`): under the shipped memory budget of a colocated vLLM actor, free memory after
   each runtime starts, the on-device DLPack weight sync (zero-copy share, logits of a transformers model fed by
   it against ours), the DLPack/donation stream race with and without synchronisation, and ``update_actor``
   beside a torch block of vLLM's share.

Order of the work (``--budget-s`` from the start; what does not fit is recorded as skipped): env + peak, the
first update variant (``bf16-auto-none``, with ``compute_log_prob``), generate, colocate, the other variants. Every
piece runs in its own child process (`_gpu_child.py`): a crash or an out-of-memory error is recorded and the
rest goes on, each variant's ``peak_bytes_in_use`` is its own, and a child still running when the budget ends is
killed (what it wrote stays).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
os.environ.setdefault("BENCH_GPU_T0", str(time.time()))
sys.path.insert(0, HERE)

from _gpu_common import (JSON_NAME, SECTIONS, SHAPE_OVERRIDES_ENV, UPDATE_VARIANTS, elapsed, lock_path, log, read_json,  # noqa: E402
                         set_at, time_left, update_json)
from _gpu_tables import print_tables  # noqa: E402

PENDING = "pending"
JSON_PATH: list[str] = []
RUNNING: list[subprocess.Popen] = []
"""The child and the plan subprocess now running: stopped with the parent (SIGTERM from an outer timeout)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for bench_gpu.json")
    parser.add_argument("--budget-s", type=float, default=360.0, help="wall-clock budget from the start")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {SECTIONS}")
    parser.add_argument("--variants", default=None,
                        help=f"update variants in priority order (default {','.join(UPDATE_VARIANTS)}; "
                             "--quick: the first only)")
    parser.add_argument("--log-prob-all", action="store_true", help="time compute_log_prob in every variant")
    parser.add_argument("--no-plan", action="store_true", help="skip the XLA:CPU memory plan subprocess")
    parser.add_argument("--quick", action="store_true", help="toy sizes (CPU test)")
    parser.add_argument("--micro", type=int, default=None, help="update: rows per micro-batch (default 2)")
    parser.add_argument("--gen-batch", type=int, default=None, help="generate: rows (default 64)")
    args = parser.parse_args(argv)
    over = {"update": {"micro": args.micro} if args.micro else {},
            "generate": {"batch": args.gen_batch} if args.gen_batch else {}}
    if over["update"] or over["generate"]:
        os.environ[SHAPE_OVERRIDES_ENV] = json.dumps(over)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; valid: {list(SECTIONS)}")
    default = UPDATE_VARIANTS[:1] if args.quick else UPDATE_VARIANTS
    args.variants = [v.strip() for v in args.variants.split(",")] if args.variants else list(default)
    return args


def child_env(mem_fraction: str, peak_cache: str) -> dict[str, str]:
    """The children's environment: the repo importable, JAX's share of the device memory (kept when set), the
    peak-FLOP/s cache shared by the children, offline Hugging Face libraries, one JAX device per process (the
    worker's placement is 1 x 1 x 1: a test's ``--xla_force_host_platform_device_count`` is dropped)."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", "")).strip()
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", mem_fraction)
    env.setdefault("JAXRL_HF_PEAK_CACHE", peak_cache)
    env["PYTHONUNBUFFERED"] = "1"
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):  # no network there
        env.setdefault(key, "1")
    return env


def _relay(stream, tail: collections.deque) -> None:
    for line in iter(stream.readline, ""):
        tail.append(line.rstrip("\n"))
        print(line, end="", flush=True)


def run_child(argv: list[str], env: dict[str, str], timeout: float) -> tuple[int | str, str]:
    """Run a child (its own process group), relaying its output; returns (exit code or 'timeout', output tail)."""
    tail: collections.deque = collections.deque(maxlen=40)
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    RUNNING.append(proc)
    relay = threading.Thread(target=_relay, args=(proc.stdout, tail), daemon=True)
    relay.start()
    try:
        code: int | str = proc.wait(timeout=max(timeout, 1.0))
    except subprocess.TimeoutExpired:
        code = "timeout"
        _kill(proc)
    relay.join(timeout=5)
    RUNNING.remove(proc)
    return code, "\n".join(tail)


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 5 s (a child has no processes of its own to outlive it)."""
    for stop in (proc.terminate, proc.kill):
        if proc.poll() is not None:
            return
        stop()
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _on_signal(signum: int, _frame) -> None:
    """An outer timeout or Ctrl-C: stop the children (what they wrote stays in the JSON) and exit."""
    log(f"signal {signum}: stopping {len(RUNNING)} subprocess(es)")
    for proc in list(RUNNING):
        _kill(proc)

    def mark(doc: dict) -> None:
        sections = doc.get("sections", {})
        for node in [*sections.values(), *sections.get("update", {}).get("variants", {}).values()]:
            if node.get("status") in (PENDING, "running"):
                node["status"] = f"interrupted: signal {signum}"
        doc.get("meta", {})["elapsed_s"] = elapsed()
    if JSON_PATH:
        update_json(JSON_PATH[0], mark)
    sys.exit(128 + signum)


def mark_unfinished(path: str, keys: tuple[str, ...], code: int | str, tail: str) -> None:
    """A child that died or was killed leaves its section 'pending'/'running': record why, with its output."""
    node = read_json(path)
    for k in keys:
        node = node.get(k, {}) if isinstance(node, dict) else {}
    status = node.get("status") if isinstance(node, dict) else None
    if status in (None, PENDING, "running"):
        why = "timeout: killed at the budget" if code == "timeout" else f"error: child exited with {code}"
        set_at(path, keys, {"status": "timeout" if code == "timeout" else "error", "error": why,
                            "child_output_tail": tail[-4000:]})


def merge_plan(path: str, plan_file: str | None) -> None:
    """Copy the memory plan's results into the update variants, with measured / planned peak bytes."""
    plans = read_json(plan_file) if plan_file else {}

    def apply(doc: dict) -> None:
        variants = doc.get("sections", {}).get("update", {}).get("variants", {})
        for name, plan in plans.items():
            if name not in variants:
                continue
            variants[name]["memory_plan"] = plan
            mem = variants[name].get("memory_after_update")
            planned = plan.get("peak_bytes_per_device")
            if isinstance(mem, dict) and mem.get("peak_bytes_in_use") and planned:
                variants[name]["peak_bytes_measured_over_plan"] = mem["peak_bytes_in_use"] / planned
    update_json(path, apply)


def finish_update_status(path: str, variants: list[str]) -> None:
    def apply(doc: dict) -> None:
        update = doc.setdefault("sections", {}).setdefault("update", {})
        got = update.setdefault("variants", {})
        for v in variants:
            if got.get(v, {}).get("status", PENDING) == PENDING:
                got[v] = {"status": "skipped: budget"}
        states = [got[v]["status"] for v in variants]  # a variant killed at the budget is no error
        update["status"] = ("error" if "error" in states else "ok" if "ok" in states else
                            "timeout" if "timeout" in states else "skipped: budget")
    update_json(path, apply)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, JSON_NAME)
    JSON_PATH.append(path)
    deadline = float(os.environ["BENCH_GPU_T0"]) + args.budget_s
    tmp = tempfile.mkdtemp(prefix="bench_gpu_")
    doc = {"meta": {"argv": sys.argv[1:], "quick": args.quick, "budget_s": args.budget_s, "python": sys.version,
                    "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "finished": False},
           "sections": {s: {"status": PENDING if s in args.sections else "skipped: not selected"} for s in SECTIONS}}
    if "update" in args.sections:
        doc["sections"]["update"]["variants"] = {v: {"status": PENDING} for v in args.variants}
    update_json(path, lambda d: (d.clear(), d.update(doc)))
    log(f"writing {path}; budget {args.budget_s:.0f}s; sections {args.sections}; variants {args.variants}")

    plan_proc, plan_file = None, None
    if "update" in args.sections and not args.no_plan:
        plan_file = os.path.join(tmp, "plan.json")
        env = child_env("0.9", os.path.join(tmp, "peak.json"))
        env["JAX_PLATFORMS"] = "cpu"
        plan_proc = subprocess.Popen([sys.executable, os.path.join(HERE, "_gpu_plan.py"), "--out", plan_file,
                                      *(["--quick"] if args.quick else []), *args.variants], cwd=ROOT, env=env)
        RUNNING.append(plan_proc)
        with contextlib.suppress(OSError):  # behind the GPU work's own CPU needs (compiles)
            os.setpriority(os.PRIO_PROCESS, plan_proc.pid, 15)

    child = os.path.join(HERE, "_gpu_child.py")
    common = ["--json", path, *(["--quick"] if args.quick else [])]
    generate = [(["--task", "generate_hf", "--work", tmp], ("sections", "generate"), "0.75"),
                (["--task", "generate_native", "--work", tmp], ("sections", "generate"), "0.9")]
    # colocate's child applies the shipped memory budget itself (_gpu_colocate.py)
    colocate = [(["--task", "colocate"], ("sections", "colocate"), "0.45")] if "colocate" in args.sections else []
    tasks: list[tuple[list[str], tuple[str, ...], str]] = []
    first = [s for s in ("env", "peak") if s in args.sections]
    if first:
        tasks.append((["--task", "_".join(first)], ("sections", first[0]), "0.75"))
    variants = args.variants if "update" in args.sections else []
    for i, variant in enumerate(variants):
        lp = ["--log-prob"] if (i == 0 or args.log_prob_all) else []
        tasks.append((["--task", "update", "--variant", variant, *lp], ("sections", "update", "variants", variant),
                      "0.9"))
        if i == 0:
            tasks += generate if "generate" in args.sections else []
            tasks += colocate
    if not variants:
        tasks += (generate if "generate" in args.sections else []) + colocate

    for task_args, keys, fraction in tasks:
        left = time_left(deadline)
        if task_args[1] == "generate_native" and not os.path.isfile(os.path.join(tmp, "qwen2_random", "config.json")):
            log("skipping generate_native: the transformers child saved no model")
            continue
        if left < (1 if args.quick else 15):
            log(f"skipping {' '.join(task_args[1:])}: budget spent")
            native = task_args[1] == "generate_native"
            set_at(path, keys, {"status": "skipped: budget" + (" (native engine part)" if native else "")})
            continue
        log(f"starting {' '.join(task_args[1:])} ({left:.0f}s of budget left)")
        code, tail = run_child([child, *task_args, *common, "--deadline", str(deadline)],
                               child_env(fraction, os.path.join(tmp, "peak.json")), left + 5)
        if code != 0:
            mark_unfinished(path, keys, code, tail)
            if task_args[1] == "env_peak":
                mark_unfinished(path, ("sections", "peak"), code, tail)
            set_at(path, ("meta", "child_failures"), {" ".join(task_args[1:]): {"exit": code, "tail": tail[-2000:]}})
        merge_plan(path, plan_file)
        log(f"done {' '.join(task_args[1:])}: exit {code}")

    if plan_proc is not None:
        try:
            plan_proc.wait(timeout=max(min(time_left(deadline), 60.0), 2.0 if args.quick else 1.0))
        except subprocess.TimeoutExpired:
            _kill(plan_proc)
            log("memory plan subprocess stopped at the budget")
        merge_plan(path, plan_file)
    if "update" in args.sections:
        finish_update_status(path, args.variants)
    final = update_json(path, lambda d: d["meta"].update(finished=True, elapsed_s=elapsed()))
    for name, section in final["sections"].items():
        if section.get("status") == PENDING:
            set_at(path, ("sections", name), {"status": "skipped: budget"})
    shutil.rmtree(tmp, ignore_errors=True)
    doc = read_json(path)
    with contextlib.suppress(OSError):
        os.remove(lock_path(path))
    print_tables(doc)
    log(f"finished; JSON at {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
