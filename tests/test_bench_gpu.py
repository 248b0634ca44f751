"""launch/bench/bench_gpu.py --quick on the CPU, with Ray and vLLM made unimportable in every process it starts.

A ``sitecustomize.py`` on ``PYTHONPATH`` sets ``sys.modules['ray'] = sys.modules['vllm'] = None`` before anything
else is imported (an import of either then raises) in the parent, each child and the memory-plan subprocess, and
leaves a marker per process, so the test also proves the blocker ran in all of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "launch", "bench", "bench_gpu.py")

SITECUSTOMIZE = """\
import os, sys
sys.modules["ray"] = None
sys.modules["vllm"] = None
with open(os.environ["BENCH_GPU_TEST_MARKERS"], "a") as f:
    f.write(f"{os.getpid()} {' '.join(sys.argv[:3])}\\n")
"""


def _positive(*values) -> None:
    for v in values:
        assert isinstance(v, (int, float)) and v > 0, values


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("bench_gpu")
    site, out = root / "site", root / "out"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    markers = root / "markers.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), REPO]), JAX_PLATFORMS="cpu",
               BENCH_GPU_TEST_MARKERS=str(markers), PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    env.pop("BENCH_GPU_T0", None)
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--out", str(out), "--budget-s", "300"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(out / "bench_gpu.json") as f:
        doc = json.load(f)
    return doc, proc.stdout, markers.read_text().splitlines(), sorted(os.listdir(out))


def test_blocker_ran_in_every_process_and_nothing_imported_ray_or_vllm(run):
    doc, stdout, markers, _ = run
    scripts = " ".join(markers)
    for name in ("bench_gpu.py", "_gpu_plan.py", "env_peak", "update", "generate_hf", "generate_native", "colocate"):
        assert name in scripts, (name, markers)
    assert "import of ray halted" not in stdout and "import of vllm halted" not in stdout
    assert "ModuleNotFoundError" not in json.dumps(doc)


def test_every_section_ran_without_error_and_numbers_are_positive(run):
    doc, stdout, _, files = run
    sections = doc["sections"]
    assert list(sections) == ["env", "peak", "update", "generate", "colocate"]
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(sections, "ok")
    assert doc["meta"]["finished"] is True and files == ["bench_gpu.json"]

    env = sections["env"]
    assert env["backend"] == "cpu" and env["memory_stats"] == "skipped: cpu" and env["versions"]["jax"]
    peak = sections["peak"]
    _positive(peak["ours_bfloat16_flops_per_s"], peak["ours_float32_flops_per_s"], peak["torch_bf16"]["flops_per_s"])

    (name, variant), = sections["update"]["variants"].items()
    assert name == "bf16-auto-none" and variant["status"] == "ok"
    _positive(variant["step_s_median"], variant["tokens_per_s"], variant["mfu_vs_measured_peak"],
              variant["mfu_vs_datasheet_989"], variant["model_flops_per_update"], variant["first_call_s"],
              variant["log_prob"]["s_median"], variant["memory_plan"]["peak_bytes_per_device"])
    assert len(variant["step_s"]) == 3 and variant["memory_after_update"] == "skipped: cpu"
    assert variant["attention_resolved"] == "eager" and variant["memory_plan"]["attention_planned"] == "blockwise"
    assert abs(variant["metrics"]["actor/grad_norm"]) < 1e6

    gen = sections["generate"]
    _positive(gen["native"]["tok_per_s"], gen["transformers"]["tok_per_s"], gen["native_over_transformers"])
    assert gen["native"]["tokens"] == gen["transformers"]["tokens"] == 4 * 8
    assert 0.0 <= gen["greedy_agreement"]["equal_token_fraction"] <= 1.0

    colocate = sections["colocate"]  # what a CPU can run of it: the host DLPack path and the update under the budget
    assert colocate["budget_env"] == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"}
    assert colocate["startup"]["status"] == "skipped: no CUDA" and colocate["stream_race"]["status"] == "skipped: no GPU"
    sync = colocate["dlpack_sync"]
    assert sync["zero_copy_fraction"] == 1.0 and sync["bytes"] > 0 and not sync["missing_keys"]
    assert sync["logits_max_abs_diff"] < 1e-4 * max(1.0, sync["logits_scale"])  # float32, one 2-layer forward
    beside = colocate["update_beside_block"]
    assert beside["status"] == "ok" and beside["xla_mem_fraction"] == "0.45" and beside["torch_block_bytes"] == 0

    for heading in ("### env", "### peak", "### update", "### generate", "### colocate", "| bf16-auto-none |",
                    "| native JAX |", "| DLPack sync to cpu |"):
        assert heading in stdout


def test_budget_spent_skips_the_rest_and_records_it(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    env.pop("BENCH_GPU_T0", None)
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--out", str(tmp_path), "--budget-s", "0",
                           "--sections", "peak,update", "--no-plan"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "bench_gpu.json").read_text())
    states = {k: v["status"] for k, v in doc["sections"].items()}
    assert states == {"env": "skipped: not selected", "peak": "skipped: budget", "update": "skipped: budget",
                      "generate": "skipped: not selected", "colocate": "skipped: not selected"}
    assert doc["sections"]["update"]["variants"]["bf16-auto-none"]["status"] == "skipped: budget"
