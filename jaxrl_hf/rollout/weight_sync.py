"""JAX param tree -> stream of ``(hf_name, torch.Tensor)`` for an in-place weight load into vLLM.

The HF names and layouts come from ``jaxrl_hf.models.weights_hf.iter_hf_tensor_views`` (the same
mapping as the safetensors export, not a copy of it); this module only decides how each JAX leaf
becomes a torch tensor:

* a single-device ``jax.Array`` -> ``torch.from_dlpack`` (zero-copy: the tensor aliases the JAX buffer;
  on GPU it stays on the device);
* a fully replicated array on several devices -> DLPack of one replica (zero-copy);
* an array sharded over a mesh -> gathered to host first (``jax.device_get``: one copy of that leaf),
  then wrapped with ``torch.from_numpy`` (zero-copy of the gathered buffer). DLPack cannot describe a
  sharded array, so this copy is unavoidable on the JAX side; vLLM's loaders then slice what each of
  their tensor-parallel ranks needs (see ``vllm_engine``'s module docstring);
* a numpy array -> ``torch.from_numpy`` (zero-copy).

Per layer the HF tensors are views (``[i]``, ``reshape``, ``.T``) of those leaf tensors, so nothing is
materialised until vLLM's ``weight_loader`` copies (and fuses q/k/v and gate/up) into its own params.
The caller must keep ``params`` alive and unmodified until the load returns (the views alias it).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Iterator

import jax
import numpy as np

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.weights_hf import iter_hf_tensor_views


@dataclasses.dataclass
class SyncStats:
    """How the leaves reached torch: bytes aliased via DLPack / numpy vs bytes gathered (copied) to host."""

    leaves: int = 0
    bytes_total: int = 0
    bytes_zero_copy: int = 0
    bytes_gathered: int = 0
    gathered_leaves: int = 0

    def add(self, nbytes: int, gathered: bool) -> None:
        self.leaves += 1
        self.bytes_total += nbytes
        if gathered:
            self.bytes_gathered += nbytes
            self.gathered_leaves += 1
        else:
            self.bytes_zero_copy += nbytes


def _from_numpy(arr: np.ndarray) -> Any:
    import torch

    with warnings.catch_warnings():  # read-only numpy buffers: vLLM only reads them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.asarray(arr))


def leaf_to_torch(x: Any) -> tuple[Any, bool]:
    """``(torch tensor, gathered)`` for one param leaf; ``gathered`` is True when a host copy was made.

    Raises for an array that is not fully addressable from this process (a multi-host mesh): gather it
    on the JAX side first (``jax.experimental.multihost_utils.process_allgather``).
    """
    import torch

    if isinstance(x, np.ndarray) or not isinstance(x, jax.Array):
        return _from_numpy(np.asarray(x)), False
    if not x.is_fully_addressable:
        raise ValueError(f"weight sync: a param leaf of shape {x.shape} is not fully addressable from this process "
                         "(multi-host mesh); gather it first (process_allgather) or sync per host")
    source = None
    if len(x.sharding.device_set) == 1:
        source = x
    elif x.is_fully_replicated:
        source = x.addressable_shards[0].data
    if source is not None:
        try:
            return torch.from_dlpack(source), False
        except (RuntimeError, TypeError, BufferError):  # e.g. a layout DLPack cannot express
            pass
    return _from_numpy(np.asarray(jax.device_get(x))), True


def gather_multihost(params: Any) -> Any:
    """``params`` with every leaf not fully addressable from this process (a mesh over several JAX
    processes) all-gathered to a host numpy array (``process_allgather``, a collective: every process must
    call this at the same time, as they do around one SPMD training step). Other leaves are returned as is.

    This is the data-parallel vLLM layout (one engine per process, as verl's DP rollout replicas): each
    process's engine needs the full weights."""
    leaves = [x for x in jax.tree.leaves(params) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    if not leaves:
        return params
    from jax.experimental import multihost_utils

    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
                        if isinstance(x, jax.Array) and not x.is_fully_addressable else x, params)


def hf_weight_stream(params: Any, config: DecoderConfig) -> tuple[Iterator[tuple[str, Any]], SyncStats]:
    """``(iterator of (hf_name, torch view), stats)``; ``stats`` fills in as the iterator is consumed."""
    stats = SyncStats()

    def to_torch(leaf: Any) -> Any:
        tensor, gathered = leaf_to_torch(leaf)
        stats.add(int(tensor.numel()) * tensor.element_size(), gathered)
        return tensor

    return iter_hf_tensor_views(params, config, to_array=to_torch), stats
