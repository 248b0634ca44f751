"""The ``trainer`` section: steps, validation, checkpoints, logging, cluster shape."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

DEFAULT_TOTAL_STEPS = 30
"""The run length when neither ``trainer.total_steps`` nor ``trainer.total_epochs`` is given."""


@dataclass
class TrainerConfig:
    """The loop: steps, validation, checkpoints, logging."""

    total_steps: Optional[int] = None
    """Training steps of the run (verl's ``trainer.total_training_steps``); it wins over ``total_epochs``, as in
    verl. Null: ``total_epochs`` × steps per epoch when ``total_epochs`` is set (computed at start, when the
    training data is read), else `DEFAULT_TOTAL_STEPS`."""
    total_epochs: Optional[int] = None
    """verl's run length in passes over the training set: ``total_steps = total_epochs × (rows after filtering
    // rows per step)`` (the loader drops a short last batch, as verl's ``drop_last`` dataloader; rows per step is
    ``data.train_batch_size``, ``data.gen_batch_size`` under DAPO's dynamic sampling). Used only when
    ``total_steps`` is null (``jaxrl_hf.config.run_length``)."""
    seed: int = 0
    run_dir: Optional[str] = None
    """Default: ``runs/<experiment_name>``."""
    project_name: str = "jaxrl_hf"
    experiment_name: Optional[str] = None
    """Default: ``<algo>``."""
    test_freq: int = 15
    """Validate every N steps (and at the end); <= 0: only before/after."""
    val_before_train: bool = True
    val_only: bool = False
    """Only validate the (initial or resumed) policy, log it to validation.jsonl, and exit."""
    save_freq: int = 15
    """Checkpoint every N steps (and at the end); <= 0: never."""
    max_ckpt_to_keep: Optional[int] = 2
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: Optional[str] = None
    critic_warmup: int = 0
    """The actor starts learning at step ``critic_warmup`` (verl's ``critic_warmup <= global_steps``): steps
    1..k−1 update only the critic (and no ptx update runs); the actor's lr schedule starts at its first update."""
    balance_batch: bool = True
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    progress_bar: bool = True
    """Progress on the console (``jaxrl_hf/progress``). Where stderr is a terminal: tqdm bars for the steps,
    validation (prompts), DAPO's dynamic sampling (informative groups), model conversion and export (tensors), and
    a status line with the elapsed time of a stage whose amount of work is unknown (starting the workers, a step's
    generation, XLA compilation). Elsewhere (CI, ``nohup``): a line per step and the heartbeat lines of
    ``progress_interval_s``. False: none of it (the step's metrics still print when ``logger`` has ``console``)."""
    overwrite: bool = False
    """Start from scratch in a ``run_dir`` that holds an earlier run's metrics but no checkpoint to resume from
    (replacing its records); without it such a run refuses to start."""
    allow_config_change: bool = False
    """Resume although the config changes the model or the data order (``trainer/run_dir.RESUME_FIXED``); other
    changes are listed on resume and accepted."""
    max_nonfinite_steps: int = 3
    """Stop the run (exit code 7, naming the step, role and non-finite quantities) after this many steps in a row
    in which the actor or critic skipped every update for a non-finite loss or gradient norm; 0: never."""
    worker_timeout_s: float = 1800.0
    """Longest wait for any worker call (loading and compiling a large model takes minutes): ranks that have not
    answered by then stop the run, named (``WorkerTimeoutError``, exit code 6). 0: wait forever."""
    progress_interval_s: float = 30.0
    """Where stderr is not a terminal: while one stage (starting the workers, a validation, a step's generation or
    update, XLA compiling) runs longer than this, print what it is (with its count, e.g. ``validation 8/16
    prompts``) every this many seconds (``jaxrl_hf/progress/heartbeat.py``); 0: never."""
    rollout_data_dir: Optional[str] = None
    """Write each step's trained rollouts to ``<dir>/<step>.jsonl`` (prompt, response, ground truth, score, acc,
    reward, advantage: ``jaxrl_hf/trainer/generations.py``); null: off."""
    validation_data_dir: Optional[str] = None
    """Write each validation's generations to ``<dir>/<step>.jsonl`` (step 0 = before training); null: off."""
    log_val_generations: int = 0
    """Show this many validation samples (prompt, response, ground truth, score) after each validation: on the
    console, in TensorBoard (text) and wandb (a table)."""
    export_hf: bool = False
    """Write the final actor as an HF model directory to ``run_dir/hf_actor`` (the layout of
    ``launch/export_hf.py``: sharded safetensors, config, generation config, tokenizer files)."""
    export_hf_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the exported weights (``config.json``'s ``torch_dtype``/``dtype`` say the same)."""
    export_hf_max_shard_size: str = "5GB"
    """Largest safetensors shard (transformers' units: 5GB = 5·10^9 bytes, 2GiB = 2^31); more weights than this
    are split into ``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``."""
    ray_init_timeout_s: float = 180.0
    nnodes: Optional[int] = None
    """Ray nodes the actor pool spans (verl's key): ``placement.num_processes / nnodes`` processes on each of
    exactly that many nodes (``jaxrl_hf.config.cluster``). Null: 1 when ``n_gpus_per_node`` is set, else the
    pool goes wherever it fits (Ray's PACK: as few nodes as have room)."""
    n_gpus_per_node: Optional[int] = None
    """Devices of the actor pool on each node (verl's key): GPUs on a GPU cluster (one process per GPU), host
    devices on CPU. ``nnodes × n_gpus_per_node = placement.num_processes × placement.devices_per_process``;
    null: derived from ``placement``."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Accelerator of the worker processes (verl's key): ``cuda``: one GPU each, and a run that finds none fails
    at start (``launch/doctor.py``); ``cpu``: XLA host devices, also where GPUs exist; ``auto``: GPUs when the
    Ray cluster has any."""
    peak_flops_per_device: Optional[float] = None
    """Peak FLOP/s of one device, for ``perf/mfu/actor`` (e.g. 989e12 for an H100 in bf16); null: measured by the
    actor at start (a short matmul calibration, cached per machine: ``workers/peak_flops.py``)."""
    max_staleness: int = 0
    """Asynchronous training: how many actor updates old the rollout's weights may be when its batch is trained
    on. 0: synchronous (generate, then train; the default). k > 0 puts generation on a rollout group of its own
    (``placement.rollout.colocate`` becomes false; ``placement.rollout`` sizes it), which generates the batches
    of the next k steps while the actor trains and gets the weights after each update (`jaxrl_hf.trainer.async_rollout`); ``actor.rollout_correction.level`` then defaults to
    ``token`` (truncated importance sampling against the stale sampler)."""
    compilation_cache_dir: Optional[str] = "~/.cache/jaxrl_hf/xla"
    """JAX persistent compilation cache shared by the worker processes (null: off). A rerun skips XLA
    compilation; compiled programs are identical, so results are too."""
