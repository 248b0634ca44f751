"""Rank layouts of the training and generation parallel groups (HybridFlow §2.5.1, §2.5.3).

The actor trains with ``p-t-d`` (pipeline, tensor, data) parallel groups and generates with
``p_g-t_g-d_g-d`` on the same ``N = p·t·d`` devices, ``d_g = p·t / (p_g·t_g)``.

Training ranks follow the usual 3D layout: a training replica (one PP×TP model-parallel group) is
``p·t`` consecutive ranks, tensor rank fastest; data-parallel groups are strided by ``p·t``::

    rank = dp·(p·t) + pp·t + tp

Generation ranks follow the paper's zero-redundancy grouping (§2.5.3): within a training replica,
generation TP groups take ranks at stride ``a = t/t_g`` and generation PP groups at stride
``b = p/p_g``; the micro-DP index runs over the remainders, consecutively along the TP dimension::

    pp = pp_g·b + r_p,   tp = tp_g·a + r_t,   dg = r_p·a + r_t

so a device's generation shard (layer block ``pp_g`` of ``p_g``, tensor slice ``tp_g`` of ``t_g``)
contains its training shard (layer block ``pp`` of ``p``, tensor slice ``tp`` of ``t``).

The "vanilla" grouping (HybridFlow-V, §2.5.3 Fig. 8a) uses the training method for generation too:
consecutive generation TP/PP ranks, micro-DP strided by ``p_g·t_g`` within the replica.

Sequence parallelism (Ulysses, verl's ``ulysses_sequence_parallel_size``) takes its groups out of the
data-parallel world: ``sp`` consecutive data-parallel ranks ``dp = dp_group·sp + sp_rank`` hold the same rows,
each its ``1/sp`` of the sequence. The rank formula above is unchanged (``dp`` still counts the whole
data-parallel world), so the generation grouping is too; only the training mesh splits its ``dp`` axis in two.

Everything here is pure integer arithmetic over rank indices; `mesh.device_mesh` turns the grids
into `jax.sharding.Mesh` objects.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np


@dataclasses.dataclass(frozen=True)
class TrainParallel:
    """Training parallel sizes ``p-t-d`` (pipeline stages, tensor shards, data-parallel ranks).

    ``sp``: sequence-parallel group size (module docstring); it divides ``dp``, and the ``dp/sp`` groups
    (`dp_groups`) are what the rows are split over.
    """

    pp: int
    tp: int
    dp: int
    sp: int = 1

    def __post_init__(self) -> None:
        for name in ("pp", "tp", "dp", "sp"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TrainParallel.{name} must be a positive integer, got {value!r}")
        if self.dp % self.sp:
            raise ValueError(f"TrainParallel.sp={self.sp} must divide dp={self.dp}: sequence-parallel groups are "
                             f"taken out of the data-parallel ranks")

    @property
    def num_devices(self) -> int:
        return self.pp * self.tp * self.dp

    @property
    def model_parallel(self) -> int:
        """Devices per training replica, ``p·t``."""
        return self.pp * self.tp

    @property
    def dp_groups(self) -> int:
        """Sequence-parallel groups in the data-parallel world, ``d/sp``: the rows are split this many ways."""
        return self.dp // self.sp

    def label(self) -> str:
        return f"{self.pp}-{self.tp}-{self.dp}" + (f"(sp{self.sp})" if self.sp > 1 else "")


@dataclasses.dataclass(frozen=True)
class GenParallel:
    """Generation parallel sizes ``p_g-t_g`` for a given training layout; ``d_g`` is derived.

    Raises ``ValueError`` naming the violated condition when ``p_g`` does not divide ``p`` or
    ``t_g`` does not divide ``t`` (the paper's grouping needs integral strides ``p/p_g``, ``t/t_g``).
    """

    train: TrainParallel
    pp: int
    tp: int

    def __post_init__(self) -> None:
        for name in ("pp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GenParallel.{name} must be a positive integer, got {value!r}")
        if self.train.pp % self.pp:
            raise ValueError(
                f"generation pp_g={self.pp} must divide training pp={self.train.pp}: generation "
                f"pipeline groups take training stages at stride p/p_g, which must be an integer")
        if self.train.tp % self.tp:
            raise ValueError(
                f"generation tp_g={self.tp} must divide training tp={self.train.tp}: generation "
                f"tensor groups take training ranks at stride t/t_g, which must be an integer")

    @property
    def tp_stride(self) -> int:
        """``a = t / t_g``: stride between members of a generation TP group."""
        return self.train.tp // self.tp

    @property
    def pp_stride(self) -> int:
        """``b = p / p_g``: stride (in stages) between members of a generation PP group."""
        return self.train.pp // self.pp

    @property
    def dg(self) -> int:
        """Micro-DP size ``d_g = p·t / (p_g·t_g)``."""
        return self.tp_stride * self.pp_stride

    @property
    def dp(self) -> int:
        return self.train.dp

    def label(self) -> str:
        return f"{self.pp}-{self.tp}-{self.dg}-{self.dp}"


def parse_config(label: str) -> GenParallel:
    """Parse ``"p-t-d->pg-tg"`` (the benchmark's config key) into a validated `GenParallel`."""
    try:
        train_part, gen_part = label.split("->")
        p, t, d = (int(x) for x in train_part.split("-"))
        pg, tg = (int(x) for x in gen_part.split("-"))
    except ValueError as err:
        raise ValueError(f"config {label!r} is not of the form 'p-t-d->pg-tg' (e.g. '1-4-2->1-2')") from err
    return GenParallel(TrainParallel(p, t, d), pg, tg)


def train_coords(rank: int, train: TrainParallel) -> tuple[int, int, int]:
    """``(pp, tp, dp)`` of a training rank: TP/PP consecutive, DP strided by ``p·t``."""
    mp = train.model_parallel
    dp, within = divmod(rank, mp)
    pp, tp = divmod(within, train.tp)
    return pp, tp, dp


def generation_coords(rank: int, gen: GenParallel) -> tuple[int, int, int, int]:
    """``(pp_g, tp_g, dg, dp)`` of a rank under the zero-redundancy grouping (§2.5.3, Fig. 8b)."""
    pp, tp, dp = train_coords(rank, gen.train)
    a, b = gen.tp_stride, gen.pp_stride
    pg, rp = divmod(pp, b)
    tg, rt = divmod(tp, a)
    return pg, tg, rp * a + rt, dp


def vanilla_generation_coords(rank: int, gen: GenParallel) -> tuple[int, int, int, int]:
    """``(pp_g, tp_g, dg, dp)`` under the training grouping method reused (HybridFlow-V, Fig. 8a).

    Within a training replica the generation TP ranks are consecutive, then generation PP, then
    micro-DP: ``within = dg·(p_g·t_g) + pp_g·t_g + tp_g``.
    """
    mp = gen.train.model_parallel
    dp, within = divmod(rank, mp)
    dg, rest = divmod(within, gen.pp * gen.tp)
    pg, tg = divmod(rest, gen.tp)
    return pg, tg, dg, dp


def train_rank_grid(train: TrainParallel) -> np.ndarray:
    """Integer array ``[p, t, d]`` of ranks (mesh axes ``('pp','tp','dp')``)."""
    grid = np.empty((train.pp, train.tp, train.dp), dtype=np.int64)
    for rank in range(train.num_devices):
        grid[train_coords(rank, train)] = rank
    return grid


def train_mesh_rank_grid(train: TrainParallel) -> np.ndarray:
    """The ranks of the training mesh: `train_rank_grid`, with ``sp > 1`` its ``d`` axis split into
    ``[d/sp, sp]`` (mesh axes ``('pp','tp','dp','sp')``, sp minor-most: same flat order)."""
    grid = train_rank_grid(train)
    return grid.reshape(train.pp, train.tp, train.dp_groups, train.sp) if train.sp > 1 else grid


def generation_rank_grid(gen: GenParallel, vanilla: bool = False) -> np.ndarray:
    """Integer array ``[p_g, t_g, d_g, d]`` of ranks (logical axes ``('pp_g','tp_g','dg','dp')``)."""
    coords = vanilla_generation_coords if vanilla else generation_coords
    grid = np.empty((gen.pp, gen.tp, gen.dg, gen.dp), dtype=np.int64)
    for rank in range(gen.train.num_devices):
        grid[coords(rank, gen)] = rank
    return grid


def _groups_along(grid: np.ndarray, axes: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Rank groups that vary along ``axes`` of ``grid`` with the other axes fixed, sorted."""
    other = [i for i in range(grid.ndim) if i not in axes]
    moved = np.transpose(grid, other + list(axes)).reshape(-1, int(np.prod([grid.shape[i] for i in axes])))
    return sorted(tuple(sorted(int(r) for r in row)) for row in moved)


def micro_dp_groups(gen: GenParallel) -> list[tuple[int, ...]]:
    """The ``N/d_g`` micro-DP groups (ranks sharing ``pp_g, tp_g, dp``): the HybridFlow all-gather groups."""
    return _groups_along(generation_rank_grid(gen), (2,))


def generation_tp_groups(gen: GenParallel, vanilla: bool = False) -> list[tuple[int, ...]]:
    """Generation tensor-parallel groups (ranks sharing ``pp_g, dg, dp``)."""
    return _groups_along(generation_rank_grid(gen, vanilla), (1,))


def training_model_parallel_groups(train: TrainParallel) -> list[tuple[int, ...]]:
    """Training replicas (PP×TP groups, ``p·t`` consecutive ranks): the HybridFlow-V all-gather groups."""
    return _groups_along(train_rank_grid(train), (0, 1))


def training_tp_groups(train: TrainParallel) -> list[tuple[int, ...]]:
    """Training tensor-parallel groups (``t`` consecutive ranks)."""
    return _groups_along(train_rank_grid(train), (1,))


def training_dp_groups(train: TrainParallel) -> list[tuple[int, ...]]:
    """Training data-parallel groups (stride ``p·t``)."""
    return _groups_along(train_rank_grid(train), (2,))


def training_sp_groups(train: TrainParallel) -> list[tuple[int, ...]]:
    """Sequence-parallel groups: ``sp`` consecutive data-parallel ranks (stride ``p·t`` in rank), sharing rows."""
    if train.sp == 1:
        return [(r,) for r in range(train.num_devices)]
    return _groups_along(train_mesh_rank_grid(train), (3,))


def all_configs(num_devices: int) -> list[GenParallel]:
    """Every valid ``(p,t,d) -> (p_g,t_g)`` on ``num_devices`` devices (for exhaustive tests)."""
    out = []
    divisors = [k for k in range(1, num_devices + 1) if num_devices % k == 0]
    for p, t in itertools.product(divisors, divisors):
        if num_devices % (p * t):
            continue
        train = TrainParallel(p, t, num_devices // (p * t))
        for pg in (k for k in divisors if p % k == 0):
            for tg in (k for k in divisors if t % k == 0):
                out.append(GenParallel(train, pg, tg))
    return out
