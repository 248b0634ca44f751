"""The one resolver: logical-axis rules -> `PartitionSpec` / `NamedSharding` trees.

A *rule set* (`jaxrl_hf.mesh.rule_sets`) holds tuples of ``(logical_name, mesh_axes)`` pairs, ``mesh_axes``
a mesh axis name, a tuple of names (sharded over their product, first name major) or ``None``
(replicated). A *logical tree* has the structure of the parameters, each leaf a tuple (or
`PartitionSpec`) naming one logical axis per array dimension (``None`` for unnamed dims). Parameters
(training, generation, the rollout engine, the 3D-HybridEngine) and activation constraints are all
resolved here.

Resolution (`logical_to_spec`) is by rule priority: rules are tried in order; a rule applies to a
not-yet-assigned dimension with that logical name when none of its mesh axes is already used by the
array and, if the shape is known, the dimension divides evenly. A dimension some rule names but no
rule could shard (only because of divisibility) is an error naming the rule set, the parameter, the
logical axis, the mesh axes and the dimension, never a silent replication. Priority order lets one name
fall back: ``embed`` goes to ``pp`` on an embedding table (``vocab`` took ``tp``) and to ``tp`` on a
stacked norm scale (``layers`` took ``pp``), so every parameter of a Llama is split over all ``p·t``
model-parallel devices (which makes HybridFlow's transition volume exactly ``(d_g-1)/(p·t)·M``).

Activation rules use only single-choice names, so they also work with ``flax.linen.logical_to_mesh_axes``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_hf.mesh.rule_sets import MEGATRON, MeshAxes, Rules
from jaxrl_hf.mesh.topology import GenParallel

PARAM_AXIS_NAMES = ("vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "layers")
ACTIVATION_AXIS_NAMES = ("batch", "length")
REPLICATED_UNLESS_RULED = ("expert",)
"""Logical names replicated under a rule set with no rule for them (instead of an error): the ``expert`` axis of
MoE parameters (`jaxrl_hf.models.moe`), which only the expert-parallel rule sets (``fsdp_tp_ep``) split. Dense
models have none of them."""


def is_logical_leaf(x: Any) -> bool:
    """A leaf of a logical tree: a tuple/`PartitionSpec` of axis names (str) or ``None``."""
    return isinstance(x, (tuple, PartitionSpec)) and all(e is None or isinstance(e, str) for e in x)


def _as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _path_str(path: Sequence[Any]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path) or "<root>"


def _rules_name(rules: Rules) -> str:
    name = getattr(rules, "name", None)
    return f"rule set {name}: " if name else ""


def logical_to_spec(logical: Sequence[str | None], rules: Rules, *, shape: Sequence[int] | None = None,
                    axis_sizes: Mapping[str, int] | None = None, name: str = "<array>") -> PartitionSpec:
    """One array's `PartitionSpec` from its logical axis names under ``rules`` (priority order); with
    ``shape`` and ``axis_sizes`` (the mesh's) a rule applies only where the dimension divides evenly."""
    logical = tuple(logical)
    where = f"{_rules_name(rules)}{name}"
    if shape is not None and len(shape) != len(logical):
        raise ValueError(f"{where}: logical axes {logical} have {len(logical)} entries but the array has "
                         f"shape {tuple(shape)}")
    known = {rule_name for rule_name, _ in rules} | set(REPLICATED_UNLESS_RULED)
    assigned: list[tuple[str, ...] | None] = [None] * len(logical)
    used: set[str] = set()
    skipped: dict[int, list[str]] = {}
    for rule_name, rule_axes in rules:
        axes = _as_tuple(rule_axes)
        for dim, dim_name in enumerate(logical):
            if dim_name != rule_name or assigned[dim] is not None:
                continue
            if not axes:
                assigned[dim] = ()
                continue
            if used.intersection(axes):
                continue
            if shape is not None and axis_sizes is not None:
                missing = [a for a in axes if a not in axis_sizes]
                if missing:
                    raise ValueError(f"{where}: rule ({rule_name!r}, {rule_axes!r}) names mesh axes {missing} "
                                     f"not in the mesh (axes: {sorted(axis_sizes)})")
                size = int(np.prod([axis_sizes[a] for a in axes]))
                if shape[dim] % size:
                    skipped.setdefault(dim, []).append(f"{axes} (size {size})")
                    continue
            assigned[dim] = axes
            used.update(axes)
    for dim, reasons in skipped.items():
        if assigned[dim] is None:
            raise ValueError(f"{where}: dimension {dim} (logical {logical[dim]!r}, size {shape[dim]}) is not "
                             f"divisible by any mesh axes a rule allows: {', '.join(reasons)}")
    unknown = [n for n in logical if n is not None and n not in known]
    if unknown:
        raise ValueError(f"{where}: logical axis names {unknown} have no rule (rules cover {sorted(known)})")
    entries = [None if not a else (a[0] if len(a) == 1 else a) for a in assigned]
    return PartitionSpec(*entries)


def logical_to_specs(logical_tree: Any, rules: Rules, *, shapes: Any = None, mesh: Mesh | None = None) -> Any:
    """Tree of `PartitionSpec` for a logical tree; ``shapes`` (arrays / ShapeDtypeStructs, same
    structure) and ``mesh`` enable the divisibility checks."""
    sizes = dict(mesh.shape) if mesh is not None else None

    def one(path, logical, shaped=None):
        shape = None if shaped is None else tuple(shaped.shape)
        return logical_to_spec(logical, rules, shape=shape, axis_sizes=sizes, name=_path_str(path))

    if shapes is None:
        return jax.tree_util.tree_map_with_path(one, logical_tree, is_leaf=is_logical_leaf)
    return jax.tree_util.tree_map_with_path(one, logical_tree, shapes, is_leaf=is_logical_leaf)


def logical_to_shardings(logical_tree: Any, mesh: Mesh, rules: Rules, *, shapes: Any = None) -> Any:
    """Tree of `NamedSharding` on ``mesh`` for a logical tree (see `logical_to_specs`)."""
    specs = logical_to_specs(logical_tree, rules, shapes=shapes, mesh=mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


# ----------------------------------------------------------------------------------------------
# The default (megatron) rule set's rules, by layout.

def train_param_rules(gen: GenParallel | None = None) -> Rules:
    """``megatron`` training-layout param rules (`jaxrl_hf.mesh.rule_sets`) for the train -> ``gen``
    transition (``gen`` picks the order of the 1-D ``embed`` rule that keeps the generation shard a
    superset of the training shard)."""
    return MEGATRON.for_transition(gen).params


def generation_param_rules(gen: GenParallel | None = None) -> Rules:
    """``megatron`` generation-layout param rules: over ``pp_g``/``tp_g``, replicated over ``dg`` and ``dp``."""
    return MEGATRON.for_transition(gen).on_generation_mesh().params


def train_activation_rules() -> Rules:
    """``megatron`` activations in training: batch over ``dp``; heads/mlp/vocab over ``tp``."""
    return MEGATRON.activations


def generation_activation_rules(dg_axes: tuple[str, ...] = ("dg",)) -> Rules:
    """``megatron`` activations in generation: batch over micro-DP and DP (``dg_axes + ('dp',)``), heads over
    ``tp_g``."""
    return MEGATRON.on_generation_mesh(dg_axes).activations


def optimizer_state_shardings(opt_state: Any, params: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for an optimizer state (e.g. ``jax.eval_shape(tx.init, params)``).

    A state leaf whose key path ends with a parameter's key path and has that parameter's shape
    (Adam's ``mu``/``nu``, momentum) takes the parameter's sharding; scalars (step counts) are
    replicated; anything else is an error naming the leaf.
    """
    flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
    flat_shard = jax.tree.leaves(param_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
    by_path = {tuple(path): (tuple(leaf.shape), sh) for (path, leaf), sh in zip(flat_params, flat_shard)}

    def one(path, leaf):
        path = tuple(path)
        for start in range(len(path)):
            hit = by_path.get(path[start:])
            if hit is not None and hit[0] == tuple(leaf.shape):
                return hit[1]
        if np.ndim(leaf) == 0 or not leaf.shape:
            return NamedSharding(mesh, PartitionSpec())
        raise ValueError(f"optimizer state leaf {_path_str(path)} (shape {tuple(leaf.shape)}) matches no "
                         f"parameter path/shape; give it a sharding explicitly")

    return jax.tree_util.tree_map_with_path(one, opt_state)
