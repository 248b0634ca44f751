"""The attention math of the decoder as pure functions: ``softmax(q k^T * scale + mask) v`` per head.

Layout everywhere: queries ``q [B, T, kv_heads, groups, head_dim]`` (grouped-query attention: query head
``h = kv_head * groups + group``), keys/values ``[B, S, kv_heads, head_dim]``, output like ``q``.

Masking contract: ``segments [B, T]`` (the model's ``attention_mask``) are *segment ids*: ``0`` is padding,
rows packed into one sequence carry ``1, 2, 3, ...``. Query ``i`` attends to key ``j`` iff ``j <= i``
(causal, by index), ``segments[j] == segments[i]`` and ``segments[j] != 0``; a 0/1 mask is the one-segment
case, and a padded query sees no key (a *fully-masked row*). A sliding ``window`` ``w > 0`` (a traced int, one
per layer; ``0`` = no window) also hides keys with ``j <= i - w`` (HF's ``sliding_window``). A ``softcap`` ``c``
(Gemma 2's ``attn_logit_softcapping``) replaces the scaled scores ``s`` by ``c * tanh(s / c)`` before masking.

Implementations of self-attention without a KV cache are the entries of `ATTENTION_IMPLEMENTATIONS` (the one
list of names ``DecoderConfig.attn_implementation`` / config key ``model.attn_implementation`` accepts, besides
``auto``); each is ``fn(q, k, v, segments, scale, *, window, softcap) -> out`` registered with ``usable``, a
function ``(dtype, head_dim, windowed, softcapped) -> reason or None``. Adding one is one registered entry:

* ``eager`` — `eager_attention`: materialises the ``[B, kv_heads, groups, T, T]`` scores (the reference).
  A fully-masked row gets the mean of ``v`` (a uniform softmax over equal "minus infinity" scores).
* ``blockwise`` — `blockwise_attention`: the online-softmax ("flash") algorithm of Rabe & Staats 2021
  (*Self-attention does not need O(n²) memory*) and Dao et al. 2022 (*FlashAttention*; the backward of
  FlashAttention-2, Dao 2023, Alg. 2), pure JAX, O(T) memory in forward and backward. A fully-masked row
  gets zeros. Tiles no query of theirs can see (above the diagonal, or before a sliding window) are not
  computed, so a windowed layer costs O(T * window).
* ``cudnn`` — `cudnn_attention`: cuDNN's fused flash attention through ``jax.nn.dot_product_attention``
  (GPU, float16/bfloat16 only).
* ``auto`` — `resolve_implementation`: cudnn where usable (no window, no softcap), else blockwise above
  `AUTO_BLOCKWISE_MIN_KEYS` keys, else eager.

A module passed with ``--import`` (config key ``imports``) may register more, e.g.
``@ATTENTION_IMPLEMENTATIONS.register("mine", usable=lambda dtype, head_dim, windowed, softcapped: None)``.

Decoding over a KV cache (`cached_attention`) is always eager: its scores are ``[T_new, cache_len]``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from jaxrl_hf.backends.cpu.ffi import cache_attention
from jaxrl_hf.registry import Registry

Array = jnp.ndarray
NEG_INF = -0.7 * float(np.finfo(np.float32).max)  # finite "minus infinity": fully masked rows stay NaN-free
DEFAULT_BLOCK_SIZE = 512
AUTO_BLOCKWISE_MIN_KEYS = 1024
"""``auto`` uses ``blockwise`` when there are more keys than this (below it the [T, T] scores are small)."""
CUDNN_DTYPES = ("float16", "bfloat16")
CONFIG_KEY = "model.attn_implementation"
AUTO = "auto"
"""The value of `CONFIG_KEY` that is not an entry: `resolve_implementation` picks one per call."""


def _always_usable(dtype: Any, head_dim: int, windowed: bool, softcapped: bool) -> str | None:
    """The ``usable`` of a form that expresses every mask, dtype and head size."""
    return None


ATTENTION_IMPLEMENTATIONS: Registry = Registry("attention implementation", metadata={"usable": _always_usable})
"""Self-attention without a KV cache by name (module docstring)."""


# ------------------------------------------------------------------------------------------ masks
def window_mask(q_idx: Array, kv_idx: Array, window: Array | int | None) -> Array | bool:
    """``[Tq, Tk]`` bool ``kv_idx[j] > q_idx[i] - window`` (HF's sliding-window overlay); all true for
    ``window`` ``None`` or ``0``."""
    if window is None:
        return True
    return (window <= 0) | (kv_idx[None, :] > q_idx[:, None] - window)


def soft_cap(scores: Array, cap: float | None) -> Array:
    """Logit soft-capping (Gemma 2): ``cap * tanh(scores / cap)``; identity for ``cap`` ``None``."""
    return scores if not cap else cap * jnp.tanh(scores / cap)


def segment_mask(q_segments: Array, kv_segments: Array, q_start: Array | int = 0,
                 kv_start: Array | int = 0, window: Array | int | None = None) -> Array:
    """``[B, Tq, Tk]`` bool: causal (``kv_start + j <= q_start + i``), inside the sliding ``window``
    (`window_mask`) and ``kv_seg[j] == q_seg[i] != 0``."""
    q_idx = q_start + jnp.arange(q_segments.shape[1])
    kv_idx = kv_start + jnp.arange(kv_segments.shape[1])
    causal = (kv_idx[None, :] <= q_idx[:, None]) & window_mask(q_idx, kv_idx, window)
    same = (q_segments[:, :, None] == kv_segments[:, None, :]) & (kv_segments[:, None, :] != 0)
    return causal[None] & same


def split_attention_masks(attention_mask: Array, cache_index: Array, cached_len: int,
                          q_len: int, window: Array | int | None = None) -> tuple[Array, Array]:
    """Which keys each query sees over a KV cache: cached slot ``s`` iff ``s < cache_index``,
    ``attention_mask[b, s]`` and ``s`` inside query ``t``'s sliding window (slot ``cache_index + t``); new key
    ``u`` (slot ``cache_index + u``) by the segment rule of the module docstring applied to
    ``attention_mask[:, cache_index:cache_index + T]``.

    Returns boolean masks ``[B, 1, 1, 1 or T, cached_len]`` and ``[B, 1, 1, T, T]``, broadcastable against
    scores ``[B, kv_heads, groups, T, keys]``.
    """
    segments = attention_mask.astype(jnp.int32)
    slots = jnp.arange(cached_len)
    cached = (slots < cache_index)[None, None, :] & (segments[:, None, :cached_len] != 0)  # [B, 1, S_c]
    if window is not None:
        cached = cached & window_mask(cache_index + jnp.arange(q_len), slots, window)[None]  # [B, T, S_c]
    new_seg = jax.lax.dynamic_slice_in_dim(segments, cache_index, q_len, axis=1)  # [B, T]
    return cached[:, None, None], segment_mask(new_seg, new_seg, window=window)[:, None, None]


# ------------------------------------------------------------------------------------------ eager
@ATTENTION_IMPLEMENTATIONS.register("eager")
def eager_attention(q: Array, k: Array, v: Array, segments: Array, scale: float,
                    window: Array | int | None = None, softcap: float | None = None) -> Array:
    """Reference self-attention: ``softmax(where(mask, soft_cap(q k^T * scale), -inf)) v`` with the full
    ``[B, kv_heads, groups, T, T]`` float32 scores (Vaswani et al. 2017, eq. 1)."""
    return masked_attention(q, k, v, segment_mask(segments, segments, window=window), scale, softcap)


def masked_attention(q: Array, k: Array, v: Array, mask: Array, scale: float, softcap: float | None = None) -> Array:
    """`eager_attention` under any ``[B, T, S]`` boolean ``mask`` (query ``t`` sees key ``s``)."""
    scores = soft_cap(jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale, softcap)
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, NEG_INF), axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v)


def head_batched_attention(q: Array, k: Array, v: Array, mask: Array, scale: float,
                           softcap: float | None = None) -> Array:
    """`masked_attention` with both products as matmuls batched over (row, kv head), kept as two batch dimensions
    (a mesh shards them apart: rows over dp, kv heads over tp), each head group's queries one ``[groups·T, D]``
    matrix, as `cached_attention` reads its cache; used by the packed update (`shared_prompt_attention.
    shared_prefix_attention`). Generation keeps `masked_attention`."""
    b, t, heads, groups, d = q.shape
    s = k.shape[1]
    qn = q.transpose(0, 2, 3, 1, 4).reshape(b, heads, groups * t, d)
    kn, vn = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    scores = soft_cap(jnp.einsum("bkqd,bksd->bkqs", qn, kn, preferred_element_type=jnp.float32) * scale, softcap)
    seen = jnp.broadcast_to(mask[:, None, None], (b, heads, groups, t, s)).reshape(b, heads, groups * t, s)
    probs = jax.nn.softmax(jnp.where(seen, scores, NEG_INF), axis=-1).astype(q.dtype)
    out = jnp.einsum("bkqs,bksd->bkqd", probs, vn)
    return out.reshape(b, heads, groups, t, d).transpose(0, 3, 1, 2, 4)


def cached_attention(q: Array, k: Array, v: Array, cache: dict[str, Array], attention_mask: Array,
                     cache_index: Array, scale: float, window: Array | int | None = None,
                     softcap: float | None = None) -> Array:
    """Eager attention of ``T`` new queries over ``[cached slots] ++ [their own keys]``: one softmax over
    both, the cache (``{"k", "v"}: [B, kv_heads, S, D]``, or its ``uint16`` bit patterns) only read.

    Over the cache the queries of a (row, kv head) are one ``[groups * T, D]`` matrix, so both products are
    batched matmuls on the cache's stored layout with float32 results, each product one contraction over
    ``head_dim`` or the cache's slots with no transpose of the cache. Masks: `split_attention_masks`."""
    dt, t, cached_len = q.dtype, q.shape[1], cache["v"].shape[2]
    cached_mask, new_mask = split_attention_masks(attention_mask, cache_index, cached_len, t, window)
    scores = soft_cap(jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * scale, softcap)
    scores = jnp.where(new_mask, scores, NEG_INF)
    cached_scores = jnp.where(cached_mask, _cache_scores(q, cache, scale, softcap), NEG_INF)
    probs = jax.nn.softmax(jnp.concatenate([cached_scores, scores], axis=-1), axis=-1).astype(dt)
    out = _cache_weighted_values(probs[..., :cached_len], cache)
    return (out + jnp.einsum("bkgts,bskd->btkgd", probs[..., cached_len:], v).astype(jnp.float32)).astype(dt)


def stored_attention(q: Array, cache: dict[str, Array], attention_mask: Array, cache_index: Array, scale: float,
                     window: Array | int | None = None, softcap: float | None = None, kernel: bool = False) -> Array:
    """Eager attention of ``T`` new queries over a cache that already holds their own keys/values at slots
    ``cache_index + t`` (written before the read, `backends.cpu.layer_unrolled`): one softmax over the cache's
    slots, the same keys as `cached_attention` sees, without the separate own-key scores and their
    concatenation. Mask: `stored_attention_mask`. ``kernel`` (float32 keys stored ``"kt"``, no soft-cap): in
    `backends.cpu.ffi.cache_attention`, one pass over each (row, kv head)'s keys and values."""
    mask = stored_attention_mask(attention_mask, cache_index, cache["v"].shape[2], q.shape[1], window)
    if kernel and "kt" in cache and softcap is None and cache["kt"].dtype == jnp.float32:
        b, t = q.shape[:2]
        return cache_attention(q, cache["kt"], cache["v"], mask.reshape(b, t, -1), scale).astype(q.dtype)
    scores = jnp.where(mask, _cache_scores(q, cache, scale, softcap), NEG_INF)
    return _cache_weighted_values(jax.nn.softmax(scores, axis=-1).astype(q.dtype), cache).astype(q.dtype)


def stored_attention_mask(attention_mask: Array, cache_index: Array, cache_len: int, q_len: int,
                          window: Array | int | None = None) -> Array:
    """`split_attention_masks`'s two masks as one over the cache's slots, the new keys in place at slots
    ``cache_index + u``: ``[B, 1, 1, T, cache_len]``. Query ``t`` (slot ``cache_index + t``) sees slot ``s``
    iff ``s <= cache_index + t``, ``s`` is inside its window, and ``attention_mask[b, s] != 0`` (a slot
    before ``cache_index``) or equal to the query's own segment (a new slot)."""
    segments = attention_mask.astype(jnp.int32)
    slots, q_slots = jnp.arange(cache_len), cache_index + jnp.arange(q_len)
    seg = segments[:, None, :cache_len]  # [B, 1, S]
    q_seg = jax.lax.dynamic_slice_in_dim(segments, cache_index, q_len, axis=1)[:, :, None]  # [B, T, 1]
    visible = (slots[None, :] <= q_slots[:, None]) & window_mask(q_slots, slots, window)  # [T, S]
    same = jnp.where((slots < cache_index)[None, None, :], True, seg == q_seg) & (seg != 0)
    return (visible[None] & same)[:, None, None]


def _cache_scores(q: Array, cache: dict[str, Array], scale: float, softcap: float | None) -> Array:
    """Scaled, soft-capped float32 scores ``[B, K, G, T, S]`` of queries ``[B, T, K, G, D]`` over the cached
    keys: per (row, kv head) one ``[G * T, D]`` matrix times the keys as stored (``"kt"``: ``[B, K, D, S]``, a
    plain product; ``"k"``: ``[B, K, S, D]``)."""
    dt, (b, t, kv, g, d) = q.dtype, q.shape
    rows = q.transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)  # [B, K, G*T, D]
    if "kt" in cache:
        scores = jnp.einsum("bkmd,bkds->bkms", rows, _as_compute(cache["kt"], dt), preferred_element_type=jnp.float32)
    else:
        scores = jnp.einsum("bkmd,bksd->bkms", rows, _as_compute(cache["k"], dt), preferred_element_type=jnp.float32)
    return soft_cap(scores.reshape(b, kv, g, t, -1) * scale, softcap)


