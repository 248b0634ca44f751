"""Where each process of a worker group sits on its role's mesh, at process granularity.

The controller splits data per *process* (one Ray actor = one JAX process). When a role's mesh spans
several processes, each process owns a box of the device grid; its coordinate along an axis is the
index of that box along the axis. `MeshCoords` folds the mesh axes into the three HybridFlow cares
about (§2.4, 3D_PROTO): data parallel (split the batch), tensor/model parallel (replicate the input,
collect from rank 0) and pipeline (replicate the input, collect from the last stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_DP_AXES = ("dp", "fsdp", "data")
DEFAULT_PP_AXES = ("pp",)


@dataclass(frozen=True)
class MeshCoords:
    """A process's position: dp/tp/pp rank and size at process granularity."""

    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        for axis in ("dp", "tp", "pp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"MeshCoords: {axis}_rank={rank} outside range({size})")

    @property
    def is_collect_rank(self) -> bool:
        """True for the process whose output represents its dp shard: tp rank 0, last pp stage."""
        return self.tp_rank == 0 and self.pp_rank == self.pp_size - 1

    def as_dict(self) -> dict[str, int]:
        """Plain dict form (``{'dp_rank', 'dp_size', 'tp_rank', 'tp_size', 'pp_rank', 'pp_size'}``)."""
        return asdict(self)


def _axis_block(indices: np.ndarray, axis_size: int, axis_name: str, process: int) -> tuple[int, int]:
    """(block index, number of blocks) of one process along one mesh axis."""
    low, high = int(indices.min()), int(indices.max())
    extent = high - low + 1
    if axis_size % extent or low % extent:
        raise ValueError(
            f"process {process} holds indices {low}..{high} of mesh axis {axis_name!r} (size "
            f"{axis_size}); processes must tile each axis in equal aligned blocks"
        )
    return low // extent, axis_size // extent


def coords_from_process_grid(
    process_grid: np.ndarray,
    axis_names: Sequence[str],
    process_index: int,
    dp_axes: Sequence[str] = DEFAULT_DP_AXES,
    pp_axes: Sequence[str] = DEFAULT_PP_AXES,
) -> MeshCoords:
    """Process-level mesh coordinates of ``process_index``.

    ``process_grid[i, j, ...]`` is the process owning mesh position ``(i, j, ...)``. The process's
    devices must form a box (a product of contiguous index ranges, one per axis). Axes named in
    ``dp_axes`` combine (row-major, in mesh order) into the dp coordinate, ``pp_axes`` into pp, and
    every other axis (tp, sp, expert, ...) into tp: the batch is replicated along them.
    """
    grid = np.asarray(process_grid)
    if grid.ndim != len(axis_names):
        raise ValueError(f"process grid has {grid.ndim} dims but {len(axis_names)} axis names {axis_names}")
    positions = np.argwhere(grid == process_index)
    if positions.size == 0:
        raise ValueError(f"process {process_index} owns no device of the mesh {dict(zip(axis_names, grid.shape))}")
    blocks = [
        _axis_block(positions[:, a], grid.shape[a], name, process_index) for a, name in enumerate(axis_names)
    ]
    extents = [grid.shape[a] // count for a, (_, count) in enumerate(blocks)]
    if len(positions) != int(np.prod(extents)):
        raise ValueError(
            f"process {process_index}'s devices do not form a box of the mesh "
            f"{dict(zip(axis_names, grid.shape))}"
        )

    def combine(axes: list[int]) -> tuple[int, int]:
        if not axes:
            return 0, 1
        index = [blocks[a][0] for a in axes]
        shape = [blocks[a][1] for a in axes]
        return int(np.ravel_multi_index(index, shape)), int(np.prod(shape))

    dp = [a for a, n in enumerate(axis_names) if n in dp_axes]
    pp = [a for a, n in enumerate(axis_names) if n in pp_axes]
    tp = [a for a in range(len(axis_names)) if a not in dp and a not in pp]
    (dp_rank, dp_size), (tp_rank, tp_size), (pp_rank, pp_size) = combine(dp), combine(tp), combine(pp)
    return MeshCoords(dp_rank, dp_size, tp_rank, tp_size, pp_rank, pp_size)


def coords_from_mesh(mesh, process_index: int | None = None, **axis_roles: Sequence[str]) -> MeshCoords:
    """`coords_from_process_grid` for a ``jax.sharding.Mesh`` (this process unless given)."""
    import jax

    grid = np.vectorize(lambda device: device.process_index, otypes=[int])(mesh.devices)
    index = jax.process_index() if process_index is None else process_index
    return coords_from_process_grid(grid, mesh.axis_names, index, **axis_roles)


@dataclass(frozen=True)
class GroupLayout:
    """The mesh coordinates of every rank of one worker group, as the driver sees them."""

    role: str
    pool: str
    coords: tuple[MeshCoords, ...]

    def __post_init__(self) -> None:
        sizes = {(c.dp_size, c.tp_size, c.pp_size) for c in self.coords}
        if len(sizes) > 1:
            detail = {r: (c.dp_size, c.tp_size, c.pp_size) for r, c in enumerate(self.coords)}
            raise ValueError(f"role {self.role!r}: ranks disagree on (dp, tp, pp) sizes: {detail}")
        seen: dict[tuple[int, int, int], int] = {}
        for rank, c in enumerate(self.coords):
            key = (c.dp_rank, c.tp_rank, c.pp_rank)
            if key in seen:
                raise ValueError(
                    f"role {self.role!r}: ranks {seen[key]} and {rank} both claim (dp, tp, pp) = {key}"
                )
            seen[key] = rank
        if self.coords:
            c = self.coords[0]
            if c.dp_size * c.tp_size * c.pp_size != len(self.coords):
                raise ValueError(
                    f"role {self.role!r}: dp*tp*pp = {c.dp_size}*{c.tp_size}*{c.pp_size} != "
                    f"{len(self.coords)} processes"
                )

    @classmethod
    def pure_dp(cls, role: str, pool: str, world_size: int) -> GroupLayout:
        """Every process is its own data-parallel rank (the default without a mesh)."""
        return cls(role, pool, tuple(MeshCoords(r, world_size) for r in range(world_size)))

    @property
    def world_size(self) -> int:
        """Number of processes in the group."""
        return len(self.coords)

    @property
    def dp_size(self) -> int:
        """Number of data-parallel shards at process granularity."""
        return self.coords[0].dp_size if self.coords else 0

    def collect_ranks(self) -> list[int]:
        """Ranks whose outputs make up the result, ordered by dp rank (tp 0, last pp stage)."""
        ranks = [r for r, c in enumerate(self.coords) if c.is_collect_rank]
        return sorted(ranks, key=lambda r: self.coords[r].dp_rank)
