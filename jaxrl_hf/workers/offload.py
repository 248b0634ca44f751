"""Optimizer-state offload to host memory between updates (verl's ``actor.fsdp_config.optimizer_offload``).

Adam keeps two moments per parameter, so the optimizer state is twice the (float32) parameter memory and
is needed only inside ``update_actor``. With ``actor.offload_optimizer`` the actor moves it to host memory
after each update (device buffers freed) and back, with the same shardings, before the next update or a
checkpoint save/load.

Two mechanisms, picked by `default_mode`:

* ``"memory_kind"`` (used when every device addresses a host memory space, as the CPU, GPU and TPU
  backends of this JAX do: ``pinned_host`` / ``unpinned_host``): ``jax.device_put`` onto the same
  ``NamedSharding`` with ``memory_kind='pinned_host'``. The copy keeps its layout (each shard in the host
  memory attached to its device), works unchanged with several processes, and the way back is one
  ``device_put`` per leaf (a DMA on accelerators). On the CPU backend host and device memory are the same
  RAM, so this frees nothing physical there; the buffers the device memory space accounts for are freed
  all the same, which is what the tests check.
* ``"numpy"`` (fallback for a backend without host memory kinds): each distinct addressable shard is
  copied to a numpy array (replicas stored once) and the device arrays are deleted; the way back places
  the shards on their devices and reassembles the global arrays with
  ``jax.make_array_from_single_device_arrays``.

Both are exact copies: an update after a round trip is bit-identical to one without offload.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from jaxrl_hf.mesh import delete_tree

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")
MODES = ("memory_kind", "numpy")


def host_memory_kind(devices: Sequence[jax.Device] | None = None) -> str | None:
    """The first of `HOST_MEMORY_KINDS` that every device addresses, or ``None``."""
    devices = list(jax.devices() if devices is None else devices)
    for kind in HOST_MEMORY_KINDS:
        try:
            if all(kind in {m.kind for m in d.addressable_memories()} for d in devices):
                return kind
        except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):  # pragma: no cover - old backends
            return None
    return None


def default_mode(devices: Sequence[jax.Device] | None = None) -> str:
    """``"memory_kind"`` when the devices have a host memory space, else ``"numpy"``."""
    return "memory_kind" if host_memory_kind(devices) else "numpy"


def array_device_bytes(x: jax.Array) -> int:
    """Bytes of ``x`` in this process's device memory (every addressable shard, replicas counted; 0 when
    deleted or in host memory). Computed from the sharding: reading ``addressable_shards`` would create
    per-shard arrays that then show up in ``jax.live_arrays()`` themselves."""
    if x.is_deleted() or _memory_kind(x) in HOST_MEMORY_KINDS:
        return 0
    shard = x.sharding.shard_shape(x.shape)
    return int(np.prod(shard, dtype=np.int64)) * x.dtype.itemsize * len(x.sharding.addressable_devices)


def device_bytes(tree: Any) -> int:
    """Bytes the arrays of ``tree`` occupy in this process's device memory (`array_device_bytes` summed)."""
    return sum(array_device_bytes(x) for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def _memory_kind(x: jax.Array) -> str | None:
    return getattr(x.sharding, "memory_kind", None)


@dataclasses.dataclass
class _NumpyLeaf:
    """One array's distinct shards on the host, and which device holds which."""

    shape: tuple[int, ...]
    sharding: jax.sharding.Sharding
    placement: list[tuple[jax.Device, tuple]]     # (device, index key) per addressable shard
    blocks: dict[tuple, np.ndarray]              # index key -> host data


def _index_key(index: tuple) -> tuple:
    return tuple((s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index)


def _to_numpy_leaf(x: jax.Array) -> _NumpyLeaf:
    blocks: dict[tuple, np.ndarray] = {}
    placement = []
    for shard in x.addressable_shards:
        key = _index_key(shard.index)
        if key not in blocks:
            blocks[key] = np.array(shard.data, copy=True)
        placement.append((shard.device, key))
    return _NumpyLeaf(tuple(x.shape), x.sharding, placement, blocks)


def _from_numpy_leaf(leaf: _NumpyLeaf) -> jax.Array:
    arrays = [jax.device_put(leaf.blocks[key], device) for device, key in leaf.placement]
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays)


@dataclasses.dataclass
class HostTree:
    """A pytree moved off the devices: ``data`` (host arrays or `_NumpyLeaf`s) + the device shardings."""

    mode: str
    data: Any
    shardings: Any
    nbytes: int


def offload_tree(tree: Any, mode: str) -> HostTree:
    """Copy ``tree`` to host memory and free its device buffers (the arrays of ``tree`` are deleted)."""
    if mode not in MODES:
        raise ValueError(f"offload mode {mode!r}; valid: {list(MODES)}")
    shardings = jax.tree.map(lambda x: x.sharding, tree)
    nbytes = device_bytes(tree)
    if mode == "memory_kind":
        kind = host_memory_kind()
        if kind is None:
            raise ValueError("offload mode 'memory_kind': these devices have no host memory space; use 'numpy'")
        data = jax.device_put(tree, jax.tree.map(lambda s: s.with_memory_kind(kind), shardings))
        jax.block_until_ready(data)
    else:
        data = jax.tree.map(_to_numpy_leaf, tree)
    delete_tree(tree)
    return HostTree(mode, data, shardings, nbytes)


def reload_tree(host: HostTree) -> Any:
    """Put a `HostTree` back on its devices with its original shardings; the host copy is released."""
    if host.mode == "memory_kind":
        tree = jax.device_put(host.data, host.shardings)
        jax.block_until_ready(tree)
        delete_tree(host.data)
    else:
        tree = jax.tree.map(_from_numpy_leaf, host.data, is_leaf=lambda x: isinstance(x, _NumpyLeaf))
        jax.block_until_ready(tree)
    host.data = None
    return tree


class OptimizerOffload:
    """Holds a `TrainState`'s optimizer state on the host between updates.

    ``offload(state)`` returns the state with ``opt_state=None`` (so any use of it while offloaded fails
    loudly) and keeps the host copy; ``restore(state)`` puts it back. ``freed_bytes`` is the device memory
    (this process, all devices) the last offload released.
    """

    def __init__(self, mode: str | None = None):
        self.mode = mode or default_mode()
        if self.mode not in MODES:
            raise ValueError(f"offload mode {self.mode!r}; valid: {list(MODES)}")
        self.host: HostTree | None = None
        self.freed_bytes = 0

    @property
    def offloaded(self) -> bool:
        return self.host is not None

    def offload(self, state: Any) -> Any:
        """``state`` with its ``opt_state`` moved to host memory (no-op when already offloaded)."""
        if self.host is not None:
            return state
        self.host = offload_tree(state.opt_state, self.mode)
        self.freed_bytes = self.host.nbytes
        return state._replace(opt_state=None)

    def restore(self, state: Any) -> Any:
        """``state`` with its ``opt_state`` back on the devices (no-op when not offloaded)."""
        if self.host is None:
            return state
        opt_state = reload_tree(self.host)
        self.host = None
        return state._replace(opt_state=opt_state)
