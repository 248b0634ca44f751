"""Flax (linen) decoder for the Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 families, logical axis names.

Architecture (Touvron et al. 2023; Qwen2 adds a QKV bias): token embedding -> N x [RMSNorm ->
grouped-query attention with RoPE -> residual -> RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm ->
LM head (tied to the embedding or separate). Variants, all from ``DecoderConfig``: Qwen3 normalises each query
and key head (RMSNorm over ``head_dim``) before RoPE; sliding-window layers (Mistral, Qwen2/3 with
``use_sliding_window``, Gemma's local layers) see only the last ``sliding_window`` keys; Gemma 2 (Gemma Team
2024) scales the embedding by ``sqrt(hidden)``, uses ``x_hat * (1 + w)`` norms, GeGLU (tanh-gelu), also
normalises the attention and MLP outputs before each residual add, scales scores by ``query_pre_attn_scalar^-1/2``
and soft-caps attention and final logits (``c * tanh(z / c)``); Gemma 3 (text) adds q/k head norms and a RoPE
base of its own (``rope_local_theta``) for the sliding layers. Qwen3-MoE: Qwen3 with a sparse mixture-of-experts
block (`jaxrl_hf.models.moe`) in place of the MLP in its sparse layers (`DecoderConfig.moe_layers`); a model
mixing dense and sparse layers holds both parameter sets in every layer and runs the one the layer's flag picks.

Parameters carry logical axes (``vocab``, ``embed``, ``mlp``, ``heads``, ``kv_heads``, ``head_dim``;
the layers are stacked by ``nn.scan`` on a leading ``layers`` axis) and activations are constrained
to (``batch``, ``length``, ...); inside attention, around the score and value products, to (``batch``,
``attn_length``, ``attn_heads``/``attn_kv_heads``, ``head_dim``), so a rule set may lay the sequence out
differently there (Ulysses sequence parallelism: ``length`` split outside, heads split inside; the constraints
become all-to-alls). ``mesh/`` maps these names to mesh axes with rules.

Param tree of ``CausalLM`` (shapes without the ``layers`` axis where stacked)::

  model/embed_tokens/embedding          [vocab, embed]
  model/layers/input_layernorm/scale    [layers, embed]
  model/layers/self_attn/{q,k,v}_proj/kernel [layers, embed, heads|kv_heads, head_dim] (+ bias)
  model/layers/self_attn/{q,k}_norm/scale [layers, head_dim]                 (Qwen3)
  model/layers/self_attn/o_proj/kernel  [layers, heads, head_dim, embed]
  model/layers/post_attention_layernorm/scale
  model/layers/{pre,post}_feedforward_layernorm/scale [layers, embed]      (Gemma 2)
  model/layers/mlp/{gate,up}_proj/kernel [layers, embed, mlp];  down_proj/kernel [layers, mlp, embed]
  model/layers/moe/router/kernel        [layers, embed, expert]                 (MoE: `models.moe`)
  model/layers/moe/{gate,up}_proj/kernel [layers, expert, embed, mlp]; down_proj/kernel [layers, expert, mlp, embed]
  model/norm/scale                      [embed]
  lm_head/kernel                        [embed, vocab]   (absent when tied)

KV cache: ``{"k", "v"}: [layers, batch, kv_heads, cache_len, head_dim]`` (a row's and kv head's slots
contiguous: decoding reads a layer's cache as stored). ``T`` new tokens at slot ``cache_index`` (the same for all
rows: prompts are left-padded) attend over the slots ``s < cache_index`` that ``attention_mask[b, s]`` marks
valid, and over their own keys causally. The layer scan only reads the cache: each layer emits its new
keys/values (``CausalLM.hidden_states_and_new_kv``: ``[layers, batch, T, kv_heads, head_dim]``) and
``write_kv_cache`` stores them, one in-place ``dynamic_update_slice`` per tensor (written per layer inside the
scan, every layer's cache would be copied at every step). ``uint16`` caches hold 16-bit bit patterns.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxrl_hf.backends.cpu.panel_matmul import panel_matmul
from jaxrl_hf.mesh.rules import logical_to_spec
from jaxrl_hf.models.attention import cached_attention, self_attention, soft_cap, stored_attention
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.matmul import matmul_f32_accumulate
from jaxrl_hf.models.moe import MoEBlock, Routing
from jaxrl_hf.models.rope import apply_rope, rope_frequencies
from jaxrl_hf.models.stored_dtype import from_bits, to_stored

Array = jnp.ndarray
KVCache = dict[str, Array]


def _dtype(name: str) -> Any:
    return jnp.dtype(name)


def constrain(x: Array, names: Sequence[str | None], mesh: Any = None, rules: Any = None) -> Array:
    """Sharding constraint by logical names: with ``mesh`` and ``rules`` always applied (names resolved by
    `jaxrl_hf.mesh.rules.logical_to_spec`); otherwise flax's global context (``with mesh: with
    nn.logical_axis_rules(rules):``) decides, a no-op when no rules are set."""
    if mesh is not None and rules is not None:
        spec = logical_to_spec(tuple(names), rules)
        return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, spec))
    return nn.with_logical_constraint(x, tuple(names))


def kv_head_repeats(num_kv_heads: int, mesh: Any = None, rules: Any = None) -> int:
    """How many copies of each kv head attention works on: 1 unless ``attn_heads`` (the query heads inside
    attention) is split over more devices ``m`` than the kv heads divide into; then ``m / gcd(kv_heads, m)``, the
    fewest copies that split as evenly as the query heads (Ulysses with fewer kv heads than ``tp·sp``; verl
    repeats them too). Exact: query head ``i`` still attends with its own kv head, ``i // groups``."""
    if mesh is None or rules is None:
        return 1
    axes = logical_to_spec(("attn_heads",), rules)[0]
    shards = int(np.prod([mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ())]))
    return shards // math.gcd(num_kv_heads, shards)


