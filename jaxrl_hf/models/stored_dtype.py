"""16-bit floats held as their bit patterns (``uint16``): XLA:CPU's decode weights and KV cache
(`jaxrl_hf.models.forward.decode_weights`, `init_kv_cache`), read back bit for bit by the decoder's layers."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def from_bits(w: Array, dtype: Any) -> Array:
    """``w`` as the 16-bit float ``dtype`` when it arrives as its bit patterns (``uint16``: XLA:CPU's decode
    weights and KV cache, `jaxrl_hf.models.forward.decode_weights`, `init_kv_cache`), else ``w`` unchanged."""
    return jax.lax.bitcast_convert_type(w, dtype) if w.dtype == jnp.uint16 else w


def to_stored(x: Array, stored: Any) -> Array:
    """``x`` in a cache's storage dtype: its bit patterns for ``uint16`` (``x`` 16-bit float), else a cast."""
    if jnp.dtype(stored) == jnp.uint16 and x.dtype != jnp.uint16:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x.astype(stored)


__all__ = ["from_bits", "to_stored"]