def _cache_weighted_values(probs: Array, cache: dict[str, Array]) -> Array:
    """``probs [B, K, G, T, S]`` times the cached values ``[B, K, S, D]``: float32 ``[B, T, K, G, D]``."""
    b, kv, g, t, s = probs.shape
    values = _as_compute(cache["v"], probs.dtype)
    out = jnp.einsum("bkms,bksd->bkmd", probs.reshape(b, kv, g * t, s), values, preferred_element_type=jnp.float32)
    return out.reshape(b, kv, g, t, -1).transpose(0, 3, 1, 2, 4)


def _as_compute(cached: Array, dt: Any) -> Array:
    """A cache tensor in the compute dtype ``dt``: its bit patterns reinterpreted (``uint16``) or cast."""
    return jax.lax.bitcast_convert_type(cached, dt) if cached.dtype == jnp.uint16 else cached.astype(dt)


# -------------------------------------------------------------------------------------- blockwise
def _block(x: Array, index: Array, size: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


def _block_scores(qb: Array, kb: Array, q_seg: Array, kv_seg: Array, q_start: Array, kv_start: Array,
                  scale: float, window: Array, softcap: float | None) -> tuple[Array, Array]:
    """Scaled, soft-capped scores ``[B, K, G, bq, bk]`` (f32, masked entries ``NEG_INF``) and their mask."""
    mask = segment_mask(q_seg, kv_seg, q_start, kv_start, window)[:, None, None]
    scores = soft_cap(jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32) * scale, softcap)
    return jnp.where(mask, scores, NEG_INF), mask


