"""The plan's rollout side with ``rollout.name=vllm``: the weight sync compiled like the other programs, vLLM's own
memory, and the two phases of a colocated GPU (verl's hybrid engine time-shares it).

* ``weight_sync``: the shard-wise sync (`jaxrl_hf.rollout.vllm_tp`) reshards one layer of one stacked leaf at a
  time into the vLLM TP layout, cast to the rollout dtype. Every distinct leaf's program is compiled on the plan's
  devices; the program reported is the one with the largest peak. JAX holds the rest of its state beside it.
* ``vllm``: per device, vLLM's weight shard (`tp_shard_shapes` in the rollout dtype), and its KV cache: vLLM takes
  ``gpu_memory_utilization`` of the GPU for weights + activations + KV cache, so the cache gets that less the
  weights and an activation allowance (`VLLM_ACTIVATION_BYTES_PER_TOKEN` × ``max_num_batched_tokens``); its
  capacity in tokens, and whether one whole sequence (prompt + response) fits.
* ``phases``: what one GPU holds at each stage of a step, with `CONTEXT_ALLOWANCE_BYTES` for what neither
  program's numbers contain (JAX's CUDA context, cuBLAS/cuDNN workspaces, NCCL communicators of both runtimes).
  - ``train`` (update, log-probs): vLLM asleep (KV cache freed; weights offloaded at sleep level 1, discarded at
    2: nothing left on the device) beside JAX's largest program;
  - ``sync``: vLLM's weights awake (overwritten in place), its KV cache still asleep, beside the sync program;
  - ``generate``: vLLM's whole share beside what JAX still holds. With XLA's default BFC allocator JAX keeps the
    high-water mark of its pool (freed buffers stay in the pool, not on the device), so it holds its training
    peak: this is the static split, JAX's programs within ``placement.memory.jax_fraction``. With
    ``placement.memory.allocator=platform`` freed buffers go back to the device and JAX holds only its state
    (params, and the optimizer and reference unless offloaded): the GPU is time-shared as verl colocates, and
    training may use all but vLLM's sleeping residue.

Not measured on a GPU here (none was available): the allowance and the per-token activation figure are stated
estimates; every other number is XLA's (compiled programs) or exact (shard shapes × dtype).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl_hf.memory_plan.programs import ActorLayout, CompiledProgram, _compile
from jaxrl_hf.memory_plan.report import memory_stats
from jaxrl_hf.models import param_logical_axes
from jaxrl_hf.rollout.vllm_budget import VLLM_ACTIVATION_BYTES_PER_TOKEN, vllm_footprint
from jaxrl_hf.rollout.vllm_engine import VllmOptions
from jaxrl_hf.rollout.vllm_tp import check_tp_divides, pad_rows, padded_vocab, take_layer, tp_sharding

GIB = 2 ** 30
CONTEXT_ALLOWANCE_BYTES = int(1.5 * GIB)
"""Per GPU, besides both programs' own numbers: JAX's CUDA context (vLLM's is inside its share), cuBLAS/cuDNN
workspaces and the NCCL communicators of JAX and vLLM. An estimate: not measured on a GPU here."""


def _leaves(layout: ActorLayout) -> list[tuple[str, Any, Any, Any, bool]]:
    """``(name, shape/dtype, training sharding, logical axes, stacked)`` of every param leaf."""
    flat_shapes = jax.tree_util.tree_flatten_with_path(layout.shapes)[0]
    shardings = jax.tree.leaves(layout.shardings, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
    axes = jax.tree.leaves(param_logical_axes(layout.model), is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    out = []
    for (path, shape), sharding, logical in zip(flat_shapes, shardings, axes, strict=True):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        out.append((name, shape, sharding, tuple(logical), "layers" in name.split("/")))
    return out


def weight_sync_program(layout: ActorLayout, tp: int, dtype: Any) -> CompiledProgram:
    """The sync's reshard programs (one per leaf: a layer of a stacked leaf, or the padded embedding / LM head)
    compiled on the plan's devices as ``[replicas, tp]``; the one with the largest peak per device."""
    # the TP groups over the training mesh's device order, so one program holds the reshard (at run time the groups
    # follow the process order and the move may be a device_put: the same bytes per device)
    grid = np.asarray(list(layout.mesh.devices.flat), dtype=object).reshape(-1, tp)
    mesh = Mesh(grid, ("replica", "tp"))
    vocab = padded_vocab(layout.model.vocab_size, tp)
    best, total_s = None, 0.0
    for name, shape, sharding, logical, stacked in _leaves(layout):
        leaf = jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding)
        if stacked:
            fn, args, out_logical = functools.partial(take_layer, dtype=dtype), (leaf, jnp.int32(0)), logical[1:]
        elif "vocab" in logical:
            fn = functools.partial(pad_rows, rows=vocab, axis=logical.index("vocab"), dtype=dtype)
            args, out_logical = (leaf,), logical
        else:
            continue  # a replicated norm: a few KB
        compiled, seconds = _compile(jax.jit(fn, out_shardings=tp_sharding(mesh, out_logical)), *args)
        total_s += seconds
        peak = memory_stats(compiled)["peak_bytes_per_device"]
        if best is None or peak > best[0]:
            best = (peak, name, compiled)
    peak, name, compiled = best
    shapes = {"largest_leaf": name, "tp": tp, "replicas": int(grid.shape[0]), "dtype": jnp.dtype(dtype).name}
    return CompiledProgram("weight_sync", compiled, shapes, 0, 0, total_s)


