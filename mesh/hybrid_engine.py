"""The 3D-HybridEngine reshard (HybridFlow §2.5) and the two baselines of its Table 2.

* `HybridEngine` (HybridFlow): ``to_generation`` moves the params from a training layout (rule set ``megatron``,
  ``fsdp`` or ``fsdp_tp`` on ``('pp','tp','dp')``) to the zero-redundancy generation layout (params over
  ``pp_g``/``tp_g``, replicated over micro-DP ``dg`` and ``dp``). Every device's generation shard contains its
  training shard (the grouping of §2.5.3 plus the rule sets' axis orders: ``pp`` before ``tp`` before ``dp`` on a
  dimension split over several), so XLA compiles the move to all-gathers only and each device receives exactly
  its generation shard minus its training shard::

      bytes received per device = M/(p_g·t_g) − S_train,    d_g = p·t/(p_g·t_g)
        megatron (params replicated over dp):      S_train = M/(p·t)    ->  (d_g − 1)/(p·t) · M
        fsdp (t = 1) / fsdp_tp (sharded over dp):  S_train = M/(p·t·d)  ->  (d_g·d − 1)/(p·t·d) · M

  (``M`` = model bytes; exact when every param splits evenly over the axes its rules name, as the resolver
  requires). The all-gather groups are the micro-DP groups (megatron) or the ``d_g·d`` devices sharing a
  generation shard (fsdp/fsdp_tp: micro-DP × DP). The training buffers are consumed, so after the call a device
  holds its generation shard and nothing else. ``to_training`` slices each training shard out of the generation
  shard: compiled programs without any collective.

  By default the move is chunked (`jaxrl_hf.mesh.chunked_reshard`: leaf by leaf, ``layers_per_group`` stacked
  layers per program, donated buffers), so the peak is about the generation shard (Table 2) instead of training +
  generation shard; ``layers_per_group=None`` compiles today's one program for the whole tree (same bytes, same
  values, higher peak).
* `VanillaTransition` (HybridFlow-V): the training grouping reused for generation. All-gather
  inside each training PP×TP group (``(p·t-1)/(p·t)·M``), then each device keeps its generation
  shard and, since that need not contain its training shard, also keeps the training shard.
* `DeepSpeedChatTransition` (DS-Chat): ZeRO-3 training layout (the ``fsdp_tp`` rule set: params split
  over all ``N`` devices); all-gather over all devices (``(N-1)/N·M``), slice the generation shard, keep
  the ZeRO shard.

Every layout comes from a named rule set (`jaxrl_hf.mesh.rule_sets`): the training layout is the rule
set oriented for the transition (`RuleSet.for_transition`), the generation layout its
`RuleSet.on_generation_mesh` derivation; one resolver (`jaxrl_hf.mesh.rules`) turns both into shardings.

The baselines gather the whole tree before partitioning, as the paper describes them (peak ``M``);
they run as two programs (gather, then a local slice) so XLA cannot fuse the gather and the slice
into a cheaper exchange.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_hf.mesh.chunked_reshard import DEFAULT_LAYERS_PER_GROUP, ChunkedReshard
from jaxrl_hf.mesh.device_mesh import HybridMeshes, build_hybrid_meshes, build_vanilla_generation_mesh
from jaxrl_hf.mesh.rule_sets import MEGATRON, RuleSet, get_rule_set
from jaxrl_hf.mesh.rules import logical_to_shardings
from jaxrl_hf.mesh.topology import GenParallel

METHODS = ("hybridflow", "hybridflow_v", "ds_chat")


def _reshard_as_bits(in_shardings: Any, out_shardings: Any):
    """Identity that moves 16-bit floats as ``uint16`` bits.

    XLA's CPU backend runs bf16/f16 collectives in f32 (convert, all-gather, convert back), which
    doubles the bytes moved; constraining the reshard onto the bit pattern keeps it at 2 bytes per
    element. On backends with native 16-bit collectives the two bitcasts are free.
    """
    def reshard(tree: Any) -> Any:
        def one(x: Any, source: NamedSharding, target: NamedSharding) -> Any:
            if jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize == 2:
                # bitcast where the data is, move the bits, bitcast back where it lands; the barrier
                # keeps XLA from folding the bitcasts back around the collective
                bits = jax.lax.with_sharding_constraint(jax.lax.bitcast_convert_type(x, jnp.uint16), source)
                bits = jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(bits, target))
                return jax.lax.bitcast_convert_type(bits, x.dtype)
            return x
        return jax.tree.map(one, tree, in_shardings, out_shardings)
    return reshard


def _jit_reshard(in_shardings: Any, out_shardings: Any, donate: bool) -> Any:
    return jax.jit(_reshard_as_bits(in_shardings, out_shardings), in_shardings=(in_shardings,), out_shardings=out_shardings,
                   donate_argnums=(0,) if donate else ())


def _call_quietly(fn: Any, tree: Any) -> Any:
    # Donation can only alias equal-shaped buffers; a reshard that grows or shrinks the shards
    # cannot alias, so XLA warns "Some donated buffers were not usable". We delete them ourselves.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return fn(tree)


def delete_tree(tree: Any) -> None:
    """Free every (not yet deleted) array of ``tree`` on all its devices."""
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


def shard_bytes_per_device(shardings: Any, shapes: Any) -> int:
    """Largest per-device byte count of a tree laid out as ``shardings`` (from shapes alone)."""
    per_device: dict[int, int] = {}
    for sh, s in zip(jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding)),
                     jax.tree.leaves(shapes)):
        itemsize = jax.numpy.dtype(s.dtype).itemsize
        for device, index in sh.devices_indices_map(tuple(s.shape)).items():
            count = 1
            for dim, sl in zip(s.shape, index):
                start, stop, _ = sl.indices(dim)
                count *= stop - start
            per_device[device.id] = per_device.get(device.id, 0) + count * itemsize
    return max(per_device.values(), default=0)


def _replicated(tree: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree,
                        is_leaf=lambda x: isinstance(x, NamedSharding))


@dataclasses.dataclass(frozen=True)
class Phase:
    """One compiled program of a transition: ``fn`` maps arrays laid out as ``in_shardings``."""

    name: str
    fn: Any
    in_shardings: Any
    mesh: Mesh
    held_bytes_per_device: int = 0  # parameter bytes alive during the phase that are not its arguments
    args: tuple | None = None  # abstract arguments to lower ``fn`` with (None: one tree laid out as in_shardings)


class HybridEngine:
    """Zero-redundancy train<->generation reshard of one actor's parameters (HybridFlow §2.5.3).

    ``logical_axes``: tree of logical-axis tuples matching the params; ``param_shapes``: tree of
    arrays / `jax.ShapeDtypeStruct` (shapes and dtypes only). ``devices`` in rank order (default:
    all devices by process then id). ``rule_set`` (a `RuleSet` or its registered name: ``megatron``, ``fsdp``,
    ``fsdp_tp``) is the training layout; the traffic per layout is in the module docstring.
    ``layers_per_group``: stacked layers per reshard program (`jaxrl_hf.mesh.chunked_reshard`; must divide the
    layers each training stage holds), or ``None`` for one program over the whole tree.
    """

    method = "hybridflow"

    def __init__(self, gen: GenParallel, logical_axes: Any, param_shapes: Any,
                 devices: Sequence[jax.Device] | None = None, rule_set: RuleSet | str = MEGATRON,
                 layers_per_group: int | None = DEFAULT_LAYERS_PER_GROUP):
        self.config = gen
        self.param_shapes = param_shapes
        self.rule_set = (get_rule_set(rule_set) if isinstance(rule_set, str) else rule_set).for_transition(gen)
        self.meshes: HybridMeshes = build_hybrid_meshes(gen, devices)
        self.train_shardings = logical_to_shardings(logical_axes, self.meshes.train, self.rule_set.params,
                                                    shapes=param_shapes)
        # Params are replicated over dg (and dp), so a split dg never appears in their specs.
        self.gen_shardings = logical_to_shardings(logical_axes, self.meshes.generation,
                                                  self.rule_set.on_generation_mesh().params, shapes=param_shapes)
        self.layers_per_group = layers_per_group
        self.chunked = (None if layers_per_group is None else
                        ChunkedReshard(self.train_shardings, self.gen_shardings, logical_axes, param_shapes,
                                       layers_per_group))
        self._to_generation = _jit_reshard(self.train_shardings, self.gen_shardings, donate=True)
        self._to_training = _jit_reshard(self.gen_shardings, self.train_shardings, donate=True)

    def to_generation(self, train_params: Any, observer: Any = None) -> Any:
        """Training layout -> generation layout; consumes ``train_params`` (their buffers are freed).
        ``observer()`` (chunked only) runs after each program, before the consumed leaf is freed."""
        if self.chunked is not None:
            return self.chunked.to_generation(train_params, observer)
        gen_params = _call_quietly(self._to_generation, train_params)
        jax.block_until_ready(gen_params)
        delete_tree(train_params)
        return gen_params

    def to_training(self, gen_params: Any, observer: Any = None) -> Any:
        """Generation layout -> training layout by local slicing (no communication); consumes ``gen_params``."""
        if self.chunked is not None:
            return self.chunked.to_training(gen_params, observer)
        train_params = _call_quietly(self._to_training, gen_params)
        jax.block_until_ready(train_params)
        delete_tree(gen_params)
        return train_params

    def transition(self, train_params: Any) -> tuple[Any, Any]:
        """``(generation params, params still held besides them)``; nothing is held besides them."""
        return self.to_generation(train_params), None

    def phases(self) -> list[Phase]:
        """The compiled program(s) of ``to_generation`` in order, for HLO / memory analysis."""
        if self.chunked is not None:
            return [Phase(st.name, st.fn, None, self.meshes.train, st.held_bytes_per_device, st.args)
                    for st in self.chunked.generation_steps()]
        return [Phase("reshard", self._to_generation, self.train_shardings, self.meshes.train)]

    def training_phases(self) -> list[Phase]:
        """The compiled program(s) of ``to_training`` in order."""
        if self.chunked is not None:
            return [Phase(st.name, st.fn, None, self.meshes.generation, st.held_bytes_per_device, st.args)
                    for st in self.chunked.training_steps()]
        return [Phase("slice", self._to_training, self.gen_shardings, self.meshes.generation)]


class _GatherThenSlice:
    """Shared mechanics of the two baselines: gather the full model, slice the generation shard."""

    method = ""

    def __init__(self, gen: GenParallel, train_shardings: Any, logical_axes: Any, param_shapes: Any,
                 devices: Sequence[jax.Device] | None):
        self.config = gen
        self.param_shapes = param_shapes
        # ('dg','pp_g','tp_g','dp') lists devices in the training flat order, so both programs
        # share one device assignment.
        vanilla = build_vanilla_generation_mesh(gen, devices)
        self.generation_mesh = Mesh(vanilla.devices.transpose(2, 0, 1, 3), ("dg", "pp_g", "tp_g", "dp"),
                                    axis_types=vanilla.axis_types)
        self.train_mesh = jax.tree.leaves(train_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))[0].mesh
        self.train_shardings = train_shardings
        self.full_shardings = _replicated(train_shardings, self.train_mesh)
        self.gen_shardings = logical_to_shardings(logical_axes, self.generation_mesh,
                                                  MEGATRON.for_transition(gen).on_generation_mesh().params,
                                                  shapes=param_shapes)
        self._gather = _jit_reshard(self.train_shardings, self.full_shardings, donate=False)
        self._slice = _jit_reshard(self.full_shardings, self.gen_shardings, donate=True)

    def transition(self, train_params: Any) -> tuple[Any, Any]:
        """``(generation params, training params kept as the redundant copy)``."""
        full = self._gather(train_params)
        gen_params = _call_quietly(self._slice, full)
        jax.block_until_ready(gen_params)
        delete_tree(full)
        return gen_params, train_params

    def phases(self) -> list[Phase]:
        kept = shard_bytes_per_device(self.train_shardings, self.param_shapes)
        return [Phase("gather", self._gather, self.train_shardings, self.train_mesh),
                Phase("slice", self._slice, self.full_shardings, self.train_mesh, held_bytes_per_device=kept)]


class VanillaTransition(_GatherThenSlice):
    """HybridFlow-V: all-gather within each training PP×TP group, keep the training shard too."""

    method = "hybridflow_v"

    def __init__(self, gen: GenParallel, logical_axes: Any, param_shapes: Any,
                 devices: Sequence[jax.Device] | None = None):
        meshes = build_hybrid_meshes(gen, devices)
        train = logical_to_shardings(logical_axes, meshes.train, MEGATRON.for_transition(gen).params,
                                     shapes=param_shapes)
        super().__init__(gen, train, logical_axes, param_shapes, devices)


class DeepSpeedChatTransition(_GatherThenSlice):
    """DS-Chat style: ZeRO-3 training layout over all devices, all-gather over all of them."""

    method = "ds_chat"

    def __init__(self, gen: GenParallel, logical_axes: Any, param_shapes: Any,
                 devices: Sequence[jax.Device] | None = None):
        meshes = build_hybrid_meshes(gen, devices)
        zero3 = get_rule_set("fsdp_tp").for_transition(gen)
        train = logical_to_shardings(logical_axes, meshes.train, zero3.params, shapes=param_shapes)
        super().__init__(gen, train, logical_axes, param_shapes, devices)


def make_transition(method: str, gen: GenParallel, logical_axes: Any, param_shapes: Any,
                    devices: Sequence[jax.Device] | None = None, **options: Any) -> Any:
    """The transition implementing ``method`` (one of `METHODS`); ``options`` (``rule_set``,
    ``layers_per_group``) go to `HybridEngine` only."""
    classes = {"hybridflow": HybridEngine, "hybridflow_v": VanillaTransition, "ds_chat": DeepSpeedChatTransition}
    if method not in classes:
        raise ValueError(f"unknown transition method {method!r}; valid: {list(METHODS)}")
    if options and method != "hybridflow":
        raise ValueError(f"transition method {method!r} takes no options (got {sorted(options)}); "
                         "rule_set / layers_per_group are HybridEngine's")
    return classes[method](gen, logical_axes, param_shapes, devices, **options)
