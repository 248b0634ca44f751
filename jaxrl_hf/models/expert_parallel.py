"""Expert parallelism: each device of a mesh axis holds ``E / ep`` of an MoE layer's experts and computes them for
the tokens it holds.

The experts' weights are sharded on their ``expert`` axis over the mesh axis an ``expert`` rule names
(`jaxrl_hf.mesh.rule_sets`, e.g. ``fsdp_tp_ep``: ``expert`` over ``tp``); the tokens are replicated over that axis
(their ``batch`` / ``length`` rules do not use it). In a `jax.shard_map` over the axis, device ``r`` runs the
dropless grouped matmuls (`jaxrl_hf.models.moe.grouped_experts`) of experts ``[r·E/ep, (r+1)·E/ep)`` on the
(token, choice) pairs routed to them, the other pairs dropped there, and one ``psum`` over the axis adds the
devices' shares (the all-reduce that ends a tensor-parallel MLP, here once per MoE layer)::

    y_n = sum_r  sum_{j : e_nj in experts(r)}  w_nj · expert_{e_nj}(x_n)

so ``y`` equals the unsharded block's up to the order of that sum. XLA's SPMD partitioner does not split a
``ragged_dot`` over its groups (it all-gathers the weights), hence the explicit map. Other mesh axes pass through
(the weights' other dimensions are gathered first, as ZeRO-3 gathers them for any layer).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrl_hf.mesh.rules import logical_to_spec

Array = jnp.ndarray


def expert_mesh_axes(rules: Any) -> tuple[str, ...]:
    """The mesh axes the ``expert`` axis goes over under activation ``rules`` (``()``: experts not split)."""
    if rules is None or not any(name == "expert" for name, _ in rules):
        return ()
    axes = logical_to_spec(("expert",), rules)[0]
    return () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))


def expert_parallel_block(grouped: Any, x: Array, experts: Array, weights: Array, gate: Array, up: Array,
                          down: Array, *, mesh: Any, rules: Any, axes: tuple[str, ...]) -> Array:
    """``grouped(x, experts, weights, gate, up, down, drops=True)`` (`jaxrl_hf.models.moe.grouped_experts`) over
    ``x [B, T, embed]`` with the experts split over ``axes`` (module docstring); returns ``[B, T, embed]``."""
    tokens = logical_to_spec(("batch", "length", "embed"), rules)
    if set(axes) & {a for entry in tokens if entry for a in ((entry,) if isinstance(entry, str) else entry)}:
        raise ValueError(f"expert parallelism over {axes}: the tokens are split over those axes too "
                         f"(activations {tokens}); the experts need a mesh axis the tokens are replicated over")
    size = math.prod(mesh.shape[a] for a in axes)
    num_experts, k = gate.shape[0], experts.shape[-1]
    if num_experts % size:
        raise ValueError(f"expert parallelism: {num_experts} experts do not split over {axes} (size {size})")
    local = num_experts // size
    row_spec = PartitionSpec(tokens[0], tokens[1], None)
    weight_spec = PartitionSpec(axes if len(axes) > 1 else axes[0])

    def shard(x: Array, experts: Array, weights: Array, gate: Array, up: Array, down: Array) -> Array:
        index = 0
        for a in axes:  # this device's place along the expert axes (first name major)
            index = index * mesh.shape[a] + jax.lax.axis_index(a)
        mine = experts - index * local
        kept = (mine >= 0) & (mine < local)
        flat = x.reshape(-1, x.shape[-1])
        y = grouped(flat, jnp.where(kept, mine, local).reshape(-1, k), jnp.where(kept, weights, 0).reshape(-1, k),
                    gate, up, down, drops=True)
        return jax.lax.psum(y.astype(jnp.float32), axes).astype(x.dtype).reshape(x.shape)

    b, t = x.shape[0], x.shape[1]
    return jax.shard_map(shard, mesh=mesh, in_specs=(row_spec, row_spec, row_spec, weight_spec, weight_spec,
                                                    weight_spec),
                         out_specs=row_spec, check_vma=False)(
        x, experts.reshape(b, t, k), weights.reshape(b, t, k), gate, up, down)


__all__ = ["expert_mesh_axes", "expert_parallel_block"]