@dataclasses.dataclass(frozen=True)
class VllmMemory:
    """vLLM's memory on one GPU (module docstring)."""

    tp: int
    replicas: int
    share_bytes: int
    weight_bytes: int
    activation_bytes: int
    kv_cache_bytes: int
    kv_bytes_per_token: int
    max_model_len: int
    sleep_level: int

    @property
    def kv_tokens(self) -> int:
        return max(self.kv_cache_bytes, 0) // self.kv_bytes_per_token

    def report(self) -> dict[str, Any]:
        return {"tensor_parallel_size": self.tp, "replicas": self.replicas, "share_bytes_per_device": self.share_bytes,
                "weight_bytes_per_device": self.weight_bytes, "activation_allowance_bytes": self.activation_bytes,
                "kv_cache_bytes_per_device": self.kv_cache_bytes, "kv_cache_tokens": self.kv_tokens,
                "max_model_len": self.max_model_len, "one_sequence_fits": self.kv_tokens >= self.max_model_len,
                "sleep_level": self.sleep_level, "asleep_bytes_per_device": 0}


def vllm_memory(layout: ActorLayout, tp: int, share: float, device_memory: int) -> VllmMemory:
    """vLLM's weights and KV cache per device at ``gpu_memory_utilization = share`` (`vllm_footprint`)."""
    model, rollout = layout.model, layout.config.rollout
    check_tp_divides(model, tp, "placement.generate.tp")
    fp = vllm_footprint(model, tp=tp, dtype=rollout.dtype or model.dtype, max_model_len=sum(layout.seq_lengths),
                        share=share, device_bytes=device_memory)
    return VllmMemory(tp, len(layout.devices) // tp, int(share * device_memory), fp.weight_bytes, fp.activation_bytes,
                      fp.kv_cache_bytes, fp.kv_bytes_per_token, fp.max_model_len,
                      int(rollout.sleep_level or VllmOptions.sleep_level))


def phases(programs: dict[str, dict[str, Any]], vllm: VllmMemory, kept_bytes: int, device_memory: int,
           time_shared: bool, jax_cap: int) -> dict[str, dict[str, Any]]:
    """Bytes per GPU at each phase of a step and whether each fits (module docstring). ``kept_bytes``: JAX's state
    between programs; ``jax_cap``: JAX's pool limit (``jax_fraction`` of the GPU; the device when time-shared)."""
    train_peak = max(programs[p]["total_bytes_per_device"] for p in ("update_actor", "log_prob"))
    jax_during_generate = kept_bytes if time_shared else max(train_peak, programs["weight_sync"]["total_bytes_per_device"])
    rows = {
        "train": {"jax_bytes": train_peak, "vllm_bytes": 0},
        "sync": {"jax_bytes": programs["weight_sync"]["total_bytes_per_device"], "vllm_bytes": vllm.weight_bytes},
        "generate": {"jax_bytes": jax_during_generate, "vllm_bytes": vllm.share_bytes},
    }
    for row in rows.values():
        row["allowance_bytes"] = CONTEXT_ALLOWANCE_BYTES
        row["total_bytes"] = row["jax_bytes"] + row["vllm_bytes"] + CONTEXT_ALLOWANCE_BYTES
        row["fits"] = row["total_bytes"] <= device_memory and row["jax_bytes"] <= jax_cap
    return rows


__all__ = ["CONTEXT_ALLOWANCE_BYTES", "VLLM_ACTIVATION_BYTES_PER_TOKEN", "VllmMemory", "phases", "vllm_memory",
           "weight_sync_program"]
