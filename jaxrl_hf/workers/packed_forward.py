"""The policy and value forward passes on packed micro-batches (``model.use_remove_padding``), returning the padded
layout's ``[rows, R]`` so the losses (`jaxrl_hf.workers.losses`, ``algos``) run on them unchanged.

A packed micro-batch (`jaxrl_hf.workers.packing.pack_tokens`) holds ``pack_input_ids``, ``pack_segment_ids``,
``pack_position_ids`` ``[D, L]`` (one sequence per data-parallel device; the segment ids are the decoder's
``attention_mask``, so a token attends causally within its own row only) and ``pack_gather [D·r, R]`` (row
``j`` belongs to device ``j // r``; entry ``t``: the packed index of the token before response token ``t``).
The decoder runs once over ``[D, L]``; the per-token outputs at ``pack_gather`` are exactly the padded
forward's ``[:, P - 1 : P - 1 + R]`` (attention sees the same keys with the same positions), so log-probs,
entropy and values equal the padded path's up to float summation order.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.forward import hidden_states, lm_head_kernel
from jaxrl_hf.models.logprobs import log_probs_and_entropy_from_hidden
from jaxrl_hf.models.value_head import value_forward
from jaxrl_hf.workers.losses import LogProbFn, ValueFn

Array = jax.Array


def gather_response_positions(per_token: Array, gather: Array) -> Array:
    """``per_token [D, L, ...]`` (outputs of ``D`` packed sequences) at ``gather [D·r, R]`` (indices into the
    owning sequence) -> ``[D·r, R, ...]``. A batched gather along each device's own sequence: no data moves
    between data-parallel shards."""
    devices = per_token.shape[0]
    rows, width = gather.shape
    index = gather.reshape(devices, (rows // devices) * width)
    picked = jax.vmap(lambda seq, idx: seq[idx])(per_token, index)  # [D, r·R, ...]
    return picked.reshape(rows, width, *per_token.shape[2:])


def _packed_inputs(micro: Mapping[str, Array]) -> tuple[Array, Array, Array]:
    return micro["pack_input_ids"], micro["pack_segment_ids"], micro["pack_position_ids"]


def packed_log_prob_fn(model_config: DecoderConfig, mesh: Any = None, rules: Any = None,
                       chunk_size: int = 128) -> LogProbFn:
    """``fn(params, micro, temperature) -> (log_prob, entropy)`` ``[D·r, R]`` on a packed micro-batch: the
    decoder over the packed sequences, the final hidden states gathered to the response slots, then the LM head
    and log-softmax(logits / T) of ``micro["responses"]`` as in `jaxrl_hf.workers.losses.response_log_probs`."""
    def fn(params: Any, micro: Mapping[str, Array], temperature: float) -> tuple[Array, Array]:
        hidden = hidden_states(params, model_config, *_packed_inputs(micro), mesh, rules)
        h = gather_response_positions(hidden, micro["pack_gather"])
        kernel = lm_head_kernel(params, model_config).astype(jnp.dtype(model_config.dtype))
        return log_probs_and_entropy_from_hidden(h, kernel, micro["responses"], temperature, chunk_size, True,
                                                 model_config.final_logit_softcapping)
    return fn


def packed_value_fn(model_config: DecoderConfig, mesh: Any = None, rules: Any = None) -> ValueFn:
    """``fn(params, micro) -> values [D·r, R]`` of the value model on a packed micro-batch (V of the state before
    each response token, as `jaxrl_hf.workers.losses.response_values`)."""
    def fn(params: Any, micro: Mapping[str, Array]) -> Array:
        values = value_forward(params, model_config, *_packed_inputs(micro), mesh, rules)
        return gather_response_positions(values, micro["pack_gather"])
    return fn