def _init(initializer: Any, names: tuple[str, ...]) -> Any:
    return nn.with_logical_partitioning(initializer, names)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * scale, in f32; with
    ``unit_offset`` (Gemma) the factor is ``1 + scale`` and ``scale`` starts at 0."""

    eps: float
    param_dtype: Any = jnp.float32
    axis_name: str = "embed"
    unit_offset: bool = False

    @nn.compact
    def __call__(self, x: Array) -> Array:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        scale = self.param("scale", _init(init, (self.axis_name,)), (x.shape[-1],), self.param_dtype)
        unit = x.ndim > 2 and x.shape[0] == 1  # one packed row normalised as [L, E]: the same sums, fewer axes
        xf = (x[0] if unit else x).astype(jnp.float32)
        normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        factor = scale.astype(jnp.float32) + (1.0 if self.unit_offset else 0.0)
        out = (normed * factor).astype(x.dtype)
        return out[None] if unit else out


def make_norm(config: DecoderConfig, name: str | None = None, axis_name: str = "embed") -> RMSNorm:
    """The family's RMSNorm (``1 + w`` for Gemma 2)."""
    return RMSNorm(config.rms_norm_eps, _dtype(config.param_dtype), axis_name, config.is_gemma, name=name)


class _Proj(nn.Module):
    """Dense projection ``x[..., in] -> [..., *out_shape]`` with a multi-dim logical kernel."""

    in_features: int
    out_shape: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    bias_axes: tuple[str, ...] | None
    dtype: Any
    param_dtype: Any
    contract_dims: int = 1  # how many trailing dims of x are contracted
    f32_out: bool = False  # float32 results from a 16-bit compute dtype (the LM head's logits)
    panels: bool = False  # the kernel holds [fan_in, fan_out] in panel order (`DecoderConfig.cpu_kernels`)
    pairs: bool = False  # the bf16 weight gradient in `backends.cpu.pair_matmul` (`DecoderConfig.pair_kernels`)

    @nn.compact
    def __call__(self, x: Array) -> Array:
        in_shape = x.shape[-self.contract_dims:]
        fan_in = int(np.prod(in_shape))
        init = nn.initializers.normal(stddev=fan_in ** -0.5)
        kernel = self.param("kernel", _init(init, self.kernel_axes), (*in_shape, *self.out_shape), self.param_dtype)
        kernel = from_bits(kernel, self.dtype)
        # One 2-D matmul [rows, fan_in] @ [fan_in, fan_out]: the same product as contracting the trailing dims
        # in place, but its backward needs no transposed copy of the [B, T, ...] cotangent, which XLA:CPU emits
        # for the N-D form.
        # Low precision accumulates in f32 forward and backward (`matmul_f32_accumulate`).
        lead, x2, w2 = x.shape[: x.ndim - self.contract_dims], x.reshape(-1, fan_in), kernel.reshape(fan_in, -1)
        if self.panels:
            y = panel_matmul(x2.astype(jnp.float32), w2)
        elif self.dtype == jnp.float32:
            y = jnp.dot(x2.astype(jnp.float32), w2.astype(jnp.float32))
        else:
            y = matmul_f32_accumulate(x2.astype(self.dtype), w2, self.f32_out, self.pairs)
        y = y.reshape(*lead, *self.out_shape)
        if self.bias_axes is not None:
            bias = self.param("bias", _init(nn.initializers.zeros, self.bias_axes), self.out_shape, self.param_dtype)
            y = y + from_bits(bias, self.dtype).astype(self.dtype)
        return y