def key_block_range(q_block: Array, block_q: int, block_k: int, num_k_blocks: int,
                    window: Array) -> tuple[Array, Array]:
    """``[first, last)`` key blocks that query block ``q_block`` can see; the others are skipped. Causal: its
    last query ``(q_block + 1) * block_q - 1`` sees no later key. Window ``w > 0``: its first query
    ``q_block * block_q`` sees no key ``j <= q_block * block_q - w`` (`window_mask`)."""
    last = jnp.minimum(num_k_blocks, ((q_block + 1) * block_q - 1) // block_k + 1)
    first = jnp.where(window > 0, jnp.maximum(0, (q_block * block_q - window + 1) // block_k), 0)
    return first, last


def query_block_range(k_block: Array, block_q: int, block_k: int, num_q_blocks: int,
                      window: Array) -> tuple[Array, Array]:
    """``[first, last)`` query blocks that see key block ``k_block`` (the backward's loop; `key_block_range`
    transposed). Causal: no query before ``k_block * block_k``. Window ``w > 0``: no query after
    ``(k_block + 1) * block_k - 1 + w - 1`` (its last key leaves every later query's window)."""
    first = (k_block * block_k) // block_q
    last = jnp.where(window > 0, jnp.minimum(num_q_blocks, ((k_block + 1) * block_k + window - 2) // block_q + 1),
                     num_q_blocks)
    return first, last


def _flash_forward(q: Array, k: Array, v: Array, segments: Array, window: Array, scale: float, block_q: int,
                   block_k: int, softcap: float | None) -> tuple[Array, Array]:
    """Online softmax (Rabe & Staats 2021, eq. 2–3; FlashAttention Alg. 1): per query block, a running row
    max ``m``, normaliser ``l`` and unnormalised output over the visible key blocks. Returns the output
    ``[B, T, K, G, D]`` and the log-sum-exp ``m + log l`` per row ``[B, T, K, G]`` (0 on fully-masked rows,
    whose output is 0)."""
    b, t, kh, g, d = q.shape
    num_q, num_k = t // block_q, t // block_k

    def query_block(i: Array) -> tuple[Array, Array]:
        qb, q_seg = _block(q, i, block_q), _block(segments, i, block_q)

        def key_block(j: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            m, l, acc = carry
            scores, mask = _block_scores(qb, _block(k, j, block_k), q_seg, _block(segments, j, block_k),
                                         i * block_q, j * block_k, scale, window, softcap)
            m_new = jnp.maximum(m, scores.max(-1))
            p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), _block(v, j, block_k),
                            preferred_element_type=jnp.float32)
            return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv

        init = (jnp.full((b, kh, g, block_q), NEG_INF, jnp.float32), jnp.zeros((b, kh, g, block_q), jnp.float32),
                jnp.zeros((b, kh, g, block_q, d), jnp.float32))
        m, l, acc = jax.lax.fori_loop(*key_block_range(i, block_q, block_k, num_k, window), key_block, init)
        seen = l > 0
        safe_l = jnp.where(seen, l, 1.0)
        out = jnp.where(seen[..., None], acc / safe_l[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(safe_l), 0.0)
        return out.transpose(0, 3, 1, 2, 4).astype(q.dtype), lse.transpose(0, 3, 1, 2)  # [B,bq,K,G,(D)]

    outs, lses = jax.lax.map(query_block, jnp.arange(num_q))  # [num_q, B, bq, ...]
    out = jnp.moveaxis(outs, 0, 1).reshape(b, t, kh, g, d)
    return out, jnp.moveaxis(lses, 0, 1).reshape(b, t, kh, g)


def _flash_backward(q: Array, k: Array, v: Array, segments: Array, window: Array, out: Array, lse: Array,
                    d_out: Array, scale: float, block_q: int, block_k: int,
                    softcap: float | None) -> tuple[Array, Array, Array]:
    """FlashAttention-2's backward (Dao 2023, Alg. 2): per key block, recompute ``P = exp(S - lse)`` over the
    query blocks that see it and accumulate ``dV += P^T dO``, ``dS = P * (dO V^T - rowsum(dO * O))``,
    ``dK += dS^T Q * scale``, ``dQ += dS K * scale``; with a soft-cap ``c``, ``dS`` is first multiplied by
    ``d(c tanh(s/c))/ds = 1 - (S/c)^2``."""
    t = q.shape[1]
    num_q, num_k = t // block_q, t // block_k
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B, T, K, G]

    def key_block(dq: Array, j: Array) -> tuple[Array, tuple[Array, Array]]:
        kb, vb, kv_seg = _block(k, j, block_k), _block(v, j, block_k), _block(segments, j, block_k)

        def query_block(i: Array, carry: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
            dk, dv, dq = carry
            qb, dob = _block(q, i, block_q), _block(d_out, i, block_q)
            scores, mask = _block_scores(qb, kb, _block(segments, i, block_q), kv_seg, i * block_q, j * block_k,
                                         scale, window, softcap)
            row = lambda x: _block(x, i, block_q).transpose(0, 2, 3, 1)[..., None]  # noqa: E731  [B,K,G,bq,1]
            p = jnp.where(mask, jnp.exp(scores - row(lse)), 0.0)
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dob.dtype), dob, preferred_element_type=jnp.float32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", dob, vb, preferred_element_type=jnp.float32)
            ds = p * (dp - row(delta))
            if softcap:
                ds = ds * jnp.where(mask, 1.0 - jnp.square(scores / softcap), 0.0)
            ds = ds.astype(q.dtype)
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qb, preferred_element_type=jnp.float32) * scale
            dq_block = jnp.einsum("bkgqs,bskd->bqkgd", ds, kb, preferred_element_type=jnp.float32) * scale
            dq = jax.lax.dynamic_update_slice_in_dim(dq, _block(dq, i, block_q) + dq_block, i * block_q, axis=1)
            return dk, dv, dq

        zeros = jnp.zeros(kb.shape, jnp.float32)
        dk, dv, dq = jax.lax.fori_loop(*query_block_range(j, block_q, block_k, num_q, window), query_block,
                                       (zeros, zeros, dq))
        return dq, (dk, dv)

    dq, (dks, dvs) = jax.lax.scan(key_block, jnp.zeros(q.shape, jnp.float32), jnp.arange(num_k))
    merge = lambda x: jnp.moveaxis(x, 0, 1).reshape(k.shape)  # noqa: E731  [num_k, B, bk, K, D] -> [B, S, K, D]
    return dq.astype(q.dtype), merge(dks).astype(k.dtype), merge(dvs).astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _flash(q: Array, k: Array, v: Array, segments: Array, window: Array, scale: float, block_q: int, block_k: int,
           softcap: float | None) -> Array:
    return _flash_forward(q, k, v, segments, window, scale, block_q, block_k, softcap)[0]


def _flash_fwd(q, k, v, segments, window, scale, block_q, block_k, softcap):  # noqa: ANN001, ANN202
    out, lse = _flash_forward(q, k, v, segments, window, scale, block_q, block_k, softcap)
    out, lse = checkpoint_name(out, "attn_out"), checkpoint_name(lse, "attn_lse")  # rematerialisation policies
    return out, (q, k, v, segments, window, out, lse)  # no [T, T] residual: the backward recomputes the scores


def _flash_bwd(scale, block_q, block_k, softcap, residuals, d_out):  # noqa: ANN001, ANN202
    q, k, v, segments, window, out, lse = residuals
    dq, dk, dv = _flash_backward(q, k, v, segments, window, out, lse, d_out, scale, block_q, block_k, softcap)
    return dq, dk, dv, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@ATTENTION_IMPLEMENTATIONS.register("blockwise")
def blockwise_attention(q: Array, k: Array, v: Array, segments: Array, scale: float,
                        block_q: int = DEFAULT_BLOCK_SIZE, block_k: int = DEFAULT_BLOCK_SIZE,
                        window: Array | int | None = None, softcap: float | None = None) -> Array:
    """Self-attention in ``block_q x block_k`` tiles with an online softmax and a recomputing backward
    (`_flash_forward`, `_flash_backward`): memory O(T) — the forward keeps the output and one log-sum-exp per
    row, never a ``[T, T]`` array. Tiles that no query of theirs can see are skipped in both passes: key blocks
    entirely above the diagonal, and with a sliding ``window`` those entirely before it (`key_block_range`,
    `query_block_range`), so a windowed layer costs O(T * window) instead of O(T^2).

    Blocks are clipped to ``T``; a ``T`` that is not a multiple of them is padded (segment id 0, so padded
    keys are never seen and padded queries are dropped). Equal to `eager_attention` except on fully-masked
    rows, which are 0 here.
    """
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"blockwise_attention block sizes must be positive, got {block_q}, {block_k}")
    t = q.shape[1]
    if k.shape[1] != t or segments.shape != q.shape[:2]:
        raise ValueError(f"blockwise_attention is self-attention: q {q.shape}, k {k.shape}, segments {segments.shape}")
    block_q, block_k = min(block_q, t), min(block_k, t)
    step = math.lcm(block_q, block_k)
    padded = -(-t // step) * step
    segments = segments.astype(jnp.int32)
    if padded != t:
        pad = lambda x: jnp.pad(x, [(0, 0), (0, padded - t)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        q, k, v, segments = pad(q), pad(k), pad(v), pad(segments)
    window = jnp.asarray(0 if window is None else window, jnp.int32)
    return _flash(q, k, v, segments, window, float(scale), block_q, block_k, softcap)[:, :t]


# ------------------------------------------------------------------------------------------ cudnn
def cudnn_usable(dtype: Any, head_dim: int | None = None) -> str | None:
    """``None`` when cuDNN flash attention can run here (for ``head_dim`` when given), else the reason."""
    if jax.default_backend() != "gpu" or "rocm" in jax.devices()[0].client.platform_version.lower():
        return f"it needs an NVIDIA GPU backend, this process runs on {jax.default_backend()!r}"
    if jnp.dtype(dtype).name not in CUDNN_DTYPES:
        return f"it needs model.dtype in {CUDNN_DTYPES}, got {jnp.dtype(dtype).name!r}"
    if head_dim is not None and (head_dim % 8 or head_dim > 256):
        return f"it needs head_dim a multiple of 8 and <= 256, got {head_dim}"
    return None


def _contiguous_runs(segments: Array) -> tuple[Array, Array, Array]:
    """Per row: where its non-padding tokens start, how many there are, and whether they form one run of a
    single segment id (what cuDNN's sequence lengths can express)."""
    t = segments.shape[1]
    valid = segments != 0
    start = jnp.argmax(valid, axis=1).astype(jnp.int32)
    length = valid.sum(axis=1, dtype=jnp.int32)
    idx = jnp.arange(t)[None]
    in_run = (idx >= start[:, None]) & (idx < (start + length)[:, None])
    first = jnp.take_along_axis(segments, start[:, None], axis=1)
    one_run = jnp.all((valid == in_run) & (~valid | (segments == first)))
    return start, length, one_run


def prefix_length_attention(q: Array, k: Array, v: Array, segments: Array, scale: float,
                            implementation: str = "cudnn") -> Array:
    """Causal self-attention through ``jax.nn.dot_product_attention`` with the padding given as sequence
    lengths, valid when every row's tokens are one contiguous run of one segment id (`_contiguous_runs`):
    each row is rotated so its run starts at slot 0, attended with the run length as its query and key
    length, and rotated back; padded queries give 0. ``implementation="xla"`` runs the same on any backend."""
    b, t, kh, g, d = q.shape
    start, length, _ = _contiguous_runs(segments.astype(jnp.int32))
    length = jnp.maximum(length, 1)  # an all-padding row attends token 0 to itself; its output is zeroed
    take = lambda x, idx: jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)  # noqa: E731
    rotate = (jnp.arange(t)[None] + start[:, None]) % t  # slot s of row r <- token (s + start_r) mod T
    out = jax.nn.dot_product_attention(
        take(q, rotate).reshape(b, t, kh * g, d), take(k, rotate), take(v, rotate), scale=scale, is_causal=True,
        query_seq_lengths=length, key_value_seq_lengths=length, implementation=implementation)
    out = take(out.reshape(b, t, kh, g, d), (jnp.arange(t)[None] - start[:, None]) % t)
    return jnp.where((segments != 0)[:, :, None, None, None], out, jnp.zeros((), out.dtype))


def cudnn_unusable(dtype: Any, head_dim: int, windowed: bool, softcapped: bool) -> str | None:
    """Why ``cudnn`` cannot run a layer (`cudnn_usable`, plus the sliding window and soft-cap that the cuDNN path
    here cannot express), or ``None``."""
    if windowed:
        return "the model has sliding-window layers (config.json sliding_window)"
    if softcapped:
        return "the model soft-caps attention logits (config.json attn_logit_softcapping)"
    return cudnn_usable(dtype, head_dim)


@ATTENTION_IMPLEMENTATIONS.register("cudnn", usable=cudnn_unusable)
def cudnn_attention(q: Array, k: Array, v: Array, segments: Array, scale: float,
                    window: Array | int | None = None, softcap: float | None = None) -> Array:
    """cuDNN fused flash attention (``jax.nn.dot_product_attention(..., implementation="cudnn")``, causal).

    jax 0.10.2's public API expresses masks only as ``is_causal`` plus per-row *prefix* lengths
    (``query_seq_lengths`` / ``key_value_seq_lengths``); anything else needs a dense ``[B, N, T, S]`` ``mask``
    (turned into a dense bias), i.e. the ``[T, T]`` array this module avoids. So rows whose tokens form one
    contiguous run of one segment id (left and/or right padding) go through `prefix_length_attention`;
    packed segments (several ids in a row) or gaps cannot be expressed that way, and a batch holding such a
    row takes `blockwise_attention` instead (a ``lax.cond`` on the data; both branches are compiled).
    """
    reason = cudnn_unusable(q.dtype, q.shape[-1], window is not None, bool(softcap))
    if reason is not None:
        raise ValueError(f"{CONFIG_KEY}='cudnn' is not usable: {reason}; use 'auto', 'blockwise' or 'eager'")
    one_run = _contiguous_runs(segments.astype(jnp.int32))[2]
    return jax.lax.cond(one_run, lambda: prefix_length_attention(q, k, v, segments, scale, "cudnn"),
                        lambda: blockwise_attention(q, k, v, segments, scale))


# ------------------------------------------------------------------------------------------ dispatch
def resolve_implementation(name: str, num_keys: int, dtype: Any, head_dim: int, windowed: bool = False,
                           softcapped: bool = False) -> str:
    """The `ATTENTION_IMPLEMENTATIONS` entry ``name`` (`DecoderConfig.attn_implementation`) runs as for
    ``num_keys`` keys: ``auto`` -> ``cudnn`` when its ``usable`` says so, else ``blockwise`` above
    `AUTO_BLOCKWISE_MIN_KEYS` keys, else ``eager``. An explicit name whose ``usable`` gives a reason raises
    naming `CONFIG_KEY` and the reason."""
    if name == AUTO:
        if cudnn_unusable(dtype, head_dim, windowed, softcapped) is None:
            return "cudnn"
        return "blockwise" if num_keys > AUTO_BLOCKWISE_MIN_KEYS else "eager"
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"{CONFIG_KEY}={name!r}; valid: {implementation_names()}")
    reason = ATTENTION_IMPLEMENTATIONS.info(name)["usable"](dtype, head_dim, windowed, softcapped)
    if reason is not None:
        raise ValueError(f"{CONFIG_KEY}={name!r} is not usable: {reason}; use 'auto', 'blockwise' or 'eager'")
    return name


def implementation_names() -> list[str]:
    """Every value `CONFIG_KEY` accepts: ``auto`` and the registered implementations."""
    return [AUTO, *ATTENTION_IMPLEMENTATIONS.names()]


def self_attention(q: Array, k: Array, v: Array, segments: Array, scale: float, implementation: str = AUTO,
                   window: Array | int | None = None, softcap: float | None = None) -> Array:
    """Causal, segment-masked self-attention (no KV cache) by ``implementation`` (see `resolve_implementation`),
    with an optional sliding ``window`` and logit ``softcap`` (module docstring)."""
    name = resolve_implementation(implementation, k.shape[1], q.dtype, q.shape[-1], window is not None,
                                  bool(softcap))
    return ATTENTION_IMPLEMENTATIONS.get(name)(q, k, v, segments, scale, window=window, softcap=softcap)
