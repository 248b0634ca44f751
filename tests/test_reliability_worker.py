"""A hung worker stops the run at trainer.worker_timeout_s naming it, and every failure leaves through one exit
path: one message, the traceback in <run_dir>/error.log, the documented exit code per class."""

import io
import os
import signal
import sys

import numpy as np
import pytest
import ray

from jaxrl_hf.config import ConfigError
from jaxrl_hf.controller import (Batch, Dispatch, ResourcePool, Worker, WorkerDiedError, WorkerGroup,
                                 WorkerMethodError, WorkerTimeoutError, register, set_call_timeout)
from jaxrl_hf.data.schema import DatasetRowError
from jaxrl_hf.errors import ExitCode
from jaxrl_hf.trainer.checkpointing import CheckpointError
from jaxrl_hf.trainer.dynamic_sampling import DynamicSamplingError
from jaxrl_hf.trainer.exit_path import exit_code_of, report

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Pid(Worker):
    @register(dispatch=Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(dispatch=Dispatch.DP_COMPUTE)
    def echo(self, batch: Batch) -> Batch:
        return batch


def test_a_stopped_worker_is_named_when_the_timeout_expires(ray_cluster):
    with ResourcePool("hung", num_processes=2, devices_per_process=1) as pool:
        group = WorkerGroup(pool, Pid, role="actor")
        pids = group.pid()
        os.kill(pids[1], signal.SIGSTOP)  # a hung process: alive, never answers
        try:
            set_call_timeout(3)
            with pytest.raises(WorkerTimeoutError) as info:
                group.echo(Batch.from_dict({"x": np.arange(4)}))
        finally:
            set_call_timeout(None)
            os.kill(pids[1], signal.SIGCONT)
        err = info.value
        assert (err.pool, err.role, err.method, err.ranks) == ("hung", "actor", "echo", [1])
        assert "did not answer within 3 s" in str(err) and "trainer.worker_timeout_s" in str(err)
        assert exit_code_of(err) == ExitCode.WORKER


@pytest.mark.parametrize("err,code", [
    (ConfigError("config key 'actor.lr': bad"), ExitCode.CONFIG),
    (DatasetRowError("train.jsonl: line 3: invalid JSON"), ExitCode.DATA),
    (FileNotFoundError("data.parquet"), ExitCode.DATA),
    (CheckpointError("no usable checkpoint"), ExitCode.CHECKPOINT),
    (DynamicSamplingError("too few informative groups"), ExitCode.DYNAMIC_SAMPLING),
    (WorkerDiedError("actor", "actor", 0, "update_actor", "SIGKILL"), ExitCode.WORKER),
    (WorkerMethodError("actor", 0, "init_model", "WorkerConfigError", "...\nWorkerConfigError: model.path"), ExitCode.CONFIG),
    (WorkerMethodError("actor", 1, "update_actor", "ValueError", "Traceback ...\nValueError: boom"), ExitCode.WORKER),
    (KeyboardInterrupt(), ExitCode.INTERRUPTED),
    (ZeroDivisionError("division by zero"), ExitCode.INTERNAL),
])
def test_each_failure_class_has_its_exit_code(err, code):
    assert exit_code_of(err) == code


def test_one_message_on_screen_and_the_traceback_in_error_log(tmp_path):
    try:
        raise WorkerMethodError("actor", 1, "update_actor", "ValueError",
                                'Traceback (most recent call last):\n  File "x.py"\nValueError: boom at row 7')
    except WorkerMethodError as err:
        screen = io.StringIO()
        assert report(err, str(tmp_path), screen) == ExitCode.WORKER
    text = screen.getvalue()
    assert text.count("\n") == 1 and "Traceback" not in text
    assert "role 'actor' rank 1 method 'update_actor' failed: ValueError: boom at row 7" in text
    assert str(tmp_path / "error.log") in text
    log = (tmp_path / "error.log").read_text()
    assert "exit 6 (WORKER)" in log and "Traceback (most recent call last)" in log and "boom at row 7" in log


def test_a_bug_says_so_and_keeps_its_traceback(tmp_path):
    try:
        {}["missing"]
    except KeyError as err:
        screen = io.StringIO()
        assert report(err, str(tmp_path), screen) == ExitCode.INTERNAL
    assert "KeyError: 'missing'" in screen.getvalue() and "a bug" in screen.getvalue()
    assert "Traceback" in (tmp_path / "error.log").read_text()


def test_a_malformed_data_file_ends_the_run_with_the_data_code_and_no_traceback(tmp_path, capsys):
    from jaxrl_hf.trainer import run

    bad = tmp_path / "train.jsonl"
    bad.write_text('{"prompt": [{"role": "user", "content": "1+1"}], "data_source": "arithmetic", '
                   '"reward_model": {"ground_truth": "2"}}\n{"prompt": oops\n')
    code = run("grpo", preset="smoke", overrides=[f"trainer.run_dir={tmp_path / 'run'}", f"data.train_files=[{bad}]"])
    err = capsys.readouterr().err
    assert code == ExitCode.DATA and "Traceback" not in err
    assert f"{bad}: line 2: invalid JSON" in err and (tmp_path / "run" / "error.log").is_file()


def test_sigterm_asks_for_a_stop_at_the_step_boundary_and_a_second_one_changes_nothing(capsys):
    from jaxrl_hf.trainer.preemption import StopRequest

    with StopRequest() as stop:
        signal.raise_signal(signal.SIGTERM)  # a scheduler's preemption: noted, the step goes on
        signal.raise_signal(signal.SIGTERM)
        assert stop.signal == "SIGTERM"
    assert capsys.readouterr().err.count("SIGTERM: stopping after this step with a checkpoint") == 1


def test_ctrl_c_once_waits_for_the_step_and_twice_raises_keyboard_interrupt(capsys):
    from jaxrl_hf.trainer.preemption import StopRequest

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        with StopRequest() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.signal == "SIGINT"
            assert "stopping after this step with a checkpoint (Ctrl-C again to stop at once" in capsys.readouterr().err
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # the handlers are restored
    assert report(KeyboardInterrupt(), None, io.StringIO()) == ExitCode.INTERRUPTED == 130
