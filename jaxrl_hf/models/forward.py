"""Pure functions over a ``CausalLM`` param tree: init, logical axes, forward, log-probs.

``params`` everywhere is the *unboxed* tree ``{"model": {...}, "lm_head": {...}}`` (no ``"params"``
wrapper, no flax metadata boxes), so optax / orbax / jax.tree functions see plain arrays.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_hf.mesh.rules import logical_to_shardings
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.llama import REPLAY, CausalLM, default_positions
from jaxrl_hf.models.logprobs import log_probs_and_entropy_from_hidden

Params = dict[str, Any]


def freeze_rules(rules: Any) -> Any:
    """Logical-axis rules as nested tuples (hashable, so a module holding them can be a static jit arg)."""
    return tuple(tuple(r) for r in rules) if rules is not None else None


def make_module(config: DecoderConfig, mesh: Any = None, rules: Any = None) -> CausalLM:
    """The flax module; with ``mesh`` and ``rules`` its activation constraints are always applied."""
    return CausalLM(config, mesh, freeze_rules(rules))


def init_boxed(module: nn.Module, rng: jax.Array) -> Any:
    """Boxed (logically partitioned) params of a decoder-backed ``module`` from a 1×2 dummy batch; the shapes
    depend only on the config."""
    ids = jnp.zeros((1, 2), jnp.int32)
    mask = jnp.ones((1, 2), jnp.int32)
    return module.init(rng, ids, default_positions(mask), mask)["params"]


def _init_boxed(config: DecoderConfig, rng: jax.Array) -> Any:
    return init_boxed(make_module(config), rng)


def init_params(config: DecoderConfig, rng: jax.Array | int = 0) -> Params:
    """Random parameters (normal(0, fan_in^-1/2) kernels, unit norms) as a plain array tree."""
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    return nn.unbox(jax.jit(_init_boxed, static_argnums=0)(config, rng))


def param_logical_axes(config: DecoderConfig) -> Any:
    """Tree matching ``init_params(config)`` whose leaves are ``PartitionSpec``s of logical axis names.

    ``PartitionSpec`` is a tuple subclass and a pytree leaf; map it to mesh axes with
    ``jaxrl_hf.mesh.logical_to_shardings(tree, mesh, rules)``.
    """
    return jax.tree.map(lambda spec: spec, _param_logical_axes(config))  # a fresh tree: callers may edit theirs


@functools.lru_cache(maxsize=16)
def _param_logical_axes(config: DecoderConfig) -> Any:
    # traced once per config: the engine asks for the shardings at every weight sync, where tracing the module's
    # init took 0.14 s (a fifth of a GPU update of 16 x 1k tokens at 1.5 B parameters)
    return nn.get_partition_spec(jax.eval_shape(lambda: _init_boxed(config, jax.random.key(0))))


def param_shardings(config: DecoderConfig, mesh: jax.sharding.Mesh, rules: Any) -> Any:
    """``NamedSharding`` tree for the params under logical-to-mesh ``rules`` (the mesh/ resolver, divisibility
    checked against the param shapes)."""
    return logical_to_shardings(param_logical_axes(config), mesh, rules, shapes=_param_shapes(config))


def param_shapes(config: DecoderConfig) -> Any:
    """``jax.ShapeDtypeStruct`` tree matching ``init_params(config)`` (shapes and dtypes only, nothing allocated)."""
    return _param_shapes(config)


@functools.lru_cache(maxsize=16)
def _param_shapes(config: DecoderConfig) -> Any:
    return jax.eval_shape(lambda: nn.unbox(_init_boxed(config, jax.random.key(0))))


def _positions(attention_mask: jnp.ndarray | None, input_ids: jnp.ndarray,
               positions: jnp.ndarray | None) -> tuple[jnp.ndarray, jnp.ndarray]:
    if attention_mask is None:
        attention_mask = jnp.ones(input_ids.shape, jnp.int32)
    if positions is None:
        positions = default_positions(attention_mask)
    return attention_mask, positions


def forward(params: Params, config: DecoderConfig, input_ids: jnp.ndarray,
            attention_mask: jnp.ndarray | None = None, positions: jnp.ndarray | None = None,
            mesh: Any = None, rules: Any = None) -> jnp.ndarray:
    """Logits ``[B, T, vocab]`` float32 for ``input_ids [B, T]`` (left padding allowed via the mask)."""
    attention_mask, positions = _positions(attention_mask, input_ids, positions)
    logits, _ = make_module(config, mesh, rules).apply({"params": params}, input_ids, positions, attention_mask)
    return logits


def _variables(params: Params, config: DecoderConfig, routed_experts: jnp.ndarray | None) -> dict:
    """The module's variables: the params, and the `REPLAY` collection when ``routed_experts`` are given."""
    if routed_experts is None:
        return {"params": params}
    if not config.is_moe:
        raise ValueError("routed_experts (routing replay) given for a dense model (no MoE layers)")
    return {"params": params, REPLAY: {"model": {"layers": {"experts": routed_experts}}}}


