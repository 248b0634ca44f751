"""JAX param tree -> stream of ``(hf_name, torch.Tensor)`` for an in-place weight load into vLLM.

The HF names and layouts come from ``jaxrl_hf.models.weights_hf.iter_hf_tensor_views`` (the same
mapping as the safetensors export, not a copy of it); this module turns each JAX leaf into a torch tensor
on vLLM's device along the path `jaxrl_hf.rollout.sync_plan.plan_transfer` picks (that module's table):

* on CPU (what runs here): a single-device or fully replicated ``jax.Array`` -> ``torch.from_dlpack``
  (zero-copy: the tensor aliases the JAX buffer); an array sharded over a mesh -> gathered to host first
  (``jax.device_get``: one copy of that leaf) and wrapped with ``torch.from_numpy``; a numpy array ->
  ``torch.from_numpy`` (zero-copy). DLPack cannot describe a sharded array, hence the gather;
* on a GPU: a leaf on vLLM's GPU -> ``torch.from_dlpack`` on the same device (no copy, no host round trip); a
  sharded leaf -> ``jax.device_put`` onto vLLM's device (an all-gather between the GPUs), then DLPack; a leaf
  on another GPU -> DLPack, then a GPU-to-GPU copy. **The GPU branch has not run on hardware** (no
  accelerator was available to this project); its decisions are tested, and its JAX-side gather is tested on
  CPU devices (``tests/test_weight_sync_paths.py``).

Per layer the HF tensors are views (``[i]``, ``reshape``, ``.T``) of those leaf tensors, so nothing is
materialised until vLLM's ``weight_loader`` copies (and fuses q/k/v and gate/up) into its own params.
The caller must keep ``params`` alive and unmodified until the load returns (the views alias it).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterator

import jax
import numpy as np

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.weights_hf import iter_hf_tensor_views
from jaxrl_hf.rollout.sync_plan import HOST, LeafPlacement, SyncStats, SyncTarget, TransferPlan, plan_transfer

__all__ = ["SyncStats", "describe_leaf", "gather_multihost", "gather_onto_device", "hf_weight_stream",
           "leaf_to_torch"]


def _from_numpy(arr: np.ndarray) -> Any:
    import torch

    with warnings.catch_warnings():  # read-only numpy buffers: vLLM only reads them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.asarray(arr))


def _hardware_id(device: Any) -> int:
    """The CUDA ordinal DLPack reports for a JAX device (its id on CPU)."""
    hw = getattr(device, "local_hardware_id", None)
    return int(device.id if hw is None else hw)


def describe_leaf(x: Any) -> LeafPlacement:
    """Where ``x``'s data is (`LeafPlacement`)."""
    if not isinstance(x, jax.Array):
        return LeafPlacement("host")
    devices = x.sharding.device_set
    memory = "host" if all(d.platform == "cpu" for d in devices) else "device"
    local = tuple(sorted(_hardware_id(d) for d in devices if d.process_index == jax.process_index()))
    if not x.is_fully_addressable:
        return LeafPlacement(memory, local, "shards", multi_process=True)
    pieces = "one" if len(devices) == 1 else ("replicas" if x.is_fully_replicated else "shards")
    return LeafPlacement(memory, local, pieces)


def _local_device(hardware_id: int) -> Any:
    for device in jax.local_devices():
        if _hardware_id(device) == hardware_id:
            return device
    raise ValueError(f"weight sync: no local JAX device with hardware id {hardware_id}; local devices: "
                     f"{[str(d) for d in jax.local_devices()]}")


def gather_onto_device(x: jax.Array, hardware_id: int) -> jax.Array:
    """``x`` (sharded over this process's devices) joined into one buffer on the device ``hardware_id``, by
    ``jax.device_put`` (on GPUs a device-to-device gather, no host round trip)."""
    return jax.device_put(x, _local_device(hardware_id))


def _replica_on(x: jax.Array, hardware_id: int | None) -> jax.Array:
    if len(x.sharding.device_set) == 1:
        return x
    for shard in x.addressable_shards:
        if hardware_id is None or _hardware_id(shard.device) == hardware_id:
            return shard.data
    return x.addressable_shards[0].data


def leaf_to_torch(x: Any, target: SyncTarget = HOST) -> tuple[Any, TransferPlan]:
    """``(torch tensor on the target, the plan followed)`` for one param leaf.

    Raises for an array that is not fully addressable from this process (a multi-host mesh): gather it
    first (`gather_multihost`, a collective)."""
    import torch

    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ValueError(f"weight sync: a param leaf of shape {x.shape} is not fully addressable from this process "
                         "(multi-host mesh); gather it first (gather_multihost) or sync per host")
    plan = plan_transfer(describe_leaf(x), target)
    if plan.path == "host_view":
        if not isinstance(x, jax.Array):
            return _from_numpy(np.asarray(x)), plan
        try:
            return torch.from_dlpack(_replica_on(x, None)), plan
        except (RuntimeError, TypeError, BufferError):  # e.g. a layout DLPack cannot express: copy instead
            return _from_numpy(np.asarray(jax.device_get(x))), TransferPlan("host_gather", ("DLPack refused: copy",))
    if plan.path in ("host_gather", "device_to_host"):
        return _from_numpy(np.asarray(jax.device_get(x))), plan
    if plan.path == "host_to_device":
        host = x if not isinstance(x, jax.Array) else jax.device_get(x)
        return _from_numpy(np.asarray(host)).to(target.torch_device), plan
    # device paths (not run on hardware here; see the module docstring)
    source = gather_onto_device(x, plan.gather_onto) if plan.path == "device_gather" else \
        _replica_on(x, plan.source_device)
    tensor = torch.from_dlpack(source)
    if plan.source_device != target.device:
        tensor = tensor.to(target.torch_device)
    return tensor, plan


def _identity(x: Any) -> Any:
    """A module-level function, so the all-gather programs compiled per leaf shape are cached across syncs."""
    return x


def gather_multihost(params: Any, target: SyncTarget = HOST) -> Any:
    """``params`` with every leaf not fully addressable from this process (a mesh over several JAX
    processes) gathered whole into this process (a collective: every process must call this at the same
    time, as they do around one SPMD training step). Other leaves are returned as is.

    Host target: ``process_allgather`` to a numpy array. Device target: replicated over the leaf's mesh
    (an all-gather between the GPUs, no host round trip; not run on hardware here), so this process holds a
    full copy on each of its devices. This is the data-parallel vLLM layout (one engine per process, as verl's
    DP rollout replicas): each process's engine needs the full weights."""
    leaves = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    if not leaves:
        return params
    if target.memory == "device":
        from jax.sharding import NamedSharding, PartitionSpec

        def replicate(x: Any) -> Any:
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                full = jax.jit(_identity, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))(x)
                return _replica_on(full, target.device)  # this process's copy on vLLM's device
            return x

        return jax.tree.map(replicate, params)
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
                        if isinstance(x, jax.Array) and not x.is_fully_addressable else x, params)


def hf_weight_stream(params: Any, config: DecoderConfig,
                     target: SyncTarget = HOST) -> tuple[Iterator[tuple[str, Any]], SyncStats]:
    """``(iterator of (hf_name, torch view on the target), stats)``; ``stats`` fills in as the iterator is
    consumed (bytes by path, zero-copy vs copied)."""
    stats = SyncStats()

    def to_torch(leaf: Any) -> Any:
        tensor, plan = leaf_to_torch(leaf, target)
        stats.add(int(tensor.numel()) * tensor.element_size(), plan)
        return tensor

    return iter_hf_tensor_views(params, config, to_array=to_torch), stats
