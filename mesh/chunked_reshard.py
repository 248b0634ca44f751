"""The low-peak schedule of the 3D-HybridEngine reshard: leaf by leaf, and layer group by layer group.

A one-shot reshard (one jitted identity over the whole tree) holds every training shard and every generation
shard at the same time: peak ``S_train + S_gen`` per device. HybridFlow's Table 2 has the peak equal to the
generation shard ``S_gen``, since an in-place all-gather writes the generation shard around the training shard
it already contains. XLA cannot grow a buffer in place, so `ChunkedReshard` gets close by never holding both
layouts of more than one leaf:

* ``to_generation``: leaves largest first. A leaf stacked over a leading ``layers`` axis (``nn.scan``) gets its
  generation buffer allocated once, then filled by one jitted program per group of ``layers_per_group`` local
  layers that donates the buffer (so the update is in place: input and output alias) and all-gathers only that
  group: local layers ``[g·c, (g+1)·c)`` of every training stage, which land at the same local layers of the
  generation shard. The training leaf is deleted once its last group is in. Other leaves (embeddings, final norm)
  are resharded whole, the training leaf donated.
* ``to_training``: leaves smallest first; each training shard is a local slice of its generation shard (the
  containment of the zero-redundancy grouping, HybridFlow §2.5.3), the generation leaf is freed right after.

Peak per device while leaf ``L`` is converted (``T``/``G``: training/generation shard bytes of a leaf, ``S_gen``
the whole generation shard, ``P_L = G_L·layers_per_group/(layers per stage)`` one gathered group)::

    to_generation: S_gen + T_L − Σ_{j after L} (G_j − T_j) + P_L
    to_training:   S_gen + T_L − Σ_{j before L} (G_j − T_j)

With the largest leaves converted first (and back last) a large ``T_L`` always comes with a large correction
sum, so the overshoot over ``S_gen`` is about the smallest training leaf plus one gathered group (1-2% for the
135M-like model). A leaf whose training and generation shards have the same size (``d_g = 1`` and no ``dp``
sharding) is resharded by one donated identity, which reuses the buffer. Every program moves only the bytes the
one-shot reshard moves for that leaf, so the total traffic is unchanged (`jaxrl_hf.mesh.hybrid_engine`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_hf.mesh.rules import is_logical_leaf

# One layer per program: the smallest gathered temporary; a layer of one leaf is still a large message
# (a Llama-1B layer's q_proj is 8 MiB), so the program count (layers/p per stacked leaf) costs little.
DEFAULT_LAYERS_PER_GROUP = 1
LAYERS_AXIS = "layers"


def bytes_by_device(sharding: NamedSharding, shape: Sequence[int], dtype: Any) -> dict[int, int]:
    """Bytes of one array laid out as ``sharding`` on each device id (from the shape alone)."""
    itemsize = jnp.dtype(dtype).itemsize
    out = {}
    for device, index in sharding.devices_indices_map(tuple(shape)).items():
        out[device.id] = itemsize * math.prod(len(range(*sl.indices(n))) for sl, n in zip(index, shape))
    return out


def _shards_along(sharding: NamedSharding, dim: int) -> int:
    entry = sharding.spec[dim] if dim < len(sharding.spec) else None
    names = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    return math.prod(int(sharding.mesh.shape[n]) for n in names)


def _spec_tail(sharding: NamedSharding, ndim: int) -> tuple:
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return spec[1:]


def _is_16bit_float(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def _as_bits(x: jax.Array) -> jax.Array:
    # XLA's CPU backend runs 16-bit float collectives in f32: move the bit pattern instead (see hybrid_engine)
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if _is_16bit_float(x.dtype) else x


def _from_bits(x: jax.Array, dtype: Any) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def _call_donating(fn: Any, *args: Any) -> Any:
    with warnings.catch_warnings():  # a reshard that changes the shard size cannot reuse the donated buffer
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        return fn(*args)


@dataclasses.dataclass(frozen=True)
class LeafPlan:
    """How one leaf moves: ``groups > 1`` layer groups of ``layers_per_group`` local layers, else whole."""

    index: int
    path: str
    shape: tuple[int, ...]
    dtype: Any
    train_sharding: NamedSharding
    gen_sharding: NamedSharding
    train_bytes: dict[int, int]
    gen_bytes: dict[int, int]
    groups: int
    layers_per_group: int

    @property
    def size(self) -> int:
        return max(self.train_bytes.values(), default=0)


@dataclasses.dataclass(frozen=True)
class Step:
    """One compiled program of the schedule, with the parameter bytes held beside its arguments."""

    name: str
    leaf: LeafPlan
    kind: str  # "alloc", "fill", "whole" (to_generation) or "slice" (to_training)
    group: int
    fn: Any
    args: tuple  # abstract arguments (ShapeDtypeStruct with shardings) to lower ``fn`` with
    held_bytes_per_device: int


def _chunkable(logical: tuple, shape: tuple[int, ...], train_sh: NamedSharding, gen_sh: NamedSharding) -> bool:
    """A stacked leaf whose generation layer blocks are unions of training layer blocks."""
    if not logical or logical[0] != LAYERS_AXIS or len(shape) < 1:
        return False
    p_train, p_gen = _shards_along(train_sh, 0), _shards_along(gen_sh, 0)
    if p_train % p_gen or shape[0] % p_train:
        return False
    t_idx, g_idx = train_sh.devices_indices_map(shape), gen_sh.devices_indices_map(shape)
    return all(g_idx[d][0].indices(shape[0])[0] <= t_idx[d][0].indices(shape[0])[0]
               and t_idx[d][0].indices(shape[0])[1] <= g_idx[d][0].indices(shape[0])[1] for d in t_idx)


def _path_str(path: Sequence[Any]) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path) or "<root>"


def plan_leaves(train_shardings: Any, gen_shardings: Any, logical_axes: Any, param_shapes: Any,
                layers_per_group: int) -> list[LeafPlan]:
    """One `LeafPlan` per leaf (tree order). ``layers_per_group`` must divide every stacked leaf's local layer
    count ``layers / p`` (``ValueError`` naming the option and the valid values otherwise)."""
    if isinstance(layers_per_group, bool) or not isinstance(layers_per_group, (int, np.integer)) \
            or layers_per_group < 1:
        raise ValueError(f"layers_per_group={layers_per_group!r}: must be a positive integer (layers per reshard "
                         "program) or None (one program for the whole tree)")
    is_sh = lambda x: isinstance(x, NamedSharding)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(param_shapes)[0]
    logical = jax.tree.leaves(logical_axes, is_leaf=is_logical_leaf)
    trains, gens = jax.tree.leaves(train_shardings, is_leaf=is_sh), jax.tree.leaves(gen_shardings, is_leaf=is_sh)
    plans = []
    for i, ((path, s), names, tr, gs) in enumerate(zip(flat, logical, trains, gens, strict=True)):
        shape, dtype = tuple(s.shape), jnp.dtype(s.dtype)
        tb, gb = bytes_by_device(tr, shape, dtype), bytes_by_device(gs, shape, dtype)
        groups = 1
        if tb != gb and _chunkable(tuple(names), shape, tr, gs):
            local = shape[0] // _shards_along(tr, 0)
            if local % layers_per_group:
                valid = [k for k in range(1, local + 1) if local % k == 0]
                raise ValueError(f"layers_per_group={layers_per_group} does not divide the {local} layers each "
                                 f"training stage holds of {_path_str(path)} (shape {shape}); valid: {valid}")
            groups = local // layers_per_group
        plans.append(LeafPlan(i, _path_str(path), shape, dtype, tr, gs, tb, gb, groups, layers_per_group))
    return plans


class ChunkedReshard:
    """The leaf-by-leaf, layer-group-by-layer-group train <-> generation reshard (module docstring)."""

    def __init__(self, train_shardings: Any, gen_shardings: Any, logical_axes: Any, param_shapes: Any,
                 layers_per_group: int = DEFAULT_LAYERS_PER_GROUP):
        self.layers_per_group = int(layers_per_group)
        self.treedef = jax.tree.structure(param_shapes)
        self.leaves = plan_leaves(train_shardings, gen_shardings, logical_axes, param_shapes, layers_per_group)
        self._programs: dict[tuple, Any] = {}
        # to_generation: largest first; to_training: smallest first (the peak formulas above)
        self.generation_order = sorted(self.leaves, key=lambda p: -p.size)
        self.training_order = list(reversed(self.generation_order))

    # ------------------------------------------------------------------------------------------ programs
    def _program(self, kind: str, leaf: LeafPlan) -> Any:
        key = (kind, leaf.shape, leaf.dtype, leaf.train_sharding, leaf.gen_sharding, leaf.groups)
        if key not in self._programs:
            self._programs[key] = getattr(self, f"_build_{kind}")(leaf)
        return self._programs[key]

    @staticmethod
    def _build_alloc(leaf: LeafPlan) -> Any:
        return jax.jit(lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=leaf.gen_sharding)

    @staticmethod
    def _build_whole(leaf: LeafPlan) -> Any:
        return _jit_leaf_reshard(leaf.train_sharding, leaf.gen_sharding)

    @staticmethod
    def _build_slice(leaf: LeafPlan) -> Any:
        return _jit_leaf_reshard(leaf.gen_sharding, leaf.train_sharding)

    @staticmethod
    def _build_fill(leaf: LeafPlan) -> Any:
        """``fill(buffer, train_leaf, g)``: layer group ``g`` of every training stage gathered into ``buffer``."""
        length, rest = leaf.shape[0], leaf.shape[1:]
        p_train, p_gen = _shards_along(leaf.train_sharding, 0), _shards_along(leaf.gen_sharding, 0)
        local, c, b = length // p_train, leaf.layers_per_group, p_train // p_gen
        train_piece = NamedSharding(leaf.train_sharding.mesh, PartitionSpec(
            leaf.train_sharding.spec[0] if leaf.train_sharding.spec else None, None,
            *_spec_tail(leaf.train_sharding, len(leaf.shape))))
        gen_piece = NamedSharding(leaf.gen_sharding.mesh, PartitionSpec(
            leaf.gen_sharding.spec[0] if leaf.gen_sharding.spec else None, None, None,
            *_spec_tail(leaf.gen_sharding, len(leaf.shape))))

        def fill(buffer: jax.Array, train_leaf: jax.Array, group: jax.Array) -> jax.Array:
            start = group * c
            piece = jax.lax.dynamic_slice_in_dim(_as_bits(train_leaf).reshape(p_train, local, *rest), start, c, 1)
            piece = jax.lax.with_sharding_constraint(piece, train_piece).reshape(p_gen, b, c, *rest)
            # the all-gather inside the micro-DP group (and over dp for a dp-sharded layout); the barrier keeps
            # XLA from moving the bitcasts around it
            piece = jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(piece, gen_piece))
            # generation stage s holds training stages s·b + r: update their local layers one r at a time on a
            # 2-D view, which XLA's CPU backend keeps in place (a 3-D view with b > 1, or a bf16 update, it copies)
            view = _as_bits(buffer).reshape(p_gen, b * local, *rest)
            for r in range(b):
                view = jax.lax.dynamic_update_slice_in_dim(view, piece[:, r], r * local + start, 1)
            return _from_bits(view.reshape(leaf.shape), leaf.dtype)

        return jax.jit(fill, donate_argnums=(0,), out_shardings=leaf.gen_sharding)

    # ------------------------------------------------------------------------------------------ schedules
    def generation_steps(self) -> list[Step]:
        """The programs of ``to_generation`` in execution order, with the bytes held beside each."""
        held = {}  # device -> bytes of params alive: all training shards at the start
        for leaf in self.leaves:
            _add(held, leaf.train_bytes)
        steps = []
        for leaf in self.generation_order:
            src = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.train_sharding)
            if leaf.groups > 1:
                buf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.gen_sharding)
                steps.append(Step(f"{leaf.path} alloc", leaf, "alloc", 0, self._program("alloc", leaf), (),
                                  _max(held)))
                _add(held, leaf.train_bytes, -1)
                fill = self._program("fill", leaf)
                for g in range(leaf.groups):
                    steps.append(Step(f"{leaf.path} layers group {g}", leaf, "fill", g, fill,
                                      (buf, src, jax.ShapeDtypeStruct((), jnp.int32)), _max(held)))
            else:
                _add(held, leaf.train_bytes, -1)
                steps.append(Step(f"{leaf.path} whole", leaf, "whole", 0, self._program("whole", leaf), (src,),
                                  _max(held)))
            _add(held, leaf.gen_bytes)
        return steps

    def training_steps(self) -> list[Step]:
        """The programs of ``to_training`` in execution order, with the bytes held beside each."""
        held = {}
        for leaf in self.leaves:
            _add(held, leaf.gen_bytes)
        steps = []
        for leaf in self.training_order:
            _add(held, leaf.gen_bytes, -1)
            buf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.gen_sharding)
            steps.append(Step(f"{leaf.path} slice", leaf, "slice", 0, self._program("slice", leaf), (buf,),
                              _max(held)))
            _add(held, leaf.train_bytes)
        return steps

    # ------------------------------------------------------------------------------------------ execution
    def to_generation(self, train_params: Any, observer: Callable[[], None] | None = None) -> Any:
        """Generation-layout params; every training leaf is freed as soon as it has been gathered.
        ``observer()`` runs after each program, before the leaf it consumed is freed (peak measurements)."""
        leaves = self._flatten(train_params)
        out: list[Any] = [None] * len(leaves)
        for leaf in self.generation_order:
            src = leaves[leaf.index]
            if leaf.groups > 1:
                buf = self._program("alloc", leaf)()
                fill = self._program("fill", leaf)
                for g in range(leaf.groups):
                    buf = _call_donating(fill, buf, src, np.int32(g))
                    _observe(buf, observer)
            else:
                buf = _call_donating(self._program("whole", leaf), src)
                _observe(buf, observer)
            jax.block_until_ready(buf)
            _delete(src)
            out[leaf.index] = buf
        return jax.tree.unflatten(self.treedef, out)

    def to_training(self, gen_params: Any, observer: Callable[[], None] | None = None) -> Any:
        """Training-layout params sliced locally out of ``gen_params``; each generation leaf is freed once sliced."""
        leaves = self._flatten(gen_params)
        out: list[Any] = [None] * len(leaves)
        for leaf in self.training_order:
            src = leaves[leaf.index]
            part = _call_donating(self._program("slice", leaf), src)
            _observe(part, observer)
            jax.block_until_ready(part)
            _delete(src)
            out[leaf.index] = part
        return jax.tree.unflatten(self.treedef, out)

    def _flatten(self, tree: Any) -> list[Any]:
        leaves, treedef = jax.tree.flatten(tree)
        if treedef != self.treedef:
            raise ValueError(f"params tree {treedef} does not match the reshard's tree {self.treedef}")
        return leaves


def _jit_leaf_reshard(source: NamedSharding, target: NamedSharding) -> Any:
    def reshard(x: jax.Array) -> jax.Array:
        bits = jax.lax.with_sharding_constraint(_as_bits(x), source)
        bits = jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(bits, target))
        return _from_bits(bits, x.dtype)

    return jax.jit(reshard, in_shardings=source, out_shardings=target, donate_argnums=(0,))


def _add(total: dict[int, int], part: dict[int, int], sign: int = 1) -> None:
    for device, b in part.items():
        total[device] = total.get(device, 0) + sign * b


def _max(total: dict[int, int]) -> int:
    return max(total.values(), default=0)


def _observe(x: Any, observer: Callable[[], None] | None) -> None:
    if observer is not None:
        jax.block_until_ready(x)
        observer()


def _delete(x: Any) -> None:
    if isinstance(x, jax.Array) and not x.is_deleted():
        x.delete()
