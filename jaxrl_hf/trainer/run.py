"""The RL training loop: ``run(algo, preset=None, overrides=())`` is ``python launch/train.py``.

``RLTrainer.fit()``: resume (or start), validate before training, then per step: the algorithm's step
(``jaxrl_hf.trainer.algorithms``) -> metrics -> ``metrics.jsonl`` / console -> validation every
``test_freq`` -> checkpoint every ``save_freq``; at the end a final validation, checkpoint, optional HF
export and a summary (validation accuracy before -> after, where the outputs are).

Determinism: prompts come from a resumable loader, every generation round's seed is a function of
(``rollout.seed``, step, round), uids of (step, round, row) and the workers' state (params, optimizer, RNG)
is checkpointed; a resumed run therefore logs the same metrics (except ``timing_s/*``, ``perf/*``) as an
uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any

import numpy as np

from jaxrl_hf.config import ConfigError, dump_config, load_config
from jaxrl_hf.config.run_length import rows_per_step, with_run_length
from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.controller import Batch, set_call_timeout
from jaxrl_hf.errors import ExitCode
from jaxrl_hf.trainer.advantage import KLController
from jaxrl_hf.trainer.algorithms import ALGORITHMS
from jaxrl_hf.trainer.async_rollout import AsyncRollout
from jaxrl_hf.trainer.checkpoint_restore import model_changes, restore_newest
from jaxrl_hf.trainer.checkpointing import CheckpointError, CheckpointManager, load_trainer_state
from jaxrl_hf.trainer.data import collate_prompts, load_split, load_tokenizer, make_train_loader, ptx_examples
from jaxrl_hf.trainer.dynamic_sampling import DynamicSamplingError
from jaxrl_hf.trainer.exit_path import report
from jaxrl_hf.trainer.generations import dump_generations, generation_records, show_samples
from jaxrl_hf import progress
from jaxrl_hf.trainer.logging import MetricLogger, ProgressBar, read_jsonl
from jaxrl_hf.trainer.nonfinite import NonFiniteGuard
from jaxrl_hf.trainer.preemption import StopRequest
from jaxrl_hf.trainer.run_dir import RunDirLock, check_fresh_start, check_resume_config
from jaxrl_hf.trainer.metrics import data_metrics, entropy_metric, mfu_metric, throughput_metrics, timing_metrics
from jaxrl_hf.trainer.preflight import pin_driver_to_cpu, quick_preflight
from jaxrl_hf.trainer.roles import RoleBuilder
from jaxrl_hf.trainer.scoring import RewardFunction
from jaxrl_hf.trainer.step import (UID_STRIDE_ROUND, UID_STRIDE_STEP, Roles, StepContext, generation_seed,
                                   seeded_prompts)
from jaxrl_hf.trainer.validation import aggregate_validation

logger = logging.getLogger("jaxrl_hf.trainer")
STATE_VERSION = 1


class RLTrainer:
    """Owns the data, the worker groups, logging and checkpoints of one run."""

    def __init__(self, config: RunConfig) -> None:
        config = resolved_compute_dtype(config)  # model.dtype=auto: one dtype for every role and process
        self.config = config
        self.run_dir = os.path.abspath(config.trainer.run_dir)
        self.ckpt = CheckpointManager(os.path.join(self.run_dir, "checkpoints"), config.trainer.max_ckpt_to_keep)
        self._first_step = 1
        """The first step this process runs (its calls compile the XLA programs)."""
        self.step_fn = ALGORITHMS[config.algo]
        self.kl_ctrl = KLController.from_config(config.algorithm.kl_ctrl)
        self.algo_state: dict[str, Any] = {}
        self.global_step = 0
        self.roles: Roles | None = None
        self.async_rollout: AsyncRollout | None = None

    # ------------------------------------------------------------------ setup
    def _setup_data(self) -> None:
        c = self.config
        self.tokenizer = load_tokenizer(c.model.path)
        train = load_split(c, "train", self.tokenizer)
        rows = [row for rows in train.values() for row in rows]
        per_round = rows_per_step(c)
        if per_round >= UID_STRIDE_ROUND:
            raise ConfigError(f"config key 'data.gen_batch_size'={per_round}: must be < {UID_STRIDE_ROUND}")
        self.config = c = with_run_length(c, len(rows))  # trainer.total_epochs counts the rows read here
        self.loader = make_train_loader(c, rows, per_round)
        self.val_sets = load_split(c, "val", self.tokenizer) if c.data.val_files else {}
        self.ptx = ptx_examples(c, self.tokenizer) if c.actor.ptx_coef > 0 else None

    def next_prompts(self, round_: int, step: int | None = None) -> Batch:
        """The loader's next batch as a prompt Batch with uids unique to (step, round, row); ``step`` defaults
        to the current one (asynchronous training draws the next steps' first rounds ahead)."""
        step = self.global_step if step is None else step
        rows = self.loader.next_batch()
        uid_base = step * UID_STRIDE_STEP + round_ * UID_STRIDE_ROUND
        return collate_prompts(rows, self.tokenizer, self.config.data.max_prompt_length, uid_base)

    def _start_async_rollout(self) -> None:
        """With a split rollout group: its work queue, and the actor's (restored) weights handed to it."""
        if self.roles.rollout is None:
            return
        c = self.config
        self.async_rollout = AsyncRollout(
            self.roles.rollout, self.roles.actor, c.trainer.max_staleness,
            lambda step: seeded_prompts(self.next_prompts(0, step), c.rollout.seed, step, 0),
            self.loader.state_dict, last_step=c.trainer.total_steps,
            prefetch=c.algo != "remax")  # ReMax's greedy baseline needs the step's prompts
        if self.global_step > 0:
            self.async_rollout.push_weights(self.global_step)

    def ptx_batch(self, step: int) -> Batch:
        """This step's pre-training batch (a deterministic slice of the ptx examples)."""
        assert self.ptx is not None
        size = self.config.data.train_batch_size * self.config.rollout.n
        start = ((step - 1) * size) % max(len(self.ptx) - size + 1, 1)
        return self.ptx[start : start + size]

    # ------------------------------------------------------------------ checkpoints
    def trainer_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "global_step": self.global_step, "algo": self.config.algo,
                "seed": self.config.trainer.seed, "rollout_seed": self.config.rollout.seed,
                "loader": self._loader_state(), "kl_ctrl": self.kl_ctrl.state_dict(), "algo_state": self.algo_state}

    def _loader_state(self) -> dict[str, Any]:
        state = self.loader.state_dict()
        return self.async_rollout.loader_state_for_checkpoint(state) if self.async_rollout is not None else state

    def save_checkpoint(self) -> str:
        assert self.roles is not None
        parts = {"actor": self.roles.actor.save_checkpoint}
        for name in ("critic", "cost_critic"):
            group = getattr(self.roles, name)
            if group is not None:
                parts[name] = group.save_checkpoint
        return self.ckpt.save(self.global_step, parts, self.trainer_state())

    def restore(self, path: str) -> None:
        assert self.roles is not None
        state = load_trainer_state(path)
        if state.get("algo") != self.config.algo:
            raise CheckpointError(f"checkpoint {path} is from --algo {state.get('algo')}, this run is --algo {self.config.algo}")
        self.roles.actor.load_checkpoint(os.path.join(path, "actor"))
        for name in ("critic", "cost_critic"):
            group = getattr(self.roles, name)
            if group is not None:
                group.load_checkpoint(os.path.join(path, name))
        self.loader.load_state_dict(state["loader"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        self.algo_state = dict(state.get("algo_state") or {})
        self.global_step = int(state["global_step"])

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Sample ``rollout.val.n`` responses per validation prompt; mean@N / best@N / maj@N per source.
        Each source is generated separately, so short arithmetic prompts are not padded to GSM8K's length."""
        c, start = self.config, time.perf_counter()
        v = c.rollout.val
        scored, records = [], []
        self.val_samples: list[dict] = []
        uid = 0
        total = sum(len(rows) for rows in self.val_sets.values())
        with progress.task(f"validation ({v.n} samples each)", total, "prompts") as prompts_done:
            for name, rows in self.val_sets.items():
                size = c.data.val_batch_size or len(rows)
                for i in range(0, len(rows), size):
                    chunk = rows[i : i + size]
                    prompts = collate_prompts(chunk, self.tokenizer, c.data.val_max_prompt_length, uid_base=uid)
                    uid += len(chunk)
                    prompts.meta_info.update({"validate": True, "n": v.n, "greedy": v.greedy,
                                              "temperature": v.temperature, "top_p": v.top_p,
                                              "response_length": v.response_length,
                                              "seed": generation_seed(c.rollout.seed, -1, uid)})
                    with progress.doing(f"{name}, prompts {i + 1}-{i + len(chunk)} of {len(rows)}"):
                        out = self.roles.actor.generate_sequences(prompts)
                    out = out.union(self.val_reward_fn(out).select(["seq_score", "score", "acc", "pred"], []))
                    records.extend(self._generation_records(out))
                    scored.append(out.select(["data_source", "uid", "seq_score", "acc", "pred"], []))
                    prompts_done.advance(len(chunk))
        if not scored:
            return {}
        batch = Batch.concat(scored, meta_conflict="first")
        self.val_samples = self._show_generations(records)
        metrics = aggregate_validation(list(batch["data_source"]), list(batch["uid"]),
                                       {"acc": batch["acc"], "score": batch["seq_score"]}, list(batch["pred"]), v.n)
        metrics["timing_s/testing"] = time.perf_counter() - start
        return metrics

    def _generation_records(self, out: Batch) -> list[dict]:
        t = self.config.trainer
        if not (t.validation_data_dir or t.log_val_generations > 0):
            return []
        return generation_records(out, self.tokenizer, self.global_step)

    def _show_generations(self, records: list[dict]) -> list[dict]:
        """Validation generations: dumped (``trainer.validation_data_dir``) and shown (``log_val_generations``)."""
        t = self.config.trainer
        if t.validation_data_dir:
            dump_generations(t.validation_data_dir, self.global_step, records)
        return show_samples(records, t.log_val_generations, self.global_step) if t.log_val_generations > 0 else []

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        c = self.config
        ctx = StepContext(c, self.roles, self.reward_fn, self.global_step, self.next_prompts, self.kl_ctrl,
                          state=self.algo_state, ptx_batch=self.ptx_batch if self.ptx is not None else None,
                          async_rollout=self.async_rollout)
        start = time.perf_counter()
        for group in (self.roles.actor, self.roles.critic, self.roles.cost_critic):
            if group is not None and "set_step" in group.method_names:
                group.set_step(self.global_step)  # seeds of mini-batch shuffles derive from the step
        first = " (its first calls compile XLA programs)" if self.global_step == self._first_step else ""
        with progress.doing(f"step {self.global_step}/{c.trainer.total_steps}{first}"):
            batch = self.step_fn(ctx)
        if self.async_rollout is not None and ctx.actor_updates():
            ctx.metrics.update(self.async_rollout.push_weights(self.global_step))  # the previous push's metrics
        ctx.timer.timings["step"] = time.perf_counter() - start
        if c.trainer.rollout_data_dir:
            dump_generations(c.trainer.rollout_data_dir, self.global_step,
                             generation_records(batch, self.tokenizer, self.global_step))
        metrics = {"training/global_step": float(self.global_step), "training/epoch": float(self.loader.epoch)}
        metrics.update(ctx.metrics)
        metrics.update(data_metrics(batch, use_critic=c.critic.enable))
        if "actor/entropy" not in metrics:
            metrics.update(entropy_metric(batch))
        if "rollout_log_probs" in batch and "old_log_probs" in batch:
            from jaxrl_hf.algos import compute_mismatch_metrics

            mm = compute_mismatch_metrics(np.asarray(batch["old_log_probs"]), np.asarray(batch["rollout_log_probs"]),
                                          np.asarray(batch["response_mask"]))
            metrics.update({f"rollout_corr/{k}": float(v) for k, v in mm.items()})
        devices = c.placement.num_processes * c.placement.devices_per_process
        metrics.update(timing_metrics(ctx.timer.timings, batch))
        metrics.update(throughput_metrics(batch, ctx.timer.timings, devices))
        shared = c.rollout.n if metrics.get("actor/shared_prompt_forward") == 1.0 else 1
        metrics.update(mfu_metric(batch, ctx.timer.timings, self.roles.actor_info, c.actor.ppo_epochs, devices,
                                  shared))
        if self.roles.critic_info:
            critic_devices = devices if c.placement.critic.colocate else c.placement.critic.num_processes * \
                c.placement.critic.devices_per_process
            metrics.update(mfu_metric(batch, ctx.timer.timings, self.roles.critic_info, c.critic.ppo_epochs,
                                      critic_devices, role="critic"))
        return metrics

    # ------------------------------------------------------------------ the loop
    def fit(self) -> int:
        c = self.config
        set_call_timeout(c.trainer.worker_timeout_s)
        enable_compilation_cache(c.trainer.compilation_cache_dir)
        enable_float32_matmuls(c.model.dtype)
        with RunDirLock(self.run_dir), progress.configured(c.trainer.progress_bar):
            return self._fit()

    def _fit(self) -> int:
        resume = self.ckpt.resume_path(self.config.trainer.resume_mode, self.config.trainer.resume_from_path)
        self._setup_data()  # first: the run length may depend on the training rows
        c = self.config
        changed: list[str] = []
        if resume is None:
            check_fresh_start(self.run_dir, c.trainer.overwrite)
        else:
            changed = check_resume_config(os.path.join(self.run_dir, "config.yaml"), c.to_dict(),
                                          c.trainer.allow_config_change)
            if changed:
                print("resuming with config changes:\n  " + "\n  ".join(changed), file=sys.stderr)
        if resume is None:  # a resume keeps the saved config.yaml until a checkpoint has restored
            dump_config(c, os.path.join(self.run_dir, "config.yaml"))
        self.reward_fn = RewardFunction(c, self.tokenizer)
        self.val_reward_fn = RewardFunction(c, self.tokenizer, validation=True)
        with progress.Heartbeat(c.trainer.progress_interval_s), RoleBuilder(c) as builder:
            with progress.doing("starting the workers (loading the model, placing it on the devices)"):
                self.roles = builder.build()
            if resume:  # the newest checkpoint that restores (auto: older ones when it fails)
                resume = restore_newest(self.ckpt, resume, self.restore, fallback=c.trainer.resume_mode == "auto",
                                        changed_model=model_changes(changed))
                dump_config(c, os.path.join(self.run_dir, "config.yaml"))
                progress.write(f"resumed from {resume} (step {self.global_step})")
            self._start_async_rollout()
            log = MetricLogger(self.run_dir, c.trainer.logger, resume_step=self.global_step, config=c.to_dict(),
                               project=c.trainer.project_name, experiment=c.trainer.experiment_name or c.algo)
            try:
                return self._loop(log, resumed=resume is not None)
            finally:
                log.close()
                self.reward_fn.close()
                self.val_reward_fn.close()

    def _loop(self, log: MetricLogger, resumed: bool) -> int:
        c = self.config
        self._first_step = self.global_step + 1  # the first step of this process compiles
        if c.trainer.val_only:
            val = self.validate()
            log.log_validation(self.global_step, val, self.val_samples)
            progress.write(f"validation of the step-{self.global_step} policy: {_headline(val)}")
            return 0
        if c.trainer.val_before_train and not resumed and self.val_sets:
            val = self.validate()
            log.log_validation(0, val, self.val_samples)
            progress.write(f"validation before training: {_headline(val)}")
        bar = ProgressBar(c.trainer.total_steps, start=self.global_step) if c.trainer.progress_bar else None
        nonfinite = NonFiniteGuard(c.trainer.max_nonfinite_steps)
        saved_at, save_s = None, None
        with StopRequest() as stop:
            try:
                while self.global_step < c.trainer.total_steps:
                    saved_at, save_s = self._one_step(log, bar, nonfinite, saved_at, save_s)
                    if stop.signal is not None:
                        if saved_at != self.global_step:
                            self.save_checkpoint()
                        print(f"jaxrl_hf: stopped by {stop.signal} after step {self.global_step}: checkpoint "
                              f"{self.ckpt.ckpt_dir}/global_step_{self.global_step}; run the same command to resume",
                              file=sys.stderr)
                        return int(ExitCode.PREEMPTED)
            finally:
                if bar is not None:
                    bar.close()
        if self.async_rollout is not None:
            self.async_rollout.drain()
        if c.trainer.export_hf:
            with progress.doing(f"exporting the actor as an HF model ({c.trainer.export_hf_dtype})"):
                self.roles.actor.export_hf(os.path.join(self.run_dir, "hf_actor"))
        self._summary(saved_at)
        return 0

    def _one_step(self, log: MetricLogger, bar: ProgressBar | None, nonfinite: NonFiniteGuard,
                  saved_at: int | None, save_s: float | None) -> tuple[int | None, float | None]:
        """Train, validate when due, log, then checkpoint when due (the step's metrics are on disk before its
        checkpoint: a crash between the two leaves a record the resume drops, never a missing one). Returns
        (the step last saved, seconds that save took: logged with the next step as ``timing_s/save_checkpoint``)."""
        c = self.config
        self.global_step += 1
        metrics = self.train_step()
        if save_s is not None:
            metrics["timing_s/save_checkpoint"] = save_s  # the save after the previous step
        is_last = self.global_step == c.trainer.total_steps
        if self.val_sets and ((c.trainer.test_freq > 0 and self.global_step % c.trainer.test_freq == 0) or is_last):
            last_val = self.validate()
            metrics.update(last_val)
            log.log_validation(self.global_step, last_val, self.val_samples)
        log.log(self.global_step, metrics)
        if "console" in c.trainer.logger:
            info = log.console_summary(metrics)
            if bar is not None:
                bar.update(self.global_step, info)
            else:
                progress.write(f"step {self.global_step}/{c.trainer.total_steps} {info}")
        nonfinite.check(self.global_step, metrics)
        save_s = None
        if c.trainer.save_freq > 0 and (self.global_step % c.trainer.save_freq == 0 or is_last):
            start = time.perf_counter()
            self.save_checkpoint()
            saved_at, save_s = self.global_step, time.perf_counter() - start
        return saved_at, save_s

    def _summary(self, saved_at: int | None) -> None:
        path = os.path.join(self.run_dir, "validation.jsonl")
        records = read_jsonl(path) if os.path.isfile(path) else []
        lines = [f"done: {self.config.algo}, {self.global_step} steps"]
        if records:
            first, last = records[0], records[-1]
            for key in sorted(k for k in last if k.startswith("val-core/") and "/acc/" in k):
                before = f"{_number(first[key])} (step {first['step']})" if key in first else "n/a"
                lines.append(f"  {key}: {before} -> {_number(last[key])} (step {last['step']})")
        lines.append(f"  metrics:     {os.path.join(self.run_dir, 'metrics.jsonl')}")
        lines.append(f"  validation:  {path}")
        if saved_at is not None:
            lines.append(f"  checkpoint:  {self.ckpt.ckpt_dir}/global_step_{saved_at}")
        if self.config.trainer.export_hf:
            lines.append(f"  HF export:   {os.path.join(self.run_dir, 'hf_actor')}")
        lines.append(f"  plot:        python launch/plot.py {self.run_dir}")
        print("\n".join(lines), file=sys.stderr)


def enable_compilation_cache(path: str | None) -> None:
    """Point JAX's persistent compilation cache at ``path`` for this process and the worker processes it
    starts (they inherit the environment of a local Ray cluster started afterwards). An explicit
    ``JAX_COMPILATION_CACHE_DIR`` in the environment wins."""
    if not path or "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")


MATMUL_PRECISION_ENV = "JAX_DEFAULT_MATMUL_PRECISION"


def enable_float32_matmuls(model_dtype: str) -> None:
    """``model.dtype=float32`` computes its matmuls in float32 on GPUs too: XLA:GPU would otherwise run float32
    dots on TF32 tensor cores (10-bit mantissa; on an H200 the model's log-probs then differed from transformers'
    float32 by up to 6e-3). Sets ``JAX_DEFAULT_MATMUL_PRECISION=highest`` for this process and the workers it
    starts, read when JAX is imported there (no effect on CPUs, which compute float32 dots in full); an explicit
    setting in the environment wins. bfloat16 runs keep the default (their float32 parts, e.g. the LM head's
    logits, may use TF32)."""
    if model_dtype == "float32" and MATMUL_PRECISION_ENV not in os.environ:
        os.environ[MATMUL_PRECISION_ENV] = "highest"


def resolved_compute_dtype(config: RunConfig) -> RunConfig:
    """The config with ``model.dtype=auto`` resolved once, in the driver, before any worker starts
    (`jaxrl_hf.workers.peak_flops.resolve_compute_dtype`; accelerators: ``trainer.device=cuda``, or ``auto`` on a
    host whose GPUs nvidia-smi lists), so that every role and process computes in the same dtype."""
    if config.model.dtype != "auto":
        return config
    from jaxrl_hf.trainer.preflight import quick_facts
    from jaxrl_hf.workers.peak_flops import resolve_compute_dtype

    device = config.trainer.device
    accelerator = device == "cuda" or (device == "auto" and bool(quick_facts().nvidia_gpus))
    dtype, why = resolve_compute_dtype("auto", accelerator)
    print(f"jaxrl_hf: model.dtype=auto: {dtype} ({why})", file=sys.stderr, flush=True)
    return dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))


