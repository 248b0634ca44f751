"""The run configuration as nested dataclasses, with verl's key names.

The field defaults ARE the embedded default run (``python launch/train.py --algo dapo`` with nothing else):
SmolLM2-135M-Instruct on synthetic arithmetic prompts with a GSM8K validation subset, sized for a 2-core
CPU. ``configs/<algo>.yaml`` and presets overlay it; command-line ``a.b=c`` overrides come last.

Sections (verl's names): ``data``, ``model`` (verl's ``actor_rollout_ref.model``), ``actor``, ``rollout``,
``ref``, ``critic``, ``reward_model``, ``cost_model``, ``custom_reward_function``, ``algorithm``,
``trainer``, ``placement``. verl nests actor/rollout/ref under ``actor_rollout_ref``; here they are top-level
sections (the contract with the workers), and ``actor_rollout_ref.X.key=v`` overrides are accepted as
aliases of ``X.key=v`` (see ``jaxrl_hf.config.loader``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from jaxrl_hf.config.schema_memory import GpuMemoryConfig
from jaxrl_hf.config.schema_rewards import (CostModelConfig, CustomRewardFunctionConfig, OverlongBufferConfig,
                                            RewardModelConfig, ScoringModelConfig)
from jaxrl_hf.data.gsm8k import default_gsm8k_dir

# ---------------------------------------------------------------------------------------------- data


@dataclass
class ArithmeticDataConfig:
    """Synthetic arithmetic prompts (``jaxrl_hf.data.generate_arithmetic``). The default (1–2 digit ±) leaves
    SmolLM2-135M-Instruct room to learn: ~13% mean@4 before training (1-digit problems start at ~80%)."""

    min_digits: int = 1
    max_digits: int = 2
    operators: list[str] = field(default_factory=lambda: ["+", "-"])
    num_operands: int = 2


@dataclass
class DataConfig:
    """Prompts. ``train_files`` / ``val_files``: ``"arithmetic"`` (generated), ``"gsm8k"`` (the bundled
    GSM8K split) or a list of parquet/jsonl paths in verl's schema."""

    train_files: list[str] = field(default_factory=lambda: ["arithmetic"])
    val_files: list[str] = field(default_factory=lambda: ["arithmetic", "gsm8k"])
    train_size: int = 4096
    """Rows generated for ``arithmetic`` training data (ignored for files)."""
    val_size: int = 32
    """Rows per validation source (first N of each; 0 = all)."""
    val_size_per_source: dict[str, int] = field(default_factory=lambda: {"gsm8k": 16})
    """Per-dataset override of ``val_size`` (keys: names in ``val_files``)."""
    gsm8k_dir: str = field(default_factory=default_gsm8k_dir)
    """Directory holding GSM8K ``train.jsonl`` / ``test.jsonl`` (default: the copy shipped in the package)."""
    train_batch_size: int = 4
    """Prompts per RL step (each sampled ``rollout.n`` times)."""
    gen_batch_size: Optional[int] = None
    """Prompts per generation round in DAPO dynamic sampling (default: ``train_batch_size``)."""
    val_batch_size: Optional[int] = None
    """Prompts per validation generation call (default: all at once)."""
    ptx_files: list[str] = field(default_factory=list)
    """Pre-training (ptx) texts for Safe-RLHF's ptx loss: ``"gsm8k"`` (question + worked answer) or paths."""
    max_prompt_length: int = 64
    max_response_length: int = 32
    val_max_prompt_length: Optional[int] = 256
    """Prompt length limit of validation prompts (default: ``max_prompt_length``); validation only generates,
    so longer prompts (GSM8K) there do not widen the training batches."""
    filter_overlong_prompts: bool = True
    shuffle: bool = True
    sampler: Literal["random", "sequential", "curriculum"] = "random"
    seed: int = 0
    arithmetic: ArithmeticDataConfig = field(default_factory=ArithmeticDataConfig)


# --------------------------------------------------------------------------------------------- model


