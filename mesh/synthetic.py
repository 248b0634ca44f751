"""Synthetic Llama-like parameter trees with logical axes, for tests and the reshard benchmark.

Same tree paths and logical names as ``jaxrl_hf.models`` (layers stacked on a leading ``layers``
axis), sized by a `LlamaShape`: ``tiny`` (tests), ``135m`` (SmolLM2-135M-like, ~130M params) and
``1b`` (Llama-3.2-1B-like, ~1.24B params). Head counts are chosen divisible by 8 so every layout on
8 devices is valid; SmolLM2's real 9/3 heads do not split over tensor-parallel 2/4/8.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    """Sizes of a Llama-family decoder."""

    vocab: int
    embed: int
    mlp: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    tied_embeddings: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "tied_embeddings" and (not isinstance(v, int) or v < 1):
                raise ValueError(f"LlamaShape.{f.name} must be a positive integer, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"LlamaShape.heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")


LLAMA_SHAPES: dict[str, LlamaShape] = {
    "tiny": LlamaShape(vocab=256, embed=64, mlp=128, heads=8, kv_heads=8, head_dim=8, layers=8,
                       tied_embeddings=False),
    "135m": LlamaShape(vocab=49152, embed=576, mlp=1536, heads=16, kv_heads=8, head_dim=36, layers=28),
    "1b": LlamaShape(vocab=128256, embed=2048, mlp=8192, heads=32, kv_heads=8, head_dim=64, layers=16),
}


def llama_shape(name: str, layers: int | None = None) -> LlamaShape:
    """A preset by name (``tiny``, ``135m``, ``1b``), optionally with another layer count."""
    if name not in LLAMA_SHAPES:
        raise ValueError(f"unknown synthetic model {name!r}; valid: {sorted(LLAMA_SHAPES)}")
    shape = LLAMA_SHAPES[name]
    return shape if layers is None else dataclasses.replace(shape, layers=layers)


def llama_logical_axes(shape: LlamaShape) -> dict[str, Any]:
    """Logical-axis tree (tuples of names) with the ``jaxrl_hf.models`` CausalLM tree paths."""
    attn = {
        "q_proj": {"kernel": ("layers", "embed", "heads", "head_dim")},
        "k_proj": {"kernel": ("layers", "embed", "kv_heads", "head_dim")},
        "v_proj": {"kernel": ("layers", "embed", "kv_heads", "head_dim")},
        "o_proj": {"kernel": ("layers", "heads", "head_dim", "embed")},
    }
    mlp = {
        "gate_proj": {"kernel": ("layers", "embed", "mlp")},
        "up_proj": {"kernel": ("layers", "embed", "mlp")},
        "down_proj": {"kernel": ("layers", "mlp", "embed")},
    }
    tree: dict[str, Any] = {"model": {
        "embed_tokens": {"embedding": ("vocab", "embed")},
        "layers": {
            "input_layernorm": {"scale": ("layers", "embed")},
            "self_attn": attn,
            "post_attention_layernorm": {"scale": ("layers", "embed")},
            "mlp": mlp,
        },
        "norm": {"scale": ("embed",)},
    }}
    if not shape.tied_embeddings:
        tree["lm_head"] = {"kernel": ("embed", "vocab")}
    return tree


def llama_param_shapes(shape: LlamaShape, dtype: Any = jnp.bfloat16) -> dict[str, Any]:
    """`jax.ShapeDtypeStruct` tree matching `llama_logical_axes` (no memory allocated)."""
    sizes = dataclasses.asdict(shape)
    return jax.tree.map(lambda names: jax.ShapeDtypeStruct(tuple(sizes[n] for n in names), dtype),
                        llama_logical_axes(shape), is_leaf=lambda x: isinstance(x, tuple))


def param_count(shapes: Any) -> int:
    """Number of scalars in a shape/array tree."""
    return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes)))


def param_bytes(shapes: Any) -> int:
    """Bytes of a shape/array tree (the model size ``M`` of the paper's formulas)."""
    return int(sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes)))


def init_params(shapes: Any, shardings: Any, seed: int = 0) -> Any:
    """Random normal params created directly in their sharded layout (no host copy of the tree)."""
    leaves, treedef = jax.tree.flatten(shapes)
    keys = list(jax.random.split(jax.random.key(seed), len(leaves)))

    def make(key, s):
        return jax.random.normal(key, s.shape, jnp.float32).astype(s.dtype)

    out = [jax.jit(make, static_argnums=1, out_shardings=sh)(k, s)
           for k, s, sh in zip(keys, leaves, jax.tree.leaves(shardings))]
    return jax.tree.unflatten(treedef, out)
