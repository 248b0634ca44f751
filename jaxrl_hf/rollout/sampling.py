"""Pure, jit-able token sampling: temperature, top-k, top-p (nucleus), greedy, and the sampler log-prob.

Conventions (``logits`` is ``[B, V]`` float32):
  * temperature tau scales logits: z = logits / tau;
  * top-k keeps the k largest z (k <= 0 disables);
  * top-p keeps the smallest prefix of tokens sorted by probability whose mass reaches p
    (Holtzman et al. 2020); the most likely token is always kept; p >= 1 disables;
  * sampling draws from softmax of the kept z; greedy takes argmax of the raw logits.

The returned log-prob of the sampled token follows ``logprobs_mode``:
  * ``"temperature"`` (default): log softmax(logits / tau) over the full vocabulary, *without*
    top-k/top-p renormalisation. This is what an RL trainer recomputes (``log_softmax(logits/tau)``),
    so the rollout/trainer mismatch metric compares like with like. (vLLM's default
    ``raw_logprobs`` is the tau = 1 case; verl recomputes with the rollout temperature.)
  * ``"processed"``: log-prob under the distribution actually sampled from (after top-k/top-p).
  * ``"raw"``: log softmax(logits), ignoring temperature.
For greedy decoding the temperature is taken as 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LOGPROBS_MODES = ("temperature", "processed", "raw")
_MASKED = -jnp.inf


def top_k_filter(logits: jnp.ndarray, k: int) -> jnp.ndarray:
    """Set all but the ``k`` largest entries of each row to -inf (``k`` static; ``k <= 0`` is a no-op)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = jax.lax.top_k(logits, k)[0][..., -1:]
    return jnp.where(logits >= kth, logits, _MASKED)


NUCLEUS_CANDIDATES = 256
"""Tokens the top-p filter first looks among (``lax.top_k``); a batch with a row whose nucleus is larger finds
every row's cutoff by bisection over the whole vocabulary (`_bisected_cutoff_keys`)."""


def _nucleus_cutoff(sorted_logits: jnp.ndarray, log_norm: jnp.ndarray, p: float | jnp.ndarray) -> tuple:
    """Over logits sorted in descending order, ``(cutoff, complete)``: the smallest kept logit of each row, and
    whether the nucleus ended inside these candidates (the mass before the last one already reaches ``p``).

    Token j (in descending order) is kept iff  sum_{i<j} softmax(z)_i < p  (the mass strictly before it)."""
    probs = jnp.exp(sorted_logits - log_norm)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = mass_before < p
    cutoff = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    return cutoff, ~keep[..., -1]


def _ordered_keys(x: jnp.ndarray) -> jnp.ndarray:
    """float32 -> uint32 keys with the same order (IEEE bit pattern: negatives' bits inverted, the sign bit set on
    the rest; ``-0.0`` is read as ``+0.0``)."""
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, jnp.zeros_like(x), x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _bisected_cutoff_keys(logits: jnp.ndarray, log_norm: jnp.ndarray, p: float | jnp.ndarray) -> jnp.ndarray:
    """The key (`_ordered_keys`) of each row's smallest kept logit, without sorting: the smallest ``t`` with
    ``f(t) = sum_{key_i > t} softmax(z)_i < p``. ``f`` is a non-increasing step function that changes only at the
    row's own keys, so that ``t`` is the key of a logit v with mass strictly above it < p — `_nucleus_cutoff`'s
    rule — found by 32 halvings of the uint32 key range, each one masked sum over the vocabulary."""
    probs = jnp.exp(logits - log_norm)
    keys = _ordered_keys(logits)
    lo = jnp.min(keys, axis=-1, keepdims=True) - 1  # f(lo) = the whole mass >= p (else everything is kept)
    hi = jnp.max(keys, axis=-1, keepdims=True)  # f(hi) = 0 < p

    def halve(_: int, bounds: tuple) -> tuple:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        below = jnp.sum(jnp.where(keys > mid, probs, 0.0), axis=-1, keepdims=True) < p
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def top_p_filter(logits: jnp.ndarray, p: float | jnp.ndarray) -> jnp.ndarray:
    """Nucleus filter: keep the top tokens whose cumulative probability first reaches ``p``.

    A token is kept iff the probability mass strictly before it (in descending order) is < p;
    ties with the last kept logit are kept too. ``p >= 1`` keeps everything.

    The vocabulary is never sorted: the kept prefix is found among the ``NUCLEUS_CANDIDATES`` largest logits
    (``lax.top_k``), normalised by the full vocabulary's logsumexp; if some row's nucleus does not end among them,
    every row's cutoff is bisected over its whole vocabulary (`_bisected_cutoff_keys`; the same rule, the masses
    summed in vocabulary order instead of descending order).
    """
    log_norm = jax.nn.logsumexp(logits, axis=-1, keepdims=True)
    k = min(NUCLEUS_CANDIDATES, logits.shape[-1])
    cutoff, complete = _nucleus_cutoff(jax.lax.top_k(logits, k)[0], log_norm, p)
    keys = _ordered_keys(logits)
    cutoff_key = _ordered_keys(cutoff)
    if k < logits.shape[-1]:
        cutoff_key = jax.lax.cond(jnp.all(complete | (jnp.asarray(p) >= 1.0)), lambda c: c,
                                  lambda _: _bisected_cutoff_keys(logits, log_norm, p), cutoff_key)
    filtered = jnp.where(keys >= cutoff_key, logits, _MASKED)
    return jnp.where(jnp.asarray(p) >= 1.0, logits, filtered)