def _projections(c: DecoderConfig) -> Any:
    return functools.partial(_Proj, dtype=_dtype(c.dtype), param_dtype=_dtype(c.param_dtype), panels=c.cpu_kernels,
                             pairs=c.pair_kernels)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE over an optional read-only KV cache.

    Without cached slots (training, log-probs, prefill) the math is ``attention.self_attention`` by
    ``config.attn_implementation``, with this call's slice of ``attention_mask`` as segment ids; over cached
    slots (decode) it is ``attention.cached_attention`` (eager: the scores are only ``[T, cache_len]``).

    ``__call__`` returns ``(y, new_kv)``: ``new_kv`` holds this call's keys/values ``[B, T, kv_heads,
    head_dim]`` in the cache dtype (``None`` without a cache); the caller writes them into the cache.
    ``window`` is this layer's sliding window (a traced int, ``0`` = full attention; ``None`` when no layer
    of the model slides). ``store`` (`backends.cpu.layer_unrolled`): written into ``layer_cache`` first, returned as
    ``new_kv`` and read back from it (``attention.stored_attention``).
    """

    config: DecoderConfig
    mesh: Any = None
    rules: Any = None

    @nn.compact
    def __call__(self, x: Array, positions: Array, attention_mask: Array, cache_index: Array,
                 layer_cache: KVCache | None, window: Array | None = None,
                 store: bool = False) -> tuple[Array, KVCache | None]:
        c = self.config
        dt, proj = _dtype(c.dtype), _projections(c)
        h, k, d, e = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
        bias = lambda heads: (heads, "head_dim") if c.qkv_bias else None  # noqa: E731
        q = proj(e, (h, d), ("embed", "heads", "head_dim"), bias("heads"), name="q_proj")(x)
        kk = proj(e, (k, d), ("embed", "kv_heads", "head_dim"), bias("kv_heads"), name="k_proj")(x)
        v = proj(e, (k, d), ("embed", "kv_heads", "head_dim"), bias("kv_heads"), name="v_proj")(x)
        q = constrain(q, ("batch", "length", "heads", "head_dim"), self.mesh, self.rules)
        kk = constrain(kk, ("batch", "length", "kv_heads", "head_dim"), self.mesh, self.rules)
        if c.qk_norm:  # Qwen3: RMSNorm of each head before RoPE
            q = make_norm(c, "q_norm", "head_dim")(q)
            kk = make_norm(c, "k_norm", "head_dim")(kk)
        inv_freq, rope_scale = rope_frequencies(c)
        if c.rope_local_theta is not None and window is not None:  # Gemma 3: sliding layers' own RoPE base
            local_freq = rope_frequencies(c.replace(rope_theta=c.rope_local_theta, rope_scaling=()))[0]
            sliding = window > 0
            inv_freq = jnp.where(sliding, jnp.asarray(local_freq, jnp.float32), jnp.asarray(inv_freq, jnp.float32))
            rope_scale = jnp.where(sliding, 1.0, rope_scale)
        q = apply_rope(q, positions, inv_freq, rope_scale)
        kk = apply_rope(kk, positions, inv_freq, rope_scale)

        new_kv = None
        if layer_cache is not None:  # round the new keys/values to the cache dtype, as a cache read would
            stored = layer_cache["v"].dtype
            kk = kk.astype(dt if stored == jnp.uint16 else stored)
            v = v.astype(kk.dtype)
            new_kv = {"k": kk, "v": v}
            if store:  # written first, then read: the attention below reads the updated cache
                layer_cache = new_kv = write_kv_cache(layer_cache, new_kv, cache_index)
            kk, v = kk.astype(dt), v.astype(dt)

        # the attention layout: whole sequence, heads split (an all-to-all where ``length`` was split)
        repeats = kv_head_repeats(k, self.mesh, self.rules)
        if repeats > 1:
            if layer_cache is not None:
                raise ValueError(f"attention with kv heads repeated {repeats}x (attn_heads split over more devices "
                                 f"than the {k} kv heads) has no KV-cache path; generation layouts do not do this")
            kk, v, k = jnp.repeat(kk, repeats, axis=2), jnp.repeat(v, repeats, axis=2), k * repeats
        q = constrain(q, ("batch", "attn_length", "attn_heads", "head_dim"), self.mesh, self.rules)
        kk = constrain(kk, ("batch", "attn_length", "attn_kv_heads", "head_dim"), self.mesh, self.rules)
        v = constrain(v, ("batch", "attn_length", "attn_kv_heads", "head_dim"), self.mesh, self.rules)

        b, t = x.shape[0], x.shape[1]
        qg = q.reshape(b, t, k, h // k, d)
        if store and layer_cache is not None:  # the new keys already in the cache: eager over its slots
            out = stored_attention(qg, layer_cache, attention_mask, cache_index, c.attention_scale, window,
                                   c.attn_logit_softcapping, c.cpu_kernels)
        elif layer_cache is not None and layer_cache["v"].shape[2]:  # decode / chunked prefill: eager over the cache
            out = cached_attention(qg, kk, v, layer_cache, attention_mask, cache_index, c.attention_scale, window,
                                   c.attn_logit_softcapping)
        else:  # training, log-probs, prefill: the configured implementation, segment ids = this call's mask
            segments = jax.lax.dynamic_slice_in_dim(attention_mask.astype(jnp.int32), cache_index, t, axis=1)
            attend = functools.partial(self_attention, scale=c.attention_scale, implementation=c.attn_implementation,
                                       window=window, softcap=c.attn_logit_softcapping)
            out = c.row_layout.attention(qg, kk, v, segments, positions, attend, c.attention_scale, window,
                                         c.attn_logit_softcapping)
        out = checkpoint_name(out, "attn_out")
        out = constrain(out.reshape(b, t, h, d), ("batch", "attn_length", "attn_heads", "head_dim"), self.mesh,
                        self.rules)
        out = constrain(out, ("batch", "length", "heads", "head_dim"), self.mesh, self.rules)
        y = proj(h * d, (e,), ("heads", "head_dim", "embed"), ("embed",) if c.o_bias else None, contract_dims=2,
                 name="o_proj")(out)
        return y, new_kv


class MLP(nn.Module):
    """Gated feed-forward (Shazeer 2020): down(act(gate(x)) * up(x)); act = silu (SwiGLU) or tanh-gelu (GeGLU)."""

    config: DecoderConfig
    mesh: Any = None
    rules: Any = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        c = self.config
        e, m, proj = c.hidden_size, c.intermediate_size, _projections(c)
        gate = proj(e, (m,), ("embed", "mlp"), None, name="gate_proj")(x)
        up = proj(e, (m,), ("embed", "mlp"), None, name="up_proj")(x)
        act = nn.silu(gate) if c.hidden_act == "silu" else nn.gelu(gate, approximate=True)
        hidden = constrain(act * up, ("batch", "length", "mlp"), self.mesh, self.rules)
        return proj(m, (e,), ("mlp", "embed"), None, name="down_proj")(hidden)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block (Gemma 2: also post-norms on the attention and MLP outputs); scanned over
    layers (carry = hidden states; ``window`` = this layer's entry of ``DecoderConfig.layer_windows``)."""

    config: DecoderConfig
    mesh: Any = None
    rules: Any = None

    @nn.compact
    def __call__(self, x: Array, positions: Array, attention_mask: Array, cache_index: Array,
                 layer_cache: KVCache | None, window: Array | None = None,
                 store: bool = False, sparse: Array | None = None) -> tuple[Array, KVCache | None]:
        """Returns ``(hidden, new_kv)``; ``new_kv`` as in ``Attention`` (scanned: stacked over layers).
        ``sparse``: whether this layer is an MoE layer (a traced bool), given only when the model mixes dense and
        sparse layers (`DecoderConfig.moe_layers`)."""
        c = self.config
        x = constrain(x, ("batch", "length", "embed"), self.mesh, self.rules)
        h = make_norm(c, "input_layernorm")(x)
        attn, new_kv = Attention(c, self.mesh, self.rules, name="self_attn")(
            h, positions, attention_mask, cache_index, layer_cache, window, store)
        if c.is_gemma:
            x = x + make_norm(c, "post_attention_layernorm")(attn)
            h = checkpoint_name(make_norm(c, "pre_feedforward_layernorm")(x), "mlp_in")
            x = x + make_norm(c, "post_feedforward_layernorm")(MLP(c, self.mesh, self.rules, name="mlp")(h))
        elif c.is_moe:
            x = x + attn
            h = checkpoint_name(make_norm(c, "post_attention_layernorm")(x), "mlp_in")
            x = x + self._moe_or_mlp(h, sparse)
        else:
            x = x + attn
            h = checkpoint_name(make_norm(c, "post_attention_layernorm")(x), "mlp_in")
            x = x + MLP(c, self.mesh, self.rules, name="mlp")(h)
        return constrain(x, ("batch", "length", "embed"), self.mesh, self.rules), new_kv

    def _moe_or_mlp(self, h: Array, sparse: Array | None) -> Array:
        """An MoE model's feed-forward: the MoE block (``moe``) where every layer is sparse; in a model mixing
        dense and sparse layers, every layer holds both the dense ``mlp`` and the ``moe`` parameters and runs the
        one ``sparse`` picks (``nn.cond``; at init both, so both parameter sets exist). The routing is sown as
        ``intermediates/router_logits`` and ``intermediates/router_experts`` (zeros/-1 in a dense layer). A
        ``replay`` collection's ``experts [N, k]`` (this layer's slice of `REPLAY`) replaces the router's choice."""
        c = self.config
        given = self.get_variable(REPLAY, "experts") if self.has_variable(REPLAY, "experts") else None
        if all(c.moe_layers):
            y, routing = MoEBlock(c, self.mesh, self.rules, name="moe")(h, given)
        else:
            if sparse is None:
                raise ValueError("a model mixing dense and MoE layers needs the per-layer `sparse` flag")
            n = h.size // h.shape[-1]

            def moe(m: nn.Module, h: Array) -> tuple[Array, Routing]:
                return MoEBlock(c, m.mesh, m.rules, name="moe")(h, given)

            def dense(m: nn.Module, h: Array) -> tuple[Array, Routing]:
                k = c.num_experts_per_tok
                none = Routing(jnp.zeros((n, c.num_experts), jnp.float32), jnp.full((n, k), -1, jnp.int32),
                               jnp.zeros((n, k), h.dtype))
                return MLP(c, m.mesh, m.rules, name="mlp")(h).astype(h.dtype), none

            if self.is_initializing():
                y_moe, routing = moe(self, h)
                y = jnp.where(sparse, y_moe, dense(self, h)[0])
            else:
                y, routing = nn.cond(sparse, moe, dense, self, h)
        self.sow("intermediates", "router_logits", routing.logits)
        self.sow("intermediates", "router_experts", routing.experts)
        return y


