"""Rotary position embeddings (RoFormer, Su et al. 2021) with the common context-extension variants.

Frequencies are computed once in numpy float64 (they depend only on the static config); the rotation
itself is a pure jnp function using the "rotate half" layout of HF checkpoints (the first and second
halves of ``head_dim`` form the rotated pairs).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from jaxrl_hf.models.config import DecoderConfig


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def _llama3_inv_freq(inv_freq: np.ndarray, p: dict) -> np.ndarray:
    """Llama 3.1 wavelength-dependent scaling: low frequencies / factor, high kept, smooth between."""
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _yarn_inv_freq(theta: float, dim: int, p: dict, max_pos: int) -> tuple[np.ndarray, float]:
    """YaRN (Peng et al. 2023, §3.3): NTK-by-parts interpolation + attention temperature sqrt(1/t)."""
    old_ctx = float(p["original_max_position_embeddings"])
    factor = p.get("factor") or max_pos / old_ctx
    factor = float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = mscale(factor)
    beta_fast = float(p.get("beta_fast") or 32)
    beta_slow = float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    inv = (1 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1 / pos_freqs) * extrapolation_weight
    return inv, float(attention_factor)


def rope_frequencies(config: DecoderConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies ``[head_dim/2]`` and the cos/sin scale for ``config``'s rope type."""
    p = dict(config.rope_scaling)
    rope_type = config.rope_type
    dim = config.head_dim
    inv = _default_inv_freq(config.rope_theta, dim)
    if rope_type == "default":
        return inv, 1.0
    if rope_type == "linear":
        return inv / float(p["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv, p), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(config.rope_theta, dim, p, config.max_position_embeddings)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def apply_rope(x: jnp.ndarray, positions: jnp.ndarray, inv_freq: np.ndarray, scale: float = 1.0) -> jnp.ndarray:
    """Rotate ``x[..., T, H, D]`` by angle ``position * inv_freq`` (rotate-half layout).

    ``positions`` is ``[B, T]`` int. Computed in float32, returned in ``x.dtype``.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B,T,D/2]
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