def _number(value: Any) -> str:
    """A logged metric for the console: 3 decimals, or as stored when it is not finite ("nan" in the JSON)."""
    return f"{value:.3f}" if isinstance(value, (int, float)) else str(value)


def _headline(metrics: dict[str, float]) -> str:
    keys = sorted(k for k in metrics if k.startswith("val-core/") and "/acc/" in k)
    return ", ".join(f"{k[len('val-core/'):k.rindex('/acc/')]} acc={metrics[k]:.3f}" for k in keys) or "(no accuracy metric)"


def run(algo: str, preset: str | None = None, overrides: list[str] | tuple[str, ...] = (),
        imports: list[str] | tuple[str, ...] = ()) -> int:
    """Load the config and train; returns the process exit status (``jaxrl_hf.errors.ExitCode``: 0 done, 2 config,
    3 dynamic sampling exhausted, 4 data, 5 checkpoint, 6 worker, 1 a bug; the traceback goes to
    ``<run_dir>/error.log``).
    ``imports`` (``--import``): files / modules imported before the config is validated and in every worker."""
    try:
        config = load_config(algo, preset, list(overrides), imports=list(imports))
    except ConfigError as err:
        print(f"jaxrl_hf: config error: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    problems = quick_preflight(config)  # versions + nvidia-smi only (launch/doctor.py is the full check)
    if problems:
        print(f"jaxrl_hf: preflight: {problems[0]} (launch/doctor.py prints the full report)", file=sys.stderr)
        return 2
    pin_driver_to_cpu()
    try:
        return RLTrainer(config).fit()
    except (Exception, KeyboardInterrupt) as err:  # the one exit path: a message, error.log, the class's code
        return report(err, os.path.abspath(config.trainer.run_dir))