@dataclass
class TinyModelConfig:
    """Shape of the ``model.path=tiny-random`` model (smoke tests); the tokenizer is SmolLM2's."""

    vocab_size: int = 49152
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    head_dim: Optional[int] = None
    """Default ``hidden_size // num_heads``; vLLM's CPU attention needs >= 32 (``rollout.name=vllm``)."""
    max_position_embeddings: int = 2048
    pad_token_id: int = 0
    eos_token_id: int = 2
    bos_token_id: Optional[int] = 1
    tie_word_embeddings: bool = False


@dataclass
class ModelConfig:
    """The policy (and, by default, reference/critic backbone) model."""

    path: str = "smollm2-135m-instruct"
    """``smollm2-135m-instruct``, an HF directory, a ``.gguf`` file, or ``tiny-random``."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots", "dots_no_batch", "save_attn_out", "save_attn_out_mlp_in",
                   "dots_no_batch_attn_out"] = "none"
    """Gradient checkpointing policy of each decoder layer: ``none``; ``full`` (keep only layer inputs, recompute
    the rest); ``dots`` / ``dots_no_batch`` (keep all / the weight matmul outputs); ``save_attn_out`` (keep the
    attention output, recompute projections and MLP but not the attention); ``save_attn_out_mlp_in`` (also
    keep the MLP input); ``dots_no_batch_attn_out`` (weight matmuls and the attention output). See
    ``jaxrl_hf.models.llama.REMAT_POLICIES``."""
    enable_gradient_checkpointing: bool = False
    """verl's switch (``actor_rollout_ref.model.enable_gradient_checkpointing``): ``true`` means ``remat=full``
    unless ``remat`` names a policy."""
    attn_implementation: Literal["auto", "eager", "blockwise", "cudnn"] = "auto"
    """Self-attention without a KV cache: ``eager`` (materialises the [T, T] scores), ``blockwise``
    (flash-attention-style online softmax in pure JAX, O(T) memory), ``cudnn`` (cuDNN flash attention; GPU,
    bfloat16/float16), ``auto`` (cudnn where usable, else blockwise above 1024 tokens, else eager). Decoding
    over the KV cache is always eager. See ``jaxrl_hf.models.attention``."""
    seed: int = 0
    use_remove_padding: bool = False
    """Pack each micro-batch's rows into one sequence per device, no padding between them (verl's key; attention
    and positions per row): ``jaxrl_hf.workers.packing``. For the critic: ``critic.model``'s, else this one."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)


# --------------------------------------------------------------------------------------------- actor


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then a constant or cosine schedule."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_scheduler: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    total_steps: Optional[int] = None
    """Schedule length (default: ``trainer.total_steps``)."""


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    """A name in ``jaxrl_hf.algos.POLICY_LOSSES`` (``vanilla``, ``gspo``, ``cispo``, ``gpg``, or an ``imports`` one)."""


@dataclass
class RolloutCorrectionConfig:
    """Truncated importance sampling with the sampler's log-probs (rollout/trainer mismatch)."""

    level: Optional[Literal["token", "sequence", "geometric"]] = None
    threshold: float = 2.0
    bypass_mode: bool = False
    """Use the sampler's log-probs (``rollout_log_probs``) as π_old and skip ``actor.compute_log_prob`` (verl's
    bypass mode): one forward pass less per step. Right when the rollout engine computes the trainer's
    log-probs (mismatch ~1e-6 here, ``rollout_corr/*``); the mismatch metrics then read 0, and ``level``
    has nothing to correct, so the two are exclusive."""


