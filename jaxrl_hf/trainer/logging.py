"""Where metrics go: ``run_dir/metrics.jsonl`` (one JSON object per step), the console, TensorBoard.

* ``metrics.jsonl``: ``{"step": N, <metric>: float, ...}`` per training step; validation results also go
  to ``validation.jsonl`` (step 0 = before training). On resume the files are cut back to the resumed step,
  so a killed-and-resumed run's files read exactly like an uninterrupted run's.
* console: the step bar (``trainer.progress_bar``: a tqdm bar on a terminal, a line per step elsewhere) with a few
  key metrics.
* TensorBoard: only when ``tensorboardX`` or ``torch.utils.tensorboard`` with ``tensorboard`` is installed
  (no new dependency); wandb only when installed and listed in ``trainer.logger``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Any, TextIO

from jaxrl_hf import progress
from jaxrl_hf.errors import ExitCode, RunError

logger = logging.getLogger(__name__)

CONSOLE_KEYS = {"critic/score/mean": "score", "critic/acc/mean": "acc", "response_length/mean": "len",
                "actor/entropy": "entropy", "actor/pg_clipfrac": "clipfrac", "actor/ppo_kl": "ppo_kl",
                "dynamic_sampling/num_gen_batches": "gen_batches"}


def _json_value(value: Any) -> Any:
    value = float(value)
    return value if math.isfinite(value) else str(value)  # NaN/inf as strings: metrics.jsonl stays valid JSON


class LogFileError(RunError):
    """A JSON-lines log is damaged before its last line (a torn last line is only dropped)."""

    exit_code = ExitCode.CHECKPOINT


def _parsed_lines(path: str) -> list[tuple[str, dict[str, Any]]]:
    """``(line, record)`` for each record of a JSON-lines log. A last line that does not parse (a crash in the
    middle of writing it) is dropped with a warning; damage anywhere else is a ``LogFileError`` naming the line."""
    with open(path, encoding="utf-8") as fh:
        lines = [ln if ln.endswith("\n") else ln + "\n" for ln in fh if ln.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append((line, json.loads(line)))
        except ValueError as err:
            if i < len(lines) - 1:
                raise LogFileError(f"{path}: line {i + 1} is not JSON ({err}); only a torn last line is repaired")
            logger.warning("%s: dropping its torn last line %d (a crash while it was written): %.80r",
                           path, i + 1, line)
    return out


def truncate_jsonl(path: str, max_step: int) -> None:
    """Drop records with ``step > max_step`` (atomically), e.g. steps logged after the resumed checkpoint, and a
    torn last line."""
    if not os.path.isfile(path):
        return
    kept = [ln for ln, record in _parsed_lines(path) if record.get("step", 0) <= max_step]
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.writelines(kept)
    os.replace(tmp, path)


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """All records of a JSON-lines file (a torn last line dropped with a warning)."""
    return [record for _, record in _parsed_lines(path)]


class ProgressBar:
    """The run's bar over its steps: a tqdm bar on a terminal (``training 12/40 [01:02<02:04, 3.1 s/step,
    score=0.31]``, `jaxrl_hf.progress.step_bar`), else one line per step
    (``[#####.....] 12/40 steps  3.1 s/step  eta 1m27s  score=0.31``) so that logs are not flooded."""

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None, width: int = 24) -> None:
        self.total, self.done, self.width = total, start, width
        self.stream = stream or progress.stream()
        self.started = time.perf_counter()
        self.first = start
        self._bar = progress.step_bar(total, start) if stream is None else None

    def update(self, step: int, info: str = "") -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(info, refresh=False)
            self._bar.update(step - self.done)
            self.done = step
            return
        self.done = step
        frac = self.done / max(self.total, 1)
        filled = int(round(frac * self.width))
        elapsed = time.perf_counter() - self.started
        rate = elapsed / max(self.done - self.first, 1)
        eta = rate * (self.total - self.done)
        line = (f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} steps  {rate:.1f} s/step  "
                f"eta {int(eta // 60)}m{int(eta % 60):02d}s  {info}")
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Leave the terminal bar on screen as it ended."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class MetricLogger:
    """Writes each step's metrics to the configured sinks (``trainer.logger``)."""

    def __init__(self, run_dir: str, sinks: list[str], *, resume_step: int = 0, config: dict | None = None,
                 project: str = "jaxrl_hf", experiment: str = "run") -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.run_dir = run_dir
        self.sinks = list(sinks)
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.validation_path = os.path.join(run_dir, "validation.jsonl")
        for path in (self.metrics_path, self.validation_path):
            if resume_step > 0:
                truncate_jsonl(path, resume_step)
            elif os.path.exists(path):
                os.remove(path)  # a fresh run starts fresh files
        self._tb = self._open_tensorboard() if "tensorboard" in self.sinks else None
        self._wandb = self._open_wandb(project, experiment, config) if "wandb" in self.sinks else None

    def _open_tensorboard(self) -> Any:
        for module in ("tensorboardX", "torch.utils.tensorboard"):
            try:
                mod = __import__(module, fromlist=["SummaryWriter"])
                return mod.SummaryWriter(os.path.join(self.run_dir, "tensorboard"))
            except Exception:  # noqa: BLE001 - not installed (torch's writer needs the tensorboard package)
                continue
        logger.info("TensorBoard logging skipped: neither tensorboardX nor tensorboard is installed")
        return None

    @staticmethod
    def _open_wandb(project: str, experiment: str, config: dict | None) -> Any:
        try:
            import wandb  # type: ignore[import-not-found]
        except ImportError:
            logger.warning("trainer.logger lists 'wandb' but wandb is not installed; skipping it")
            return None
        return wandb.init(project=project, name=experiment, config=config)

    def _append(self, path: str, record: dict[str, Any]) -> None:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """One training step's metrics."""
        record = {"step": int(step), **{k: _json_value(v) for k, v in metrics.items()}}
        if "jsonl" in self.sinks:
            self._append(self.metrics_path, record)
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, float(value), step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(dict(metrics), step=step)

    def log_validation(self, step: int, metrics: dict[str, float], samples: list[dict] | None = None) -> None:
        """A validation result (step 0 = before training), to ``validation.jsonl``, TensorBoard and wandb; with
        ``samples`` (``trainer.log_val_generations``) those generations too, as text / a wandb table."""
        self._append(self.validation_path, {"step": int(step), **{k: _json_value(v) for k, v in metrics.items()}})
        columns = ("input", "output", "gts", "score")
        if self._tb is not None:
            for key, value in metrics.items():
                self._tb.add_scalar(key, float(value), step)
            for i, sample in enumerate(samples or []):
                self._tb.add_text(f"val/generations/{i}", "\n\n".join(f"**{c}**: {sample.get(c)}" for c in columns), step)
            self._tb.flush()
        if self._wandb is not None:
            logged: dict[str, Any] = dict(metrics)
            if samples:
                import wandb  # type: ignore[import-not-found]

                logged["val/generations"] = wandb.Table(columns=["step", *columns],
                                                        data=[[step, *(str(s.get(c)) for c in columns)] for s in samples])
            self._wandb.log(logged, step=step)

    def console_summary(self, metrics: dict[str, float]) -> str:
        """A short ``key=value`` string of the headline metrics."""
        return " ".join(f"{short}={float(metrics[key]):.3g}" for key, short in CONSOLE_KEYS.items() if key in metrics)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
