"""The policy-training sections: ``actor`` (with its optimizer, policy loss and rollout correction), ``ref``
and ``critic`` (verl's ``actor_rollout_ref.actor``, ``actor_rollout_ref.ref``, ``critic``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from jaxrl_hf.config.schema_model import ModelConfig


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then a constant or cosine schedule."""

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0
    lr_warmup_steps_ratio: float = 0.0
    """verl's key: with ``warmup_steps`` 0, warm up for ``int(lr_warmup_steps_ratio · total_steps)`` steps."""
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
class RouterReplayConfig:
    """Routing replay of a mixture-of-experts policy (verl's ``actor.router_replay``): the update's forward passes
    use recorded experts instead of the router's current top-k (the router's probabilities still weight them, so
    its gradient flows; `jaxrl_hf.models.moe.route`)."""

    mode: Literal["disabled", "R2", "R3"] = "disabled"
    """``disabled``; ``R2``: replay the routing of the old-policy forward (``actor.compute_log_prob`` records it as
    the ``routed_experts`` column) in every update pass, so the routing stays that of π_old over the mini-batches
    and epochs of a step (a step that skips the old-policy pass, `skip_old_log_prob_when_on_policy`, needs none);
    ``R3``: replay the rollout engine's routing (the native engine records it: ``rollout.name=jax``, single-turn
    loops, one process) in the old-policy forward and the update."""


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
    router_aux_loss_coef: float = 0.0
    """Mixture-of-experts policies: weight of the Switch load-balancing loss (Qwen's ``router_aux_loss_coef``;
    `jaxrl_hf.algos.router_losses`). 0, as in verl's RL recipes: off (its value is still logged)."""
    router_z_loss_coef: float = 0.0
    """Mixture-of-experts policies: weight of the ST-MoE router z-loss (0: off, still logged)."""
    router_replay: RouterReplayConfig = field(default_factory=RouterReplayConfig)
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
    skip_old_log_prob_when_on_policy: bool = True
    """When a step's update is one optimizer step (``ppo_epochs`` 1 and the step's batch is one mini-batch), take
    π_old = stop_gradient(π_θ) inside the loss, as verl's actor does on that path (ratio exactly 1, the gradient
    of A·log π_θ), and skip the separate ``actor.compute_log_prob`` pass, whose output would only equal it up to
    rounding. Not taken where π_old is needed before the update: KL in the reward, ``rollout_correction.level``,
    asynchronous rollouts. The ``rollout_corr/*`` mismatch metrics need that pass: false keeps it."""
    share_prompt_forward: bool = True
    """Compute each prompt once for its ``rollout.n`` samples in the actor worker's forward passes (update, old and
    reference log-probs): the samples attend to the prompt's keys/values (`jaxrl_hf.workers.shared_prompt`); the same
    log-probs and gradients up to float summation order on about half the decoder's token positions at GRPO's
    shapes. Taken for padded row micro-batches of whole groups of equal prompts (checked in every pass) at widths
    where the padded forward's attention is eager; packed, token-budget, shuffled or sequence-parallel passes,
    blockwise / cuDNN widths and ``rollout.n`` 1 take the padded forward."""
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
