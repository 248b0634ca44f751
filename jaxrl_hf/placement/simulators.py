"""Latency simulators for training, inference and generation (HybridFlow §2.6 `simu`).

Each cost model adds four terms on the model's A = p·t·d devices:
  compute/memory  max(FLOPs / group FLOP/s, bytes / group bandwidth), × pipeline bubble (1+(p-1)/m),
  launch          per decoder layer per pass (`layer_overhead_s`),
  collectives     TP all-reduces of activations (2 per layer forward, 2 more backward), PP
                  point-to-point sends, DP gradient all-reduce per optimizer step, and the
                  3D-HybridEngine all-gather inside each micro-DP group before generation,
  none overlapped (a conservative, stated assumption).
Ring collectives: all-reduce 2(n-1)/n·V/β + 2(n-1)α, all-gather (n-1)/n·V/β + (n-1)α, where β is
NVLink-class bandwidth when the group lies inside one node and the NIC otherwise.
"""
from __future__ import annotations

import dataclasses
import math

from jaxrl_hf.placement.cluster import Cluster
from jaxrl_hf.placement.dataflow import ModelArch, Workload
from jaxrl_hf.placement.memory import SimOptions, kv_bytes_per_sequence
from jaxrl_hf.placement.strategy import ParallelStrategy


@dataclasses.dataclass(frozen=True)
class OpCost:
    """Predicted latency of one operation and the work behind it (for host-shared devices)."""

    latency_s: float
    flops: float  # matmul-rate-equivalent FLOPs (backward scaled by 1 / backward_efficiency)
    bytes_moved: float
    comm_s: float
    waves: int = 1
    kv_bytes: float = 0.0  # per-device KV cache in use (generation)


