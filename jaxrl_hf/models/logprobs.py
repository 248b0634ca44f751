"""Per-token log-probabilities and entropy from hidden states, chunked over the sequence.

For a position with hidden state h, LM-head kernel W ``[embed, vocab]`` and temperature tau:
    z = soft_cap(h @ W) / tau,   lse = logsumexp(z),   (soft_cap(x) = c tanh(x / c) with Gemma 2's
                                                     final_logit_softcapping c, else the identity)
    log p(y) = z_y - lse,                        (the policy log-likelihood in the PPO ratio)
    H = lse - sum_v softmax(z)_v * z_v           (entropy of the tempered distribution).
Only one ``[B, chunk, vocab]`` float32 block exists at a time; with more than one chunk the chunk function
is rematerialised in the backward pass, so training never stores full-vocabulary logits for the whole sequence.
A sequence of one chunk is not: the LM head's backward runs first, while every activation is still held, so
recomputing its block there costs a matmul over the vocabulary and changes no peak.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_hf.models.attention import soft_cap
from jaxrl_hf.models.matmul import lm_head_matmul


def _chunk_stats(hidden: jnp.ndarray, kernel: jnp.ndarray, targets: jnp.ndarray,
                 temperature: float | jnp.ndarray, with_entropy: bool, softcap: float | None,
                 vocab_major: bool = False) -> tuple[jnp.ndarray, jnp.ndarray]:
    rows = hidden.reshape(-1, hidden.shape[-1])  # one 2-D matmul (see models/llama.py `_Proj`)
    if hidden.dtype == jnp.float32:
        w = kernel.astype(jnp.float32)
        logits = jnp.dot(rows, w.T if vocab_major else w)
    else:  # f32 logits, f32 accumulation both ways, the cotangent split at the target (`lm_head_matmul`)
        logits = lm_head_matmul(rows, kernel, targets.reshape(-1), vocab_major)
    vocab = kernel.shape[0] if vocab_major else kernel.shape[-1]
    logits = soft_cap(logits.reshape(*hidden.shape[:-1], vocab), softcap) / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logp = picked - lse
    if with_entropy:
        probs = jnp.exp(logits - lse[..., None])
        entropy = lse - jnp.sum(probs * logits, axis=-1)
    else:
        entropy = jnp.zeros_like(logp)
    return logp, entropy


def log_probs_and_entropy_from_hidden(hidden: jnp.ndarray, kernel: jnp.ndarray, targets: jnp.ndarray,
                                      temperature: float | jnp.ndarray = 1.0, chunk_size: int = 128,
                                      with_entropy: bool = True, softcap: float | None = None,
                                      vocab_major: bool = False) -> tuple[jnp.ndarray, jnp.ndarray]:
    """``(log p(targets), entropy)``, both ``[B, T]`` float32, for hidden ``[B, T, E]`` and kernel ``[E, V]``
    (``[V, E]`` with ``vocab_major``: a tied embedding as stored, `forward.lm_head_weight`).

    The sequence is cut into ``chunk_size`` pieces (padded at the end) processed by ``lax.map`` with
    ``jax.checkpoint`` (one chunk: computed directly); peak extra memory is one ``[B, chunk_size, V]`` float32
    block. ``softcap``: the model's ``final_logit_softcapping``.
    """
    b, t, e = hidden.shape
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    c = min(chunk_size, t)
    n = -(-t // c)
    pad = n * c - t
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
    if n == 1:  # one block either way (module docstring): no rematerialisation
        return _chunk_stats(hidden, kernel, targets, temperature, with_entropy, softcap, vocab_major)
    hs = hidden.reshape(b, n, c, e).swapaxes(0, 1)
    ts = targets.reshape(b, n, c).swapaxes(0, 1)
    fn = jax.checkpoint(lambda args: _chunk_stats(args[0], kernel, args[1], temperature, with_entropy, softcap,
                                                  vocab_major))
    logp, ent = jax.lax.map(fn, (hs, ts))
    logp = logp.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n * c)[:, :t]
    return logp, ent
