"""The policy and value forward passes on packed micro-batches (``model.use_remove_padding``), returning the padded
layout's ``[rows, R]`` so the losses (`jaxrl_hf.workers.losses`, ``algos``) run on them unchanged.

A packed micro-batch (`jaxrl_hf.workers.packing.pack_tokens`) holds ``pack_input_ids``, ``pack_segment_ids``,
``pack_position_ids`` ``[D, L]`` (one sequence per data-parallel device; the segment ids are the decoder's
``attention_mask``, so a token attends causally within its own row only) and ``pack_rows [D·r, T]`` (row ``j``
belongs to device ``j // r``; entry ``c``: the packed index of the token in column ``c`` of its padded layout).
The decoder runs once over ``[D, L]``, its attention one row at a time when that computes no more scores than
the whole sequence would (`packed_config`); the per-token outputs at ``pack_rows[:, T - R - 1 : T - 1]`` are
exactly the padded forward's ``[:, P - 1 : P - 1 + R]`` (attention sees the same keys with the same positions),
so log-probs, entropy and values equal the padded path's up to float summation order.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.forward import (hidden_states, hidden_states_and_routing, lm_head_log_probs, routed_experts_by_layer,
                                     routed_experts_by_token)
from jaxrl_hf.models.packed_attention import per_row_attention_pays
from jaxrl_hf.models.row_layout import RowLayout
from jaxrl_hf.models.value_head import value_forward
from jaxrl_hf.workers.losses import LogProbFn, Routed, ValueFn

Array = jax.Array


def gather_response_positions(per_token: Array, gather: Array) -> Array:
    """``per_token [D, L, ...]`` (outputs of ``D`` packed sequences) at ``gather [D·r, W]`` (indices into the
    owning sequence) -> ``[D·r, W, ...]``. A batched gather along each device's own sequence: no data moves
    between data-parallel shards."""
    devices = per_token.shape[0]
    rows, width = gather.shape
    index = gather.reshape(devices, (rows // devices) * width)
    picked = jax.vmap(lambda seq, idx: seq[idx])(per_token, index)  # [D, r·W, ...]
    return picked.reshape(rows, width, *per_token.shape[2:])


def _packed_inputs(micro: Mapping[str, Array]) -> tuple[Array, Array, Array]:
    return micro["pack_input_ids"], micro["pack_segment_ids"], micro["pack_position_ids"]


def packed_config(model_config: DecoderConfig, micro: Mapping[str, Array]) -> DecoderConfig:
    """``model_config`` with the ``packed`` row layout ``(r, T)`` (from the static shapes of ``micro``) when attention
    one row at a time pays (`per_row_attention_pays`: no more scores than over the packed ``[L]`` sequence), else
    unchanged."""
    devices, length = micro["pack_input_ids"].shape
    rows, width = micro["pack_rows"].shape
    rows //= devices
    if not per_row_attention_pays(rows, width, length):
        return model_config
    return model_config.replace(row_layout=RowLayout("packed", (rows, width)))


def response_slots(micro: Mapping[str, Array]) -> Array:
    """``[D·r, R]``: for response token ``t`` of each row, the packed index of the token before it."""
    width, response = micro["pack_rows"].shape[1], micro["responses"].shape[1]
    return micro["pack_rows"][:, width - response - 1:width - 1]


def packed_log_prob_fn(model_config: DecoderConfig, mesh: Any = None, rules: Any = None,
                       chunk_size: int = 128, with_routing: bool = False, record_routing: bool = False) -> LogProbFn:
    """``fn(params, micro, temperature) -> (log_prob, entropy)`` ``[D·r, R]`` on a packed micro-batch: the
    decoder over the packed sequences, the final hidden states gathered to the response slots, then the LM head
    and log-softmax(logits / T) of ``micro["responses"]`` as in `jaxrl_hf.workers.losses.response_log_probs`.
    ``with_routing`` / ``record_routing`` and ``pack_routed_experts [D, L, layers, k]`` (routing replay, packed
    by `jaxrl_hf.workers.packing.pack_per_token`): as `jaxrl_hf.workers.losses.lm_log_prob_fn`'s, the recorded
    experts returned in the padded layout ``[D·r, T, layers, k]``."""
    def fn(params: Any, micro: Mapping[str, Array], temperature: float) -> tuple:
        config = packed_config(model_config, micro)
        given = micro.get("pack_routed_experts")
        replay = None if given is None else routed_experts_by_layer(given)
        hidden, routing = hidden_states_and_routing(params, config, *_packed_inputs(micro), mesh, rules, replay) \
            if with_routing or record_routing else \
            (hidden_states(params, config, *_packed_inputs(micro), mesh, rules, replay), None)
        h = gather_response_positions(hidden, response_slots(micro))
        out = lm_head_log_probs(params, model_config, h, micro["responses"], temperature, chunk_size, True)
        if record_routing:
            by_token = routed_experts_by_token(routing[1], micro["pack_input_ids"].shape[0])  # [D, L, layers, k]
            return (*out, gather_response_positions(by_token, micro["pack_rows"]))
        return out if routing is None else (*out, Routed(*routing, (micro["pack_segment_ids"] > 0).reshape(-1)))
    return fn


def packed_value_fn(model_config: DecoderConfig, mesh: Any = None, rules: Any = None) -> ValueFn:
    """``fn(params, micro) -> values [D·r, R]`` of the value model on a packed micro-batch (V of the state before
    each response token, as `jaxrl_hf.workers.losses.response_values`)."""
    def fn(params: Any, micro: Mapping[str, Array]) -> Array:
        values = value_forward(params, packed_config(model_config, micro), *_packed_inputs(micro), mesh, rules)
        return gather_response_positions(values, response_slots(micro))
    return fn
