"""Log-probabilities and entropy from logits, numerically stable and optionally chunked over the vocabulary.

Chunking keeps the working set at ``[..., chunk]`` instead of ``[..., V]`` (V = 152k for Qwen2): the
log-sum-exp and the entropy's Σ p·logit are accumulated online across vocabulary chunks with a running max.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def _online_stats(logits: Array, vocab_chunk_size: int | None) -> tuple[Array, Array, Array]:
    """Running max m, Σ exp(z − m) and Σ exp(z − m)·z over the last axis, in float32."""
    z = logits.astype(jnp.float32)
    vocab = z.shape[-1]
    if vocab_chunk_size is None or vocab_chunk_size >= vocab:
        m = jax.lax.stop_gradient(jnp.max(z, axis=-1))
        e = jnp.exp(z - m[..., None])
        return m, jnp.sum(e, axis=-1), jnp.sum(e * z, axis=-1)
    n_chunks = -(-vocab // vocab_chunk_size)
    pad = n_chunks * vocab_chunk_size - vocab
    z = jnp.pad(z, [(0, 0)] * (z.ndim - 1) + [(0, pad)], constant_values=-jnp.inf)
    chunks = jnp.moveaxis(z.reshape(*z.shape[:-1], n_chunks, vocab_chunk_size), -2, 0)

    def body(carry, chunk):
        m, s, sz = carry
        m_new = jnp.maximum(m, jax.lax.stop_gradient(jnp.max(chunk, axis=-1)))
        scale = jnp.exp(m - m_new)
        e = jnp.exp(chunk - m_new[..., None])
        ez = jnp.where(e > 0, e * chunk, 0.0)  # padded -inf entries contribute 0, not nan
        return (m_new, s * scale + jnp.sum(e, -1), sz * scale + jnp.sum(ez, -1)), None

    batch_shape = z.shape[:-1]
    init = (jnp.full(batch_shape, jnp.finfo(jnp.float32).min, jnp.float32),
            jnp.zeros(batch_shape, jnp.float32), jnp.zeros(batch_shape, jnp.float32))
    (m, s, sz), _ = jax.lax.scan(body, init, chunks)
    return m, s, sz


def logsumexp_from_logits(logits: Array, *, vocab_chunk_size: int | None = None) -> Array:
    """log Σ_v exp(z_v) over the last axis (float32)."""
    m, s, _ = _online_stats(logits, vocab_chunk_size)
    return m + jnp.log(s)


def entropy_from_logits(logits: Array, *, vocab_chunk_size: int | None = None) -> Array:
    """Categorical entropy H(softmax(z)) = logsumexp(z) − Σ_v softmax(z)_v z_v, shape ``logits.shape[:-1]``."""
    m, s, sz = _online_stats(logits, vocab_chunk_size)
    return m + jnp.log(s) - sz / s


def logprobs_from_logits(logits: Array, labels: Array, *, vocab_chunk_size: int | None = None) -> Array:
    """log softmax(z)[label] = z_label − logsumexp(z), shape ``labels.shape``."""
    picked = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked.astype(jnp.float32) - logsumexp_from_logits(logits, vocab_chunk_size=vocab_chunk_size)
