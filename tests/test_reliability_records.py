"""The run's records after a crash: a torn last JSONL line is dropped with a warning, other damage is named,
and a resumed run's files hold every step exactly once."""

import json
import logging

import pytest

from jaxrl_hf.trainer.logging import LogFileError, MetricLogger, read_jsonl
from jaxrl_hf.trainer.run import _number


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_a_torn_last_line_is_dropped_with_a_warning_on_resume(tmp_path, caplog):
    _write(tmp_path / "metrics.jsonl", [{"step": 1, "a": 1.0}, {"step": 2, "a": 2.0}], tail='{"step": 3, "a": 3.')
    _write(tmp_path / "validation.jsonl", [{"step": 0, "acc": 0.1}], tail='{"step": 2, "ac')
    with caplog.at_level(logging.WARNING):
        log = MetricLogger(str(tmp_path), ["jsonl"], resume_step=2)  # the step-2 checkpoint
        log.log(3, {"a": 30.0})
        log.close()
    assert [r["step"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))] == [1, 2, 3]
    assert [r["step"] for r in read_jsonl(str(tmp_path / "validation.jsonl"))] == [0]
    assert "metrics.jsonl: dropping its torn last line 3" in caplog.text
    assert "validation.jsonl: dropping its torn last line 2" in caplog.text


def test_damage_before_the_last_line_is_named_not_repaired(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, oops}\n{"step": 3}\n')
    with pytest.raises(LogFileError, match=r"metrics.jsonl: line 2 is not JSON"):
        MetricLogger(str(tmp_path), ["jsonl"], resume_step=3)


def test_the_summary_prints_a_nan_accuracy_as_stored():
    assert _number(0.4567) == "0.457" and _number("nan") == "nan"


def test_a_second_run_on_the_same_run_dir_refuses_naming_the_first_pid(tmp_path):
    import os

    from jaxrl_hf.trainer.run_dir import RunDirError, RunDirLock

    with RunDirLock(str(tmp_path)):
        with pytest.raises(RunDirError, match=f"in use by another run \\(pid {os.getpid()}"):
            RunDirLock(str(tmp_path)).__enter__()
    with RunDirLock(str(tmp_path)):  # released at exit (and by the kernel if the owner dies): taken over
        pass


def test_a_fresh_run_over_earlier_records_refuses_unless_overwrite(tmp_path):
    from jaxrl_hf.errors import ExitCode
    from jaxrl_hf.trainer.run_dir import RunDirError, check_fresh_start

    check_fresh_start(str(tmp_path), overwrite=False)  # an empty directory is fine
    _write(tmp_path / "metrics.jsonl", [{"step": 1}])
    with pytest.raises(RunDirError, match="metrics.jsonl of an earlier run but no checkpoint") as info:
        check_fresh_start(str(tmp_path), overwrite=False)
    assert "trainer.overwrite=true" in str(info.value) and info.value.exit_code == ExitCode.CONFIG
    check_fresh_start(str(tmp_path), overwrite=True)
    assert (tmp_path / "metrics.jsonl").exists()  # nothing is deleted by the check itself


def test_a_resume_lists_config_changes_and_refuses_a_new_model_or_data_order(tmp_path):
    import yaml

    from jaxrl_hf.config import load_config
    from jaxrl_hf.trainer.run_dir import RunDirError, check_resume_config

    saved = load_config("grpo", "smoke", [f"trainer.run_dir={tmp_path}"]).to_dict()
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    longer = load_config("grpo", "smoke", [f"trainer.run_dir={tmp_path}", "trainer.total_steps=9"]).to_dict()
    assert "trainer.total_steps: 2 -> 9" in check_resume_config(str(tmp_path / "config.yaml"), longer, False)
    reordered = load_config("grpo", "smoke", [f"trainer.run_dir={tmp_path}", "data.seed=5", "actor.optim.lr=1e-3"])
    with pytest.raises(RunDirError, match=r"changes the model or the data order: data.seed: 0 -> 5\. Set") as info:
        check_resume_config(str(tmp_path / "config.yaml"), reordered.to_dict(), False)
    assert "allow_config_change" in str(info.value) and "actor.optim.lr" not in str(info.value)
    lines = check_resume_config(str(tmp_path / "config.yaml"), reordered.to_dict(), True)
    assert "data.seed: 0 -> 5" in lines and any(line.startswith("actor.optim.lr:") for line in lines)
