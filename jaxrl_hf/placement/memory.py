"""Per-device memory estimates of one model under a parallel strategy.

Persistent state stays resident for the whole iteration (colocated models are time-shared but keep
their state: HybridFlow §2.3); transient memory (activations, KV cache, the generation weight shard)
exists only while the model runs, so a colocated set needs Σ persistent + max transient.
Activation sizes follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", §4: s·b·h·(10 + 24/t + 5·a·s/(h·t)) bytes per layer in 16-bit).
"""
from __future__ import annotations

import dataclasses
import math

from jaxrl_hf.placement.dataflow import ModelArch, Workload
from jaxrl_hf.placement.strategy import ParallelStrategy


@dataclasses.dataclass(frozen=True)
class SimOptions:
    """Precision and batching assumptions shared by the memory and latency models.

    weight_bytes/grad_bytes: bytes per parameter of the compute weights and gradients;
    optimizer_bytes: per parameter (fp32 master + Adam m, v = 12), sharded over all p·t·d devices
    (distributed optimizer) when shard_optimizer is set.  activation_recompute: full per-layer
    recomputation (stores layer inputs only, costs one extra forward).  max_decode_batch: the
    most sequences one generation replica decodes at once (vLLM's max_num_seqs).
    """

    dtype: str = "bf16"
    weight_bytes: int = 2
    grad_bytes: int = 2
    optimizer_bytes: int = 12
    shard_optimizer: bool = True
    activation_recompute: bool = True
    train_micro_batch: int = 2
    infer_micro_batch: int = 8
    max_decode_batch: int = 256

    def __post_init__(self) -> None:
        for f in ("weight_bytes", "grad_bytes", "train_micro_batch", "infer_micro_batch", "max_decode_batch"):
            if getattr(self, f) < 1:
                raise ValueError(f"SimOptions.{f} must be >= 1, got {getattr(self, f)}")
        if self.optimizer_bytes < 0:
            raise ValueError("SimOptions.optimizer_bytes must be >= 0")


def weight_shard_bytes(arch: ModelArch, model_parallel: int, opts: SimOptions) -> float:
    """Compute-weight bytes per device when the model is split over `model_parallel` devices."""
    return arch.num_params * opts.weight_bytes / model_parallel


def persistent_bytes(arch: ModelArch, trainable: bool, s: ParallelStrategy, opts: SimOptions) -> float:
    """Resident bytes per device: weights/(p·t), plus for a trainable model gradients/(p·t) and
    optimizer state/(p·t·d) (or /(p·t) without optimizer sharding)."""
    out = weight_shard_bytes(arch, s.model_parallel, opts)
    if trainable:
        out += arch.num_params * opts.grad_bytes / s.model_parallel
        shards = s.devices if opts.shard_optimizer else s.model_parallel
        out += arch.num_params * opts.optimizer_bytes / shards
    return out


def layer_activation_bytes(arch: ModelArch, tokens: int, seq_len: int, t: int, opts: SimOptions) -> float:
    """Working activations of one decoder layer for `tokens` tokens of sequences of `seq_len`
    (Korthikanti et al. eq. 2 with TP, scaled from 16-bit to weight_bytes, SwiGLU widened by f/4h)."""
    h, a = arch.hidden, arch.num_heads
    mlp_scale = arch.ffn_hidden / (4 * h) * 1.5  # SwiGLU keeps gate, up and their product
    per_token = h * (10 + (8 + 16 * mlp_scale) / t) + 5 * a * seq_len / t
    return tokens * per_token * opts.weight_bytes / 2


def logits_bytes(arch: ModelArch, tokens: int, t: int) -> float:
    """fp32 logits (vocab-parallel over t) plus their softmax gradient."""
    return tokens * arch.head_width * 4 * 2 / t


def train_transient_bytes(arch: ModelArch, wl: Workload, s: ParallelStrategy, opts: SimOptions) -> float:
    """Activation memory of a training step per device under 1F1B (stage 0 holds p micro-batches)."""
    per_replica = math.ceil(wl.num_sequences / (wl.optimizer_steps * s.d))
    mb_tokens = min(opts.train_micro_batch, per_replica) * wl.seq_len
    layers = arch.num_layers / s.p
    in_flight = s.p
    if opts.activation_recompute:
        stored = in_flight * layers * mb_tokens * arch.hidden * opts.weight_bytes
        working = layer_activation_bytes(arch, mb_tokens, wl.seq_len, s.t, opts)
    else:
        stored = in_flight * layers * layer_activation_bytes(arch, mb_tokens, wl.seq_len, s.t, opts)
        working = 0.0
    return stored + working + logits_bytes(arch, mb_tokens, s.t)


def infer_transient_bytes(arch: ModelArch, wl: Workload, s: ParallelStrategy, opts: SimOptions) -> float:
    """Forward-only activations: one layer's working set and the logits of a micro-batch."""
    mb_tokens = min(opts.infer_micro_batch, math.ceil(wl.num_sequences / s.d)) * wl.seq_len
    return layer_activation_bytes(arch, mb_tokens, wl.seq_len, s.t, opts) + logits_bytes(arch, mb_tokens, s.t) / 2


def kv_bytes_per_sequence(arch: ModelArch, wl: Workload, p_g: int, t_g: int, opts: SimOptions) -> float:
    """KV cache bytes per device for one sequence of prompt+response tokens; KV heads are split
    over t_g (replicated when t_g exceeds the KV head count) and layers over p_g."""
    kv_split = min(t_g, arch.num_kv_heads)
    return wl.seq_len * arch.kv_bytes_per_token(opts.weight_bytes) / (p_g * kv_split)


def generation_weight_extra_bytes(arch: ModelArch, s: ParallelStrategy, opts: SimOptions) -> float:
    """Extra weight memory while generating.  With the 3D-HybridEngine the generation shard
    (1/(p_g·t_g) of the weights) contains the training shard (1/(p·t)), so only the difference is new."""
    return weight_shard_bytes(arch, s.gen_model_parallel, opts) - weight_shard_bytes(arch, s.model_parallel, opts)


def generation_min_transient_bytes(arch: ModelArch, wl: Workload, s: ParallelStrategy, opts: SimOptions) -> float:
    """Smallest transient footprint of generation: the weight difference plus one sequence's KV."""
    return (generation_weight_extra_bytes(arch, s, opts)
            + kv_bytes_per_sequence(arch, wl, s.p_g, s.t_g, opts))


def min_devices_lower_bound(states: list[tuple[ModelArch, bool]], usable_bytes: float, opts: SimOptions) -> int:
    """Closed-form lower bound on A_min for a colocated set: every model fully sharded over the A
    devices (persistent bytes / A) must fit in the usable memory of one device."""
    total = 0.0
    for arch, trainable in states:
        per_param = opts.weight_bytes + (opts.grad_bytes + opts.optimizer_bytes if trainable else 0)
        total += arch.num_params * per_param
    return max(1, math.ceil(total / usable_bytes))


# How the small measured workload (`measure.py`) runs: f32 weights, gradients and Adam m/v
# (no master copy), optimizer state sharded like the weights, no recomputation, one micro-batch.
MEASURED_WORKLOAD_OPTIONS = SimOptions(dtype="f32", weight_bytes=4, grad_bytes=4, optimizer_bytes=8,
                                       shard_optimizer=False, activation_recompute=False,
                                       train_micro_batch=10**9, infer_micro_batch=10**9, max_decode_batch=10**9)
