"""The placement cost model's memory prediction for the same model, layout and batch as a compiled program.

`jaxrl_hf.placement.memory` predicts per-device bytes of a ``(p, t, d)`` strategy (HybridFlow §2.6's
simulator): persistent state (`persistent_bytes`, `weight_shard_bytes`) plus transient activations
(`train_transient_bytes`, `infer_transient_bytes`, Korthikanti et al. 2022) or, for generation, the weight shard
of ``(p_g, t_g)`` plus the KV cache (`kv_bytes_per_sequence`). It is called here with this framework's precision:
float32 params, gradients and Adam moments (``weight_bytes = grad_bytes = 4``, ``optimizer_bytes = 8``, no
separate master copy), the optimizer sharded over all devices exactly when the rule set shards the params over
``dp``, recomputation when ``model.remat`` is not ``none``, and the plan's micro-batch sizes. Its activation
terms scale with ``weight_bytes`` (so they assume float32 activations); its KV term is given the cache dtype.
The cost model has no ZeRO-3 weights: it keeps the weights and gradients whole over ``d`` whatever the strategy,
so beside an ``fsdp`` plan it over-predicts them by ``d``. Both numbers are reported side by side.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxrl_hf.models import DecoderConfig
from jaxrl_hf.placement.dataflow import ModelArch, Workload
from jaxrl_hf.placement.memory import (SimOptions, infer_transient_bytes, kv_bytes_per_sequence, persistent_bytes,
                                       train_transient_bytes, weight_shard_bytes)
from jaxrl_hf.placement.strategy import ParallelStrategy


def model_arch(model: DecoderConfig) -> ModelArch:
    """The cost model's view of a decoder (its head dim is ``hidden / heads``)."""
    return ModelArch(num_layers=model.num_hidden_layers, hidden=model.hidden_size,
                     num_heads=model.num_attention_heads, num_kv_heads=model.num_key_value_heads,
                     ffn_hidden=model.intermediate_size, vocab=model.vocab_size,
                     tied_embeddings=model.tie_word_embeddings)


@dataclasses.dataclass(frozen=True)
class CostModelInputs:
    """The plan's sizes in the cost model's terms."""

    strategy: ParallelStrategy
    options: SimOptions
    prompt_len: int
    response_len: int


def cost_model_inputs(model: DecoderConfig, pp: int, tp: int, dp: int, gen_pp: int, gen_tp: int,
                      shard_optimizer: bool, micro_per_device: int, log_prob_micro_per_device: int,
                      decode_batch_per_replica: int, prompt_len: int, response_len: int) -> CostModelInputs:
    """`CostModelInputs` for the framework's precision (module docstring)."""
    param_bytes = jnp.dtype(model.param_dtype).itemsize
    opts = SimOptions(dtype="bf16" if model.dtype == "bfloat16" else "f32", weight_bytes=param_bytes,
                      grad_bytes=param_bytes, optimizer_bytes=2 * param_bytes, shard_optimizer=shard_optimizer,
                      activation_recompute=model.remat != "none", train_micro_batch=micro_per_device,
                      infer_micro_batch=log_prob_micro_per_device, max_decode_batch=decode_batch_per_replica)
    return CostModelInputs(ParallelStrategy(pp, tp, dp, gen_pp, gen_tp), opts, prompt_len, response_len)


def predict(program: str, model: DecoderConfig, inputs: CostModelInputs, sequences: int) -> dict[str, Any]:
    """The cost model's per-device bytes for ``program`` (``update_actor``: ``sequences`` of one mini-batch;
    ``log_prob``: of one micro-batch; ``generate``: decoded at once per replica), with its terms."""
    arch, s, opts = model_arch(model), inputs.strategy, inputs.options
    P, R = inputs.prompt_len, inputs.response_len
    if program == "update_actor":
        wl = Workload("train", sequences, P, R)
        terms = {"persistent_bytes": persistent_bytes(arch, True, s, opts),
                 "transient_bytes": train_transient_bytes(arch, wl, s, opts)}
        functions = "persistent_bytes + train_transient_bytes"
    elif program == "log_prob":
        wl = Workload("infer", sequences, P, R)
        terms = {"weight_bytes": weight_shard_bytes(arch, s.model_parallel, opts),
                 "transient_bytes": infer_transient_bytes(arch, wl, s, opts)}
        functions = "weight_shard_bytes + infer_transient_bytes"
    elif program == "generate":
        wl = Workload("generate", sequences, P, R)
        kv_opts = dataclasses.replace(opts, weight_bytes=jnp.dtype(model.dtype).itemsize)
        terms = {"weight_bytes": weight_shard_bytes(arch, s.gen_model_parallel, opts),
                 "kv_cache_bytes": sequences * kv_bytes_per_sequence(arch, wl, s.p_g, s.t_g, kv_opts)}
        functions = "weight_shard_bytes(p_g·t_g) + sequences · kv_bytes_per_sequence"
    else:
        raise ValueError(f"unknown program {program!r}; valid: ['update_actor', 'log_prob', 'generate']")
    return {"predicted_bytes_per_device": int(sum(terms.values())), "terms": {k: int(v) for k, v in terms.items()},
            "functions": f"jaxrl_hf.placement.memory: {functions}", "strategy": s.label()}