REPLAY = "replay"
"""The variable collection of routing replay: ``{"model": {"layers": {"experts": [layers, N, k] int32}}}``, the
experts each MoE layer uses for its ``N`` tokens (`jaxrl_hf.models.forward.hidden_states`' ``routed_experts``)."""

_SAVE_ATTN_OUT = jax.checkpoint_policies.save_only_these_names("attn_out", "attn_lse")
REMAT_POLICIES = {
    # Recompute the whole layer in the backward pass; only the layer inputs (the scan carry) are kept.
    "full": None,
    # Keep every matmul output (the eager [T, T] scores too); recompute elementwise ops.
    "dots": jax.checkpoint_policies.dots_saveable,
    # Keep the matmuls against weights (no batch dimension); recompute attention and elementwise ops.
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # Keep only the attention output [B, T, heads, head_dim] (and, with blockwise attention, its per-row
    # log-sum-exp), so the backward reruns the projections and the MLP but never the attention itself.
    "save_attn_out": _SAVE_ATTN_OUT,
    # As save_attn_out, plus the MLP input [B, T, embed] (skips recomputing o_proj and the norm).
    "save_attn_out_mlp_in": jax.checkpoint_policies.save_only_these_names("attn_out", "attn_lse", "mlp_in"),
    # dots_no_batch plus the attention output: only elementwise ops and norms are recomputed.
    "dots_no_batch_attn_out": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _SAVE_ATTN_OUT),
}
"""``DecoderConfig.remat`` (config key ``model.remat``) -> ``jax.checkpoint`` policy of each decoder layer.
The names are tagged with ``checkpoint_name`` in `Attention` / `DecoderLayer` and inside
``jaxrl_hf.models.attention``'s blockwise forward."""


