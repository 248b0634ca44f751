"""SIGTERM (preemption) mid-run: the run finishes its step, saves a checkpoint, says so and exits 75; the same
command then resumes from that checkpoint and finishes, every step logged once. No process is left behind."""

import json
import os
import signal
import subprocess
import sys

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


def test_sigterm_saves_at_the_step_boundary_and_the_same_command_resumes(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "--algo", "grpo", "--preset", "smoke",
           f"trainer.run_dir={run_dir}", "trainer.total_steps=4", "trainer.save_freq=0", "trainer.test_freq=0",
           "trainer.val_before_train=false", "trainer.progress_bar=false"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO)
    lines = []
    for line in proc.stderr:  # blocks until the trainer prints; no sleeping
        lines.append(line)
        if line.startswith("step 1/4"):
            proc.send_signal(signal.SIGTERM)  # while step 2 runs
            break
    children = descendants(proc.pid)
    lines += list(proc.stderr)  # the rest, up to the exit
    proc.wait(timeout=300)
    err = "".join(lines)
    assert proc.returncode == 75, err[-4000:]
    stopped = [ln for ln in err.splitlines() if ln.startswith("jaxrl_hf: stopped by SIGTERM after step")]
    assert stopped and "run the same command to resume" in stopped[0], err[-3000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    assert 1 <= step < 4 and (run_dir / "checkpoints" / f"global_step_{step}" / "checkpoint_complete.json").is_file()
    assert children and not [pid for pid in children if alive(pid)], "processes left behind"

    resumed = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'global_step_{step}'} (step {step})" in resumed.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
