"""Signals to a real run (``launch/train.py`` in a subprocess): SIGTERM (preemption) mid-run saves at the step
boundary and exits 75, a SIGKILLed worker ends the run naming it, a SIGSTOPped one ends it at its timeout; after
each the same command resumes to the same numbers, and no process is left behind."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        kids = [p for p, pp in parent.items() if pp == current]
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


PARITY_SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the decoded response has an even number of characters: random text passes about half the time."""
    return float(len(solution_str) % 2 == 0)
'''


def ray_workers(pids: list[int]) -> list[tuple[int, str]]:
    """``(pid, Ray's process title)`` of the Ray actor processes among ``pids`` (``ray::<Class>...``)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                title = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if title.startswith("ray::ProcessHost"):  # the JAX processes of the worker groups
            out.append((pid, title))
    return out


def interrupt(cmd: list[str], at_line: str, act) -> tuple[subprocess.Popen, str, list[int], object]:
    """Runs ``cmd``; when a stderr line starts with ``at_line``, calls ``act(proc)`` (which signals something) and
    reads the rest up to the exit. Returns ``(proc, stderr, the driver's descendants at that moment, act's
    result)``. Blocks on the trainer's own output: no sleeping."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO)
    lines, result, children = [], None, []
    try:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith(at_line):
                result = act(proc)
                break
        children = descendants(proc.pid)
        lines += list(proc.stderr)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, "".join(lines), children, result


def test_sigterm_then_a_sigkilled_worker_each_resume_with_the_same_command_to_the_same_numbers(tmp_path):
    """One 4-step GRPO smoke command (checkpoints every 3 steps), run three times on one run directory:

    1. SIGTERM while step 2 runs: the run finishes its step, saves a checkpoint the schedule would not have saved,
       says so and exits 75, leaving no process behind;
    2. the same command resumes from it; a real worker process is SIGKILLed once step 3 is logged (while its
       checkpoint is written or step 4 runs): the driver exits 6 naming the role, rank, method and pid, with no
       traceback and no process left behind;
    3. the same command resumes from the newest complete checkpoint and finishes.

    Every step is logged once, and each step's metrics equal an uninterrupted run's (wall-clock metrics excluded);
    the scorer passes random text about half the time, so the updates move the weights."""
    from jaxrl_hf.trainer.metrics import is_wall_clock_metric

    scorer = tmp_path / "parity.py"
    scorer.write_text(PARITY_SCORER)

    def command(run_dir):
        return [sys.executable, os.path.join(REPO, "launch", "train.py"), "--algo", "grpo", "--preset", "smoke",
                f"trainer.run_dir={run_dir}", "trainer.total_steps=4", "trainer.save_freq=3", "trainer.test_freq=0",
                "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.progress_interval_s=1",
                f"custom_reward_function.path={scorer}"]

    def records(run_dir):
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    full = subprocess.run(command(tmp_path / "full"), capture_output=True, text=True, cwd=REPO, timeout=300)
    assert full.returncode == 0, full.stderr[-4000:]
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"

    proc, err, children, _ = interrupt(command(run_dir), "step 1/4", lambda p: p.send_signal(signal.SIGTERM))
    assert proc.returncode == 75, err[-4000:]
    stopped = [ln for ln in err.splitlines() if ln.startswith("jaxrl_hf: stopped by SIGTERM after step")]
    assert stopped and "run the same command to resume" in stopped[0], err[-3000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert step in (1, 2) and (ckpts / f"global_step_{step}" / "checkpoint_complete.json").is_file()  # not on schedule
    assert children and not [pid for pid in children if alive(pid)], "processes left behind"

    def kill_a_worker(_proc):
        workers = ray_workers(descendants(_proc.pid))
        assert workers, "no Ray worker process found under the driver"
        os.kill(workers[0][0], signal.SIGKILL)
        return workers[0]

    proc, err2, children, victim = interrupt(command(run_dir), "step 3/4", kill_a_worker)
    assert f"resumed from {ckpts / f'global_step_{step}'} (step {step})" in err2, err2[-3000:]
    assert proc.returncode == 6, err2[-4000:]  # ExitCode.WORKER
    assert "died while role" in err2 and f"(pid {victim[0]})" in err2, err2[-3000:]
    assert "Traceback" not in err2 and (run_dir / "error.log").is_file()
    assert children and not [pid for pid in children if alive(pid)], "processes left behind"

    resumed = subprocess.run(command(run_dir), capture_output=True, text=True, cwd=REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert re.search(rf"resumed from {re.escape(str(ckpts))}/global_step_([{step}3]) \(step \1\)",
                     resumed.stderr), resumed.stderr[-3000:]
    assert "  ... " not in err + err2 + resumed.stderr  # progress_bar=false: no heartbeat, whatever the interval
    got, want = records(run_dir), records(tmp_path / "full")
    assert [r["step"] for r in got] == [1, 2, 3, 4]

    def comparable(record):
        return {k: v for k, v in record.items() if not is_wall_clock_metric(k)}

    assert [comparable(r) for r in got] == [comparable(r) for r in want] and want[3]["actor/ppo_kl"] != 0


def test_a_stopped_worker_ends_the_run_at_its_timeout_naming_it(tmp_path):
    """A real worker process of a smoke run is SIGSTOPped once step 1 is logged (alive, never answering): the run
    ends when ``trainer.worker_timeout_s`` expires, exit 6, naming the pool, role, method and rank that did not
    answer; nothing is left behind (the stopped process included)."""
    timeout_s = 30  # above any call of a compiled step on a busy 2-core machine; the first step's calls too
    cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "--algo", "grpo", "--preset", "smoke",
           f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=3", "trainer.save_freq=0",
           "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.progress_bar=false",
           f"trainer.worker_timeout_s={timeout_s}"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO)
    lines, stopped, children, left = [], None, [], []
    try:
        for line in proc.stderr:  # blocks until the trainer prints; no sleeping
            lines.append(line)
            if line.startswith("step 1/3"):
                workers = ray_workers(descendants(proc.pid))
                assert len(workers) == 1, workers  # the actor pool's one process (actor and reference)
                stopped = workers[0][0]
                os.kill(stopped, signal.SIGSTOP)
                break
        children = descendants(proc.pid)
        start = time.monotonic()
        lines += list(proc.stderr)
        proc.wait(timeout=timeout_s + 90)
        waited = time.monotonic() - start
    finally:
        left = [pid for pid in children if alive(pid)]
        for pid in left:  # only when the run failed to clean up (the assertion below then fails)
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
    err = "".join(lines)
    assert proc.returncode == 6, err[-4000:]  # ExitCode.WORKER
    assert timeout_s - 5 <= waited <= timeout_s + 60, (waited, err[-3000:])
    named = [ln for ln in err.splitlines() if f"did not answer within {timeout_s} s" in ln]
    assert named and "pool 'actor'" in named[0] and "ranks [0]" in named[0] and "method '" in named[0], err[-3000:]
    assert "trainer.worker_timeout_s" in named[0] and "Traceback" not in err
    assert children and not left, f"processes left behind: {left}"
