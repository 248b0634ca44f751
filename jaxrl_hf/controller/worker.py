"""`Worker`: base class of a role's code running in one process of a multi-controller JAX program.

Subclass it, write ``__init__(self, ...)`` with the role's own arguments and decorate the methods the
driver calls with `register`. Before ``__init__`` runs, the process has already joined its pool's JAX
program (``jax.distributed.initialize``), so ``__init__`` can build the role's mesh over
``jax.devices()``; ``self.rank``, ``self.world_size``, ``self.role`` and ``self.pool_name`` are set.

The data protocols need each process's place on the role's mesh (`mesh_coords`). By default it is
derived from ``self.mesh`` when the worker set one (`build_mesh` does), else pure data parallelism
over processes. Workers with a custom layout override `mesh_coords`. A DP method turns its rows into
a global array with ``jax.make_array_from_process_local_data`` and hands results back with
`process_local_rows`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxrl_hf.controller.layout import MeshCoords, coords_from_mesh

if TYPE_CHECKING:
    from jax.sharding import Mesh


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker instance runs: its role, pool and process rank."""

    role: str
    pool_name: str
    rank: int
    world_size: int


class Worker:
    """Base class of role workers; see the module docstring."""

    _context: WorkerContext
    mesh: Mesh | None = None

    @classmethod
    def _instantiate(cls, context: WorkerContext, args: tuple, kwargs: dict[str, Any]) -> Worker:
        """Create an instance with its context set before the subclass ``__init__`` runs."""
        worker = cls.__new__(cls)
        worker._context = context
        worker.__init__(*args, **kwargs)
        return worker

    @property
    def rank(self) -> int:
        """This process's rank in the pool (= ``jax.process_index()`` of the pool's program)."""
        return self._context.rank

    @property
    def world_size(self) -> int:
        """Number of processes in the pool (= ``jax.process_count()``)."""
        return self._context.world_size

    @property
    def role(self) -> str:
        """The role name this instance serves."""
        return self._context.role

    @property
    def pool_name(self) -> str:
        """Name of the resource pool hosting this process."""
        return self._context.pool_name

    def build_mesh(self, axes: Mapping[str, int], devices: Any = None) -> Mesh:
        """Set and return ``self.mesh``: a named GSPMD mesh over all processes' devices.

        ``axes`` maps axis name to size in mesh order (product = device count); ``devices`` is an
        optional device list or array giving the order (default ``jax.devices()``).
        """
        import jax
        from jax.sharding import Mesh

        names, shape = tuple(axes), tuple(int(s) for s in axes.values())
        grid = np.asarray(jax.devices() if devices is None else devices, dtype=object)
        if grid.size != int(np.prod(shape)):
            raise ValueError(
                f"role {self.role!r}: mesh {dict(axes)} needs {int(np.prod(shape))} devices, "
                f"the program has {grid.size}"
            )
        self.mesh = Mesh(grid.reshape(shape), names)
        return self.mesh

    def mesh_coords(self) -> MeshCoords:
        """This process's (dp, tp, pp) coordinates at process granularity, used by `MESH_DP`."""
        if self.mesh is not None:
            return coords_from_mesh(self.mesh)
        return MeshCoords(dp_rank=self.rank, dp_size=self.world_size)


def process_local_rows(array: Any) -> np.ndarray:
    """This process's rows of a global ``jax.Array`` sharded along axis 0 (replicas dropped).

    The inverse of ``jax.make_array_from_process_local_data`` for a row-sharded array: what a DP
    method returns to the controller.
    """
    if array.ndim == 0:
        raise ValueError("process_local_rows needs an array with a leading (row) axis, got a scalar")
    pieces: dict[int, np.ndarray] = {}
    for shard in array.addressable_shards:
        pieces.setdefault(shard.index[0].start or 0, np.asarray(shard.data))
    return np.concatenate([pieces[k] for k in sorted(pieces)], axis=0)