@dataclass
class ActorConfig:
    """Policy update (verl ``actor_rollout_ref.actor``). Mini-batch in prompts, micro-batch in sequences."""

    ppo_mini_batch_size: int = 4
    ppo_micro_batch_size_per_device: int = 4
    ppo_epochs: int = 1
    shuffle: bool = False
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    grad_clip: float = 1.0
    log_prob_micro_batch_size_per_device: Optional[int] = None
    """Rows per device when computing log-probs (default: ``ppo_micro_batch_size_per_device``)."""
    use_dynamic_bsz: bool = False
    """Form update micro-batches by a token budget instead of a row count (verl's key): balanced over the dp
    devices, ``ppo_micro_batch_size_per_device`` unused. Also the default of the log-prob and critic passes."""
    ppo_max_token_len_per_gpu: Optional[int] = None
    """Valid tokens (prompt + response) per device per update micro-batch with ``use_dynamic_bsz``; with
    ``model.use_remove_padding`` also the packed length. At least one row (``max_prompt_length + response_length``)."""
    ptx_coef: float = 0.0
    """Safe-RLHF / InstructGPT pre-training (ptx) loss weight; > 0 needs ``data.ptx_files`` rows."""
    offload_optimizer: bool = False
    """Keep the optimizer state (Adam moments, 2x the fp32 params) in host memory outside ``update_actor``
    (verl's ``actor.fsdp_config.optimizer_offload``): moved off the devices after each update, back before
    the next update or a checkpoint save/load; results are bit-identical (``jaxrl_hf.workers.offload``)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    strategy: str = "megatron"
    """Sharding rule set of the actor's (and the reference's) params, grads and optimizer state, by name in
    ``jaxrl_hf.mesh.RULE_SETS``: ``megatron`` (tp/pp, replicated over dp), ``fsdp`` / ``fsdp2`` (verl's
    spellings: ZeRO-3 over dp; ``fsdp_tp`` when ``placement.train.tp > 1``), ``fsdp_tp``; with
    ``ulysses_sequence_parallel_size > 1`` their sequence-parallel variants (``sp``, ``fsdp_sp``, ``fsdp_tp_sp``)."""
    ulysses_sequence_parallel_size: int = 1
    """Ulysses sequence parallelism of actor training and log-probs (and the reference's): groups of this many
    data-parallel devices (it must divide ``placement.train.dp``) share rows, each holding ``1/sp`` of every
    sequence; attention switches to whole sequences over ``1/sp`` of the heads by an all-to-all. The query heads
    must divide by ``tp·sp``; fewer kv heads are repeated. Rows split over ``placement.train.dp / sp`` groups, so
    ``ppo_micro_batch_size_per_device`` counts rows per group (verl's meaning). Sequences are left-padded to a
    multiple of it. Rollouts do not use it (rows spread over all ``dp`` devices)."""


@dataclass
class RolloutValConfig:
    """Sampling for validation (verl ``val_kwargs``)."""

    n: int = 4
    temperature: float = 1.0
    top_p: float = 0.7
    greedy: bool = False
    """DAPO's evaluation: T=1.0, top-p 0.7, avg@k (here mean@4) — it tracks the sampling policy RL trains."""
    response_length: Optional[int] = 96
    """Longer than training's so GSM8K answers fit (null: ``rollout.response_length``)."""


@dataclass
class RolloutConfig:
    """Generation (verl ``actor_rollout_ref.rollout``)."""

    name: Literal["jax", "vllm"] = "jax"
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    max_prompt_length: Optional[int] = None
    """Default: ``data.max_prompt_length``."""
    response_length: Optional[int] = None
    """Default: ``data.max_response_length``."""
    seed: int = 0
    """Sampling seed (per step, call and dp rank; with ``name=vllm`` also vLLM's engine seed)."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """``compute_log_prob`` micro-batches by tokens (default: ``actor.use_dynamic_bsz``)."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Its token budget per device (default: ``actor.ppo_max_token_len_per_gpu``)."""
    loop: str = "single_turn"
    """Rollout loop run on the engine per rollout (``jaxrl_hf.rollout.loops``): ``single_turn`` (alias
    ``single_turn_agent``) or any loop registered with ``register_rollout_loop``."""
    val: RolloutValConfig = field(default_factory=RolloutValConfig)
    # vLLM engine options (``name=vllm`` only; null = the engine's default, see
    # ``jaxrl_hf.rollout.vllm_engine.VllmOptions``). verl's names where it has them.
    tensor_parallel_size: Optional[int] = None
    """vLLM tensor parallel size for one generation TP group (GPU; CPU supports 1)."""
    gpu_memory_utilization: Optional[float] = None
    """GPU share for vLLM's weights + KV cache (GPU only; default 0.5)."""
    kv_cache_gib: Optional[float] = None
    """vLLM KV cache size in GiB (CPU default 1)."""
    max_model_len: Optional[int] = None
    max_num_seqs: Optional[int] = None
    enforce_eager: Optional[bool] = None
    """No torch.compile / CUDA graphs (default true: faster start)."""
    enable_prefix_caching: Optional[bool] = None
    enable_sleep_mode: Optional[bool] = None
    """Free vLLM's KV cache between rollouts (default: on where supported, i.e. CUDA; CPU cannot)."""
    sleep_level: Optional[int] = None
    sleep_after_generate: Optional[bool] = None
    logprobs_mode: Optional[str] = None
    """vLLM log-prob mode: ``processed_logprobs`` (default) or ``raw_logprobs``."""
    allow_inexact_logprobs: Optional[bool] = None
    dtype: Optional[str] = None
    """vLLM compute dtype (default: ``model.dtype``)."""
    distributed_executor_backend: Optional[str] = None


@dataclass
class RefConfig:
    """Reference policy; uses ``model`` (a frozen copy of the initial actor)."""

    ulysses_sequence_parallel_size: Optional[int] = None
    """verl's key; the reference lives on the actor's mesh, so it must equal
    ``actor.ulysses_sequence_parallel_size`` (null: the actor's)."""
    log_prob_use_dynamic_bsz: Optional[bool] = None
    """``compute_ref_log_prob`` micro-batches by tokens (default: ``actor.use_dynamic_bsz``)."""
    log_prob_max_token_len_per_gpu: Optional[int] = None
    """Its token budget per device (default: ``actor.ppo_max_token_len_per_gpu``)."""


# -------------------------------------------------------------------------------------------- critic


@dataclass
class CriticConfig:
    """Value model (PPO). ``enable=None``: on exactly when ``algorithm.adv_estimator`` needs ``values`` (``gae``)."""

    enable: Optional[bool] = None
    model: Optional[ModelConfig] = None
    """Backbone of the critic (default: the actor's ``model``); a value head is added on top."""
    value_head_init_std: float = 0.0
    """Std of the value head's initial weights (0: V = 0 at the start)."""
    ppo_mini_batch_size: Optional[int] = None
    """Default: ``actor.ppo_mini_batch_size``."""
    ppo_micro_batch_size_per_device: Optional[int] = None
    """Default: ``actor.ppo_micro_batch_size_per_device``."""
    ppo_epochs: Optional[int] = None
    """Default: ``actor.ppo_epochs``."""
    use_dynamic_bsz: Optional[bool] = None
    """Micro-batches by token budget, as ``actor.use_dynamic_bsz`` (default: the actor's)."""
    ppo_max_token_len_per_gpu: Optional[int] = None
    """Tokens per device per update micro-batch (default: ``actor.ppo_max_token_len_per_gpu``)."""
    forward_max_token_len_per_gpu: Optional[int] = None
    """Tokens per device per ``compute_values`` micro-batch (default: ``critic.ppo_max_token_len_per_gpu``)."""
    shuffle: bool = False
    cliprange_value: float = 0.5
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    grad_clip: float = 1.0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    strategy: str = "megatron"
    """Sharding rule set of the critic (as ``actor.strategy``)."""
    ulysses_sequence_parallel_size: Optional[int] = None
    """Ulysses sequence parallelism of the critic (as ``actor.ulysses_sequence_parallel_size``). Null: the
    actor's (verl's own default is 1; following the actor keeps a long-sequence run's critic within memory too)."""


# ----------------------------------------------------------------------------------------- algorithm


@dataclass
class KLControlConfig:
    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: float = 10000.0


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: keep groups whose ``metric`` varies; refill up to ``max_num_gen_batches``."""

    enable: bool = False
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    max_num_gen_batches: int = 4
    """Generation rounds per step before giving up with an error (<= 0: unlimited)."""


@dataclass
class SafeRLHFConfig:
    """Safe-RLHF (Dai et al. 2023) Lagrangian: advantage = A_reward − λ·A_cost, λ ≥ 0 learned."""

    cost_limit: float = 0.0
    lambda_init: float = 1.0
    lambda_lr: float = 0.05
    lambda_max: float = 10.0


@dataclass
class AlgorithmConfig:
    """Advantage estimation and reward shaping (verl ``algorithm``)."""

    adv_estimator: str = "grpo"
    """A name in ``jaxrl_hf.algos.ADV_ESTIMATORS`` (``gae``, ``grpo``, ``rloo``, ... or an ``imports`` one)."""
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    safe_rlhf: SafeRLHFConfig = field(default_factory=SafeRLHFConfig)


# ------------------------------------------------------------------------------------------- trainer


@dataclass
class TrainerConfig:
    """The loop: steps, validation, checkpoints, logging."""

    total_steps: int = 30
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
    """Steps that update only the critic before the actor starts learning."""
    balance_batch: bool = True
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    progress_bar: bool = True
    export_hf: bool = False
    """Write the final actor as an HF safetensors directory to ``run_dir/hf_actor``."""
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
    """Peak FLOP/s of one device, for ``perf/mfu/actor`` (e.g. 989e12 for an H100 in bf16); null: not logged."""
    compilation_cache_dir: Optional[str] = "~/.cache/jaxrl_hf/xla"
    """JAX persistent compilation cache shared by the worker processes (null: off). A rerun skips XLA
    compilation (the smoke preset: ~2x faster); compiled programs are identical, so results are too."""


# ----------------------------------------------------------------------------------------- placement


@dataclass
class ParallelSizes:
    pp: int = 1
    tp: int = 1
    dp: Optional[int] = None
    """Null: the actor pool's devices / (pp·tp), so ``trainer.nnodes``/``n_gpus_per_node`` alone size it."""


@dataclass
class GenerateParallelSizes:
    """Generation layout ``p_g``/``t_g`` of the actor (3D-HybridEngine, HybridFlow §2.5): each must divide the
    training ``pp``/``tp``; ``d_g = pp·tp/(p_g·t_g)`` becomes micro data parallelism during rollouts.
    Null (default) or equal to ``placement.train``'s: generate on the training mesh, no reshard."""

    pp: Optional[int] = None
    tp: Optional[int] = None


@dataclass
class PoolConfig:
    """Where a secondary role runs: ``colocate=True`` shares the actor's pool (time-shared processes)."""

    colocate: bool = True
    num_processes: int = 1
    devices_per_process: int = 1


@dataclass
class PlacementConfig:
    """Devices and parallel sizes. CPU: ``num_processes`` Ray processes × ``devices_per_process`` host devices;
    GPU: one process per GPU (``devices_per_process`` 1)."""

    num_processes: Optional[int] = None
    """Processes of the actor pool. Null: ``trainer.nnodes × trainer.n_gpus_per_node / devices_per_process``
    when ``n_gpus_per_node`` is set, one per node when only ``trainer.nnodes`` is, else 1."""
    devices_per_process: int = 1
    cpus_per_process: float = 0.25
    train: ParallelSizes = field(default_factory=ParallelSizes)
    generate: GenerateParallelSizes = field(default_factory=GenerateParallelSizes)
    critic: PoolConfig = field(default_factory=PoolConfig)
    reward: PoolConfig = field(default_factory=PoolConfig)
    memory: GpuMemoryConfig = field(default_factory=GpuMemoryConfig)
    """Each GPU's memory between JAX and a colocated vLLM (`jaxrl_hf.config.memory_budget`)."""


# --------------------------------------------------------------------------------------------- root


ALGOS: tuple[str, ...] = ("dapo", "grpo", "ppo", "remax", "rloo", "reinforce_pp", "gspo", "safe_rlhf")
"""The ``--algo`` names: each has ``configs/<algo>.yaml`` and a step in ``jaxrl_hf.trainer.ALGORITHMS`` (tested)."""


@dataclass
class RunConfig:
    """Everything a run needs; ``algo`` names the control flow in ``jaxrl_hf.trainer.algorithms``."""

    algo: Literal[ALGOS] = "dapo"
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    imports: list[str] = field(default_factory=list)
    """Python files (``.py`` paths) or module names imported in the driver before the config is validated and in
    every worker process before its workers start, for what they register (``launch/train.py --import``)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (``config.yaml``, ``metrics.jsonl``); the workers receive the dataclass itself."""
        return dataclasses.asdict(self)