def ring_allreduce_s(nbytes: float, n: int, bandwidth: float, alpha: float) -> float:
    """Ring all-reduce of an nbytes buffer over n ranks: 2(n-1)/n·V/β + 2(n-1)α."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * alpha


def ring_allgather_s(total_bytes: float, n: int, bandwidth: float, alpha: float) -> float:
    """Ring all-gather producing a total_bytes buffer on each of n ranks: (n-1)/n·V/β + (n-1)α."""
    if n <= 1 or total_bytes <= 0:
        return 0.0
    return (n - 1) / n * total_bytes / bandwidth + (n - 1) * alpha


def _work_time(flops: float, nbytes: float, devices: int, cluster: Cluster, dtype: str) -> float:
    """Roofline time of work spread over `devices` devices: max(compute, memory)."""
    dev = cluster.device
    return max(flops / dev.group_flops(dtype, devices), nbytes / dev.group_bandwidth(devices))


def _tp_allreduce_s(nbytes: float, t: int, cluster: Cluster) -> float:
    return ring_allreduce_s(nbytes, t, cluster.link_bandwidth(t), cluster.device.collective_latency_s)


def simulate_train(arch: ModelArch, wl: Workload, s: ParallelStrategy, cluster: Cluster,
                   opts: SimOptions) -> OpCost:
    """Training step(s): epochs × sequences through forward + backward (+ recompute) and
    epochs × optimizer_steps optimizer updates with DP gradient all-reduce."""
    dev, seq = cluster.device, wl.seq_len
    tokens = wl.num_sequences * seq * wl.epochs
    passes = 3 + (1 if opts.activation_recompute else 0)
    fwd_flops = tokens * arch.forward_flops_per_token(seq)
    # forward passes (1, +1 recomputed) at the matmul rate, the backward (2× forward) at
    # backward_efficiency of it: counted as matmul-rate-equivalent FLOPs
    flops = fwd_flops * ((passes - 2) + 2 / dev.backward_efficiency)
    per_step_seqs = wl.num_sequences / wl.optimizer_steps
    mb_per_step = max(1, math.ceil(per_step_seqs / (s.d * opts.train_micro_batch)))
    steps = wl.epochs * wl.optimizer_steps
    micro_batches = mb_per_step * steps  # per DP replica
    bubble = 1 + (s.p - 1) / mb_per_step
    weights = arch.num_params * opts.weight_bytes
    weight_reads = micro_batches * passes * weights * s.d  # summed over all devices
    optimizer_bytes = steps * arch.num_params * 2 * (opts.weight_bytes + opts.grad_bytes + opts.optimizer_bytes)
    work = _work_time(flops, weight_reads + optimizer_bytes, s.devices, cluster, opts.dtype) * bubble
    launch = micro_batches * passes * arch.num_layers / s.p * dev.layer_overhead_s * bubble
    mb = min(opts.train_micro_batch, math.ceil(per_step_seqs / s.d))
    act_bytes = mb * seq * arch.hidden * opts.weight_bytes
    ar_per_layer = 2 * (1 + (1 if opts.activation_recompute else 0)) + 2
    tp = micro_batches * arch.num_layers / s.p * ar_per_layer * _tp_allreduce_s(act_bytes, s.t, cluster)
    pp = 0.0
    if s.p > 1:
        pp = micro_batches * 2 * (act_bytes / s.t / cluster.link_bandwidth(s.p * s.t) + dev.collective_latency_s)
    grad_bytes = arch.num_params * opts.grad_bytes / s.model_parallel
    dp = steps * ring_allreduce_s(grad_bytes, s.d, cluster.link_bandwidth(s.devices), dev.collective_latency_s)
    comm = tp + pp + dp
    return OpCost(work + launch + comm, flops, weight_reads + optimizer_bytes, comm)


def simulate_infer(arch: ModelArch, wl: Workload, s: ParallelStrategy, cluster: Cluster,
                   opts: SimOptions) -> OpCost:
    """One forward pass over all sequences (values, reference log-probs, rewards)."""
    dev, seq = cluster.device, wl.seq_len
    flops = wl.num_sequences * seq * arch.forward_flops_per_token(seq)
    micro_batches = max(1, math.ceil(wl.num_sequences / (s.d * opts.infer_micro_batch)))
    bubble = 1 + (s.p - 1) / micro_batches
    weight_reads = micro_batches * arch.num_params * opts.weight_bytes * s.d
    work = _work_time(flops, weight_reads, s.devices, cluster, opts.dtype) * bubble
    launch = micro_batches * arch.num_layers / s.p * dev.layer_overhead_s * bubble
    mb = min(opts.infer_micro_batch, math.ceil(wl.num_sequences / s.d))
    act_bytes = mb * seq * arch.hidden * opts.weight_bytes
    tp = micro_batches * arch.num_layers / s.p * 2 * _tp_allreduce_s(act_bytes, s.t, cluster)
    pp = 0.0
    if s.p > 1:
        pp = micro_batches * (act_bytes / s.t / cluster.link_bandwidth(s.p * s.t) + dev.collective_latency_s)
    return OpCost(work + launch + tp + pp, flops, weight_reads, tp + pp)


def reshard_for_generation_s(arch: ModelArch, s: ParallelStrategy, cluster: Cluster, opts: SimOptions) -> float:
    """3D-HybridEngine train→generate transition: all-gather inside each micro-DP group of d_g
    consecutive ranks; per-device traffic (d_g-1)/(p·t)·M (HybridFlow §2.5)."""
    gen_shard = arch.num_params * opts.weight_bytes / s.gen_model_parallel
    return ring_allgather_s(gen_shard, s.micro_dp, cluster.link_bandwidth(s.micro_dp),
                            cluster.device.collective_latency_s)


def simulate_generate(arch: ModelArch, wl: Workload, s: ParallelStrategy, cluster: Cluster,
                      opts: SimOptions, kv_budget_bytes: float) -> OpCost | None:
    """Prefill + autoregressive decode on A/(p_g·t_g) replicas of p_g×t_g devices.

    The per-device KV budget bounds the concurrent batch of a replica (and opts.max_decode_batch,
    like vLLM's max_num_seqs); a larger batch runs in several waves.  Each decode step reads the weight
    shard once per pipeline micro-batch (so p_g does not cut weight traffic, only memory), the KV
    cache of the batch, and does 2 TP all-reduces per layer.  Returns None when not even one
    sequence's KV cache fits.
    """
    if s.p_g is None:
        raise ValueError(f"strategy {s.label()} has no generation layout")
    dev = cluster.device
    pg, tg, replicas = s.p_g, s.t_g, s.gen_replicas
    kv_seq = kv_bytes_per_sequence(arch, wl, pg, tg, opts)
    cap = math.floor(kv_budget_bytes / kv_seq) if kv_budget_bytes < math.inf else opts.max_decode_batch
    cap = min(cap, opts.max_decode_batch)
    if cap < 1:
        return None
    per_replica = math.ceil(wl.num_sequences / replicas)
    waves = math.ceil(per_replica / cap)
    batch = math.ceil(per_replica / waves)
    P, R = wl.prompt_len, wl.response_len
    # prefill: all replicas in parallel, `waves` times
    pre_flops = replicas * batch * P * arch.forward_flops_per_token(P)
    pre_bytes = s.devices * arch.num_params * opts.weight_bytes / tg
    prefill = _work_time(pre_flops, pre_bytes, s.devices, cluster, opts.dtype)
    prefill += arch.num_layers * dev.layer_overhead_s
    prefill += 2 * arch.num_layers * _tp_allreduce_s(batch * P * arch.hidden * opts.weight_bytes, tg, cluster)
    # decode: R steps at the mean context length
    ctx = P + R / 2
    step_flops = replicas * batch * arch.forward_flops_per_token(int(ctx))
    kv_read = batch * ctx * arch.kv_bytes_per_token(opts.weight_bytes) / (pg * min(tg, arch.num_kv_heads))
    step_bytes = s.devices * (arch.num_params * opts.weight_bytes / tg + kv_read)
    bubble = 1 + (pg - 1) / pg
    step = _work_time(step_flops, step_bytes, s.devices, cluster, opts.dtype) * bubble
    step += arch.num_layers * dev.layer_overhead_s + dev.decode_step_overhead_s
    step_comm = 2 * arch.num_layers * _tp_allreduce_s(batch * arch.hidden * opts.weight_bytes / pg, tg, cluster)
    if pg > 1:
        step_comm += 2 * (pg - 1) * dev.collective_latency_s
    decode = R * (step + step_comm)
    comm = waves * (2 * arch.num_layers * _tp_allreduce_s(batch * P * arch.hidden * opts.weight_bytes, tg, cluster)
                    + R * step_comm)
    flops = waves * (pre_flops + R * step_flops)
    return OpCost(waves * (prefill + decode), flops, waves * (pre_bytes + R * step_bytes), comm, waves, batch * kv_seq)


def simulate_op(arch: ModelArch, wl: Workload, s: ParallelStrategy, cluster: Cluster, opts: SimOptions,
                kv_budget_bytes: float = math.inf) -> OpCost | None:
    """Dispatch on the workload kind."""
    if wl.kind == "train":
        return simulate_train(arch, wl, s, cluster, opts)
    if wl.kind == "infer":
        return simulate_infer(arch, wl, s, cluster, opts)
    return simulate_generate(arch, wl, s, cluster, opts, kv_budget_bytes)