def routed_experts_by_layer(per_token: jnp.ndarray) -> jnp.ndarray:
    """``[B, T, layers, k]`` experts of each token (a batch column) -> ``[layers, B·T, k]`` (the `REPLAY` layout)."""
    b, t, layers, k = per_token.shape
    return jnp.transpose(per_token, (2, 0, 1, 3)).reshape(layers, b * t, k).astype(jnp.int32)


def routed_experts_by_token(by_layer: jnp.ndarray, batch: int) -> jnp.ndarray:
    """The inverse of `routed_experts_by_layer`: ``[layers, B·T, k]`` -> ``[B, T, layers, k]``."""
    layers, n, k = by_layer.shape
    return jnp.transpose(by_layer.reshape(layers, batch, n // batch, k), (1, 2, 0, 3))


def hidden_states(params: Params, config: DecoderConfig, input_ids: jnp.ndarray,
                  attention_mask: jnp.ndarray | None = None, positions: jnp.ndarray | None = None,
                  mesh: Any = None, rules: Any = None, routed_experts: jnp.ndarray | None = None) -> jnp.ndarray:
    """Final-norm hidden states ``[B, T, embed]`` (compute dtype). ``routed_experts [layers, B·T, k]`` (a
    mixture-of-experts model): the experts each MoE layer uses for each token (routing replay, `REPLAY`)."""
    attention_mask, positions = _positions(attention_mask, input_ids, positions)
    module = make_module(config, mesh, rules)
    hidden, _ = module.apply(_variables(params, config, routed_experts), input_ids, positions, attention_mask,
                             method=CausalLM.hidden_states)
    return hidden


def hidden_states_and_routing(params: Params, config: DecoderConfig, input_ids: jnp.ndarray,
                              attention_mask: jnp.ndarray | None = None, positions: jnp.ndarray | None = None,
                              mesh: Any = None, rules: Any = None,
                              routed_experts: jnp.ndarray | None = None) -> tuple[jnp.ndarray, tuple | None]:
    """`hidden_states` and, for a mixture-of-experts model, the routing of the same pass: ``(router_logits
    [L, B·T, E] float32, router_experts [L, B·T, k] int32)`` (``-1`` experts in a dense layer; `jaxrl_hf.models.moe`),
    ``None`` for a dense model. ``routed_experts``: `hidden_states`' (the experts returned are then those)."""
    if not config.is_moe:
        return hidden_states(params, config, input_ids, attention_mask, positions, mesh, rules, routed_experts), None
    attention_mask, positions = _positions(attention_mask, input_ids, positions)
    module = make_module(config, mesh, rules)
    (hidden, _), state = module.apply(_variables(params, config, routed_experts), input_ids, positions,
                                      attention_mask, method=CausalLM.hidden_states, mutable=["intermediates"])
    layers = state["intermediates"]["model"]["layers"]
    return hidden, (layers["router_logits"][0], layers["router_experts"][0])


CAST_TO_COMPUTE_DTYPE = ("kernel", "bias", "embedding")
"""The parameter leaves the model multiplies in its compute dtype (a norm's ``scale`` is used in float32)."""


def compute_dtype_weights(params: Params, config: DecoderConfig) -> Params:
    """``params`` with every leaf the model casts to its compute dtype before use (`CAST_TO_COMPUTE_DTYPE`)
    already cast: the same forward pass bit for bit, with the cast done once instead of in every call (or, in a
    decode loop, every step). Unchanged for a float32 model."""
    dtype = jnp.dtype(config.dtype)
    if dtype == jnp.float32:
        return params

    def cast(path: tuple, leaf: jnp.ndarray) -> jnp.ndarray:
        name = getattr(path[-1], "key", None)
        return leaf.astype(dtype) if name in CAST_TO_COMPUTE_DTYPE and leaf.dtype == jnp.float32 else leaf

    return jax.tree_util.tree_map_with_path(cast, params)


def decode_weights(params: Params, config: DecoderConfig) -> Params:
    """`compute_dtype_weights`, with the stacked decoder layers' 16-bit weights stored as their bit patterns
    (``uint16``; `jaxrl_hf.models.llama.from_bits` reads them back, bit for bit).

    XLA:CPU has no bf16 ``dynamic-slice``: in a layer loop it converts the stacked bf16 weights to float32 once and
    slices and converts each layer's weights back to bf16 at every step (for a decode loop: per layer and per
    token, a fifth of the op time of a SmolLM2-135M decode step at batch 32). An integer slice is native: the loop
    copies half the bytes and converts nothing."""
    params = compute_dtype_weights(params, config)
    if jnp.dtype(config.dtype).itemsize != 2 or "layers" not in params.get("model", {}):
        return params

    def bits(path: tuple, leaf: jnp.ndarray) -> jnp.ndarray:
        name = getattr(path[-1], "key", None)
        cast = name in CAST_TO_COMPUTE_DTYPE and leaf.dtype == jnp.dtype(config.dtype)
        return jax.lax.bitcast_convert_type(leaf, jnp.uint16) if cast else leaf

    layers = jax.tree_util.tree_map_with_path(bits, params["model"]["layers"])
    return {**params, "model": {**params["model"], "layers": layers}}


def lm_head_kernel(params: Params, config: DecoderConfig) -> jnp.ndarray:
    """The ``[embed, vocab]`` output projection (the transposed embedding when tied)."""
    if config.tie_word_embeddings:
        return params["model"]["embed_tokens"]["embedding"].T
    return params["lm_head"]["kernel"]


def lm_head_weight(params: Params, config: DecoderConfig) -> tuple[jnp.ndarray, bool]:
    """``(weight, vocab_major)``: the output projection as stored, as `log_probs_and_entropy_from_hidden` takes
    it. A tied embedding stays ``[vocab, embed]`` (``vocab_major``), so its gradient is computed in that layout
    rather than transposed from ``[embed, vocab]`` (a copy of the vocabulary-sized gradient). The weight is not
    cast here: the product casts it to the compute dtype, so its gradient comes out in the stored dtype (the
    float32 master weights: no bf16 rounding, no casts of a vocabulary-sized array back and forth). The price: a
    sequence of several LM-head chunks casts the weight once per chunk in the backward (one chunk: once)."""
    if config.tie_word_embeddings:
        return params["model"]["embed_tokens"]["embedding"], True
    return params["lm_head"]["kernel"], False


def lm_head_log_probs(params: Params, config: DecoderConfig, hidden: jnp.ndarray, targets: jnp.ndarray,
                      temperature: float | jnp.ndarray = 1.0, chunk_size: int = 128,
                      with_entropy: bool = True) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(log p(targets), entropy)`` ``[B, T]`` float32 of the model's LM head over ``hidden [B, T, E]``
    (`log_probs_and_entropy_from_hidden` with `lm_head_weight` and the model's final logit soft-cap)."""
    weight, vocab_major = lm_head_weight(params, config)
    return log_probs_and_entropy_from_hidden(hidden, weight, targets, temperature, chunk_size, with_entropy,
                                             config.final_logit_softcapping, vocab_major)


def token_log_probs_and_entropy(params: Params, config: DecoderConfig, input_ids: jnp.ndarray,
                                targets: jnp.ndarray, attention_mask: jnp.ndarray | None = None,
                                positions: jnp.ndarray | None = None, temperature: float | jnp.ndarray = 1.0,
                                chunk_size: int = 128, with_entropy: bool = True, mesh: Any = None,
                                rules: Any = None) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``log softmax(logits_t / temperature)[targets_t]`` and the entropy at every position ``t``.

    ``targets[b, t]`` is the token scored at position ``t`` (usually ``input_ids[b, t + 1]``, see
    ``next_token_targets``). Both outputs are ``[B, T]`` float32; entries at padded or unused
    positions are meaningless and must be masked by the caller.
    """
    hidden = hidden_states(params, config, input_ids, attention_mask, positions, mesh, rules)
    return lm_head_log_probs(params, config, hidden, targets, temperature, chunk_size, with_entropy)


def next_token_targets(input_ids: jnp.ndarray, fill: int = 0) -> jnp.ndarray:
    """``input_ids`` shifted left by one (``targets[:, t] = input_ids[:, t+1]``), last column ``fill``."""
    return jnp.concatenate([input_ids[:, 1:], jnp.full((input_ids.shape[0], 1), fill, input_ids.dtype)], axis=1)