class Decoder(nn.Module):
    """Embedding + scanned decoder layers + final norm; returns hidden states ``[B, T, embed]``."""

    config: DecoderConfig
    mesh: Any = None
    rules: Any = None

    def setup(self) -> None:
        c = self.config
        self.embed_tokens = nn.Embed(
            c.vocab_size, c.hidden_size, dtype=_dtype(c.dtype), param_dtype=_dtype(c.param_dtype),
            embedding_init=_init(nn.initializers.normal(stddev=0.02), ("vocab", "embed")))
        layer_cls = DecoderLayer
        if c.remat != "none":
            layer_cls = nn.remat(DecoderLayer, policy=REMAT_POLICIES[c.remat], prevent_cse=False)
        self.mixed_moe = c.is_moe and not all(c.moe_layers)  # layers pick dense or MoE by a scanned flag
        self.layers = nn.scan(
            layer_cls,
            variable_axes={"params": 0, "intermediates": 0, REPLAY: 0} if c.is_moe else {"params": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0, 0) + ((nn.broadcast, 0) if self.mixed_moe else ()),
            length=c.num_hidden_layers,
            unroll=1 if c.scan_layers else c.num_hidden_layers,  # the same stacked parameters either way
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(c, self.mesh, self.rules)
        self.norm = make_norm(c)

    def __call__(self, input_ids: Array, positions: Array, attention_mask: Array,
                 cache: KVCache | None = None, cache_index: Array | int = 0) -> tuple[Array, KVCache | None]:
        """``(hidden [B, T, embed], new_kv)``: ``new_kv`` = ``{"k","v"}: [layers, B, T, kv_heads, head_dim]``
        (this call's keys/values, not yet written into ``cache``), ``None`` without a cache.

        A Python-int ``cache_index == 0`` (prefill) attends to no cached slot, so the cache is not read. The mask
        covers every cache slot, the new tokens' slots among them; or, for new tokens after a full cache
        (``cache_index`` = its length, a Python int), the cache slots and then the ``T`` new tokens.
        """
        if cache is not None:
            cache_len = cache["k"].shape[3]
            after = isinstance(cache_index, int) and cache_index == cache_len
            if attention_mask.shape[1] != cache_len + (input_ids.shape[1] if after else 0):
                raise ValueError(f"attention_mask has {attention_mask.shape[1]} slots but the KV cache has "
                                 f"{cache_len}; with a cache the mask must cover every cache slot (and the "
                                 f"{input_ids.shape[1]} new tokens after a full cache)")
            if isinstance(cache_index, int) and cache_index == 0:
                cache = jax.tree.map(lambda a: a[:, :, :, :0], cache)
        x = self.embed(input_ids)
        windows = None if self.config.layer_windows is None else jnp.asarray(self.config.layer_windows, jnp.int32)
        sparse = (False, jnp.asarray(self.config.moe_layers)) if self.mixed_moe else ()
        x, new_kv = self.layers(x, positions, attention_mask, jnp.asarray(cache_index, jnp.int32), cache, windows,
                                *sparse)
        return self.norm(x), new_kv

    def embed(self, input_ids: Array) -> Array:
        """The token embeddings ``[B, T, embed]`` the first layer reads (Gemma: scaled by ``sqrt(hidden)``).

        The rows are taken from the stored table and then cast to the compute dtype (flax's ``Embed`` casts the
        whole ``[vocab, embed]`` table first; its gradient was a 16-bit scatter-add into a zeroed table, then
        cast back: two passes over the table per update, and repeated tokens summed in bf16)."""
        if not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        x = jnp.take(self.embed_tokens.embedding, input_ids, axis=0).astype(_dtype(self.config.dtype))
        if self.config.is_gemma:  # Gemma: embedding * sqrt(hidden), the factor rounded to the compute dtype
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
        return constrain(x, ("batch", "length", "embed"), self.mesh, self.rules)

    def attend(self, hidden: Array) -> Array:
        """Tied LM head: ``hidden @ embedding.T`` as float32 logits, 16-bit operands accumulated in float32.

        (flax's ``Embed.attend`` returns the compute dtype: a bf16-out dot, which XLA:CPU runs as a float32 dot
        on upcast copies, at half the bf16 rate; its logits were rounded to bf16 besides.)"""
        dt = _dtype(self.config.dtype)
        embedding = self.embed_tokens.embedding.astype(dt)
        contract = (((hidden.ndim - 1,), (1,)), ((), ()))
        return jax.lax.dot_general(hidden.astype(dt), embedding, contract, preferred_element_type=jnp.float32)


class CausalLM(nn.Module):
    """Decoder + LM head. ``__call__`` returns ``(logits [B,T,vocab] f32, new_cache)``."""

    config: DecoderConfig
    mesh: Any = None
    rules: Any = None

    def setup(self) -> None:
        c = self.config
        self.model = Decoder(c, self.mesh, self.rules)
        if not c.tie_word_embeddings:
            self.lm_head = _Proj(c.hidden_size, (c.vocab_size,), ("embed", "vocab"), None,
                                 _dtype(c.dtype), _dtype(c.param_dtype), f32_out=True, panels=c.cpu_kernels)

    def hidden_states_and_new_kv(self, input_ids: Array, positions: Array, attention_mask: Array,
                                 cache: KVCache | None = None,
                                 cache_index: Array | int = 0) -> tuple[Array, KVCache | None]:
        """``(hidden, new_kv)`` without touching ``cache``; store ``new_kv`` with ``write_kv_cache``."""
        return self.model(input_ids, positions, attention_mask, cache, cache_index)

    def hidden_states(self, input_ids: Array, positions: Array, attention_mask: Array,
                      cache: KVCache | None = None, cache_index: Array | int = 0) -> tuple[Array, KVCache | None]:
        """``(hidden, cache with this call's keys/values written at cache_index)`` (``None`` without a cache)."""
        hidden, new_kv = self.model(input_ids, positions, attention_mask, cache, cache_index)
        if cache is None:
            return hidden, None
        return hidden, write_kv_cache(cache, new_kv, cache_index)

    def logits_from_hidden(self, hidden: Array) -> Array:
        if self.config.tie_word_embeddings:
            logits = self.model.attend(hidden)
        else:
            logits = self.lm_head(hidden)
        logits = soft_cap(logits.astype(jnp.float32), self.config.final_logit_softcapping)
        return constrain(logits, ("batch", "length", "vocab"), self.mesh, self.rules)

    def __call__(self, input_ids: Array, positions: Array, attention_mask: Array,
                 cache: KVCache | None = None, cache_index: Array | int = 0) -> tuple[Array, KVCache | None]:
        hidden, new_cache = self.hidden_states(input_ids, positions, attention_mask, cache, cache_index)
        return self.logits_from_hidden(hidden), new_cache


def default_positions(attention_mask: Array) -> Array:
    """Position ids for left-padded rows: ``cumsum(mask) - 1`` clipped at 0 (HF convention)."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def write_kv_cache(cache: KVCache, new_kv: KVCache, cache_index: Array | int) -> KVCache:
    """Store ``new_kv [layers, B, T, kv_heads, head_dim]`` at slots ``cache_index .. cache_index + T - 1`` (or one
    layer's ``[B, T, ...]``). One ``dynamic_update_slice`` per tensor: in place on a loop carry or donated cache."""
    zero, index = jnp.zeros((), jnp.int32), jnp.asarray(cache_index, jnp.int32)
    lead = (zero,) * (cache["v"].ndim - 2)
    store = lambda name, x, at: jax.lax.dynamic_update_slice(  # noqa: E731
        cache[name], to_stored(x, cache[name].dtype), lead + at)
    if "kt" in cache:  # keys stored transposed, [B, kv_heads, head_dim, cache_len] (`attention.cached_attention`)
        return {"kt": store("kt", jnp.moveaxis(new_kv["k"], -3, -1), (zero, index)),
                "v": store("v", new_kv["v"].swapaxes(-3, -2), (index, zero))}
    return {name: store(name, new_kv[name].swapaxes(-3, -2), (index, zero)) for name in ("k", "v")}


def init_kv_cache(config: DecoderConfig, batch: int, cache_len: int, dtype: Any = None) -> KVCache:
    """Zeroed KV cache ``{"k","v"}: [layers, batch, kv_heads, cache_len, head_dim]`` of ``dtype`` (default: the
    compute dtype). ``uint16``: the 16-bit compute dtype's bit patterns (XLA:CPU slices and updates a 16-bit
    float array in place only as integers: `jaxrl_hf.rollout.jax_engine.cache_storage_dtype`)."""
    dt = jnp.dtype(dtype or config.dtype)
    if dt == jnp.uint16 and jnp.dtype(config.dtype).itemsize != 2:
        raise ValueError(f"a uint16 (bit-pattern) KV cache needs a 16-bit compute dtype; model.dtype is "
                         f"{config.dtype}")
    shape = (config.num_hidden_layers, batch, config.num_key_value_heads, cache_len, config.head_dim)
    return {"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)}


KV_CACHE_LOGICAL_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")