def categorical_by_inverse_cdf(keys: jax.Array, logits: jnp.ndarray) -> jnp.ndarray:
    """One draw per row from softmax(logits) (``-inf`` entries never drawn), by inverting the CDF with one uniform
    per row: token = #{i : C_i <= u * C_V}, C = cumsum(softmax(logits)), u ~ U[0, 1) from the row's key.

    The same distribution as ``jax.random.categorical`` (Gumbel-max), with one uniform per row instead of one per
    vocabulary entry."""
    probs = jax.nn.softmax(logits, axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
    total = cdf[..., -1:]
    index = jnp.sum(cdf <= u[:, None] * total, axis=-1)
    last_drawable = jnp.argmax(cdf >= total, axis=-1)  # u * total can round up to total: never past this token
    return jnp.minimum(index, last_drawable).astype(jnp.int32)


def first_argmax(x: jnp.ndarray) -> jnp.ndarray:
    """``jnp.argmax(x, axis=-1)`` (the first maximum; the first NaN where a row has one) as ``int32``, from two
    plain reductions (a max, then the first index reaching it), which vectorise where argmax's (value, index)
    pair reduction may not."""
    best = jnp.max(x, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    nan = jnp.isnan(x)  # a NaN row: its first NaN (XLA:CPU's max need not propagate NaN)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == best)
    return jnp.min(jnp.where(hit, index, x.shape[-1] - 1), axis=-1)


def process_logits(logits: jnp.ndarray, temperature: float | jnp.ndarray, top_k: int,
                   top_p: float | jnp.ndarray, use_top_p: bool) -> jnp.ndarray:
    """Temperature then top-k then top-p (vLLM's order); returns the tempered, filtered logits."""
    z = logits / temperature
    z = top_k_filter(z, top_k)
    if use_top_p:
        z = top_p_filter(z, top_p)
    return z


def sample_tokens(keys: jax.Array, logits: jnp.ndarray, temperature: float | jnp.ndarray, top_k: int = 0,
                  top_p: float | jnp.ndarray = 1.0, use_top_p: bool = False, greedy: bool = False,
                  logprobs_mode: str = "temperature") -> tuple[jnp.ndarray, jnp.ndarray]:
    """Sample one token per row with its own PRNG key; returns ``(tokens [B] int32, logprob [B] f32)``.

    ``keys`` is ``[B]`` typed keys, so a row's sample does not depend on the batch it is in.
    """
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode={logprobs_mode!r}; valid: {LOGPROBS_MODES}")
    logits = logits.astype(jnp.float32)
    if greedy:
        tokens = first_argmax(logits)
        logp_all = jax.nn.log_softmax(logits, axis=-1)
    else:
        processed = process_logits(logits, temperature, top_k, top_p, use_top_p)
        tokens = categorical_by_inverse_cdf(keys, processed)
        if logprobs_mode == "processed":
            logp_all = jax.nn.log_softmax(processed, axis=-1)
        elif logprobs_mode == "temperature":
            logp_all = jax.nn.log_softmax(logits / temperature, axis=-1)
        else:
            logp_all = jax.nn.log_softmax(logits, axis=-1)
    logp = jnp.take_along_axis(logp_all, tokens[:, None], axis=-1)[:, 0]
    return tokens, logp
