"""launch/compare_runs.py: two runs' metrics on one figure and in one table."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    spec = importlib.util.spec_from_file_location("compare_runs", os.path.join(REPO, "launch", "compare_runs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(path, accs, calls=None, val=((0, 0.1), (4, 0.3))):
    path.mkdir()
    with open(path / "metrics.jsonl", "w") as fh:
        for step, acc in enumerate(accs, 1):
            rec = {"step": step, "critic/acc/mean": acc, "response_length/mean": 50.0 + step}
            if calls is not None:
                rec.update({"agent/tool_calls/mean": calls[step - 1], "agent/tool_errors": 1})
            fh.write(json.dumps(rec) + "\n")
    with open(path / "validation.jsonl", "w") as fh:
        for step, acc in val:
            fh.write(json.dumps({"step": step, "val-core/calculator/acc/mean@4": acc}) + "\n")
    return str(path)


def test_compare_two_runs_table_json_and_figure(tmp_path, capsys):
    compare = _module()
    tool = _run(tmp_path / "tool", [0.0, 0.25, 0.5, 0.5], calls=[0.5, 1.0, 1.0, 1.5])
    plain = _run(tmp_path / "plain", [0.0, 0.0, 0.0, 0.25], val=((0, 0.0), (4, 0.0)))
    out, js = tmp_path / "c.png", tmp_path / "c.json"
    assert compare.main([tool, plain, "--labels", "tool,no tool", "--window", "2", "--out", str(out),
                         "--json", str(js)]) == 0
    rows = json.loads(js.read_text())["rows"]
    assert rows["tool"]["train_acc_first_window"] == pytest.approx(0.125)
    assert rows["tool"]["train_acc_last_window"] == pytest.approx(0.5)
    assert rows["tool"]["val_acc_first"] == pytest.approx(0.1) and rows["tool"]["val_acc_last"] == pytest.approx(0.3)
    assert rows["tool"]["tool_calls_mean"] == pytest.approx(1.0) and rows["tool"]["tool_errors_total"] == 4
    assert rows["no tool"]["tool_calls_mean"] is None and rows["no tool"]["val_steps"] == [0, 4]
    assert out.stat().st_size > 10_000
    assert "| no tool | 4 | 0.000 | 0.000 | 0.000 | 0.125 | - | - |" in capsys.readouterr().out


def test_running_mean_and_label_count_error(tmp_path):
    compare = _module()
    assert compare.running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    run = _run(tmp_path / "a", [0.0])
    with pytest.raises(SystemExit):
        compare.main([run, "--labels", "a,b"])
