"""`jax.sharding.Mesh` objects for the training and generation layouts over the same devices.

A jitted reshard between two meshes needs both to list their devices in the same flat order (JAX
rejects "incompatible devices" otherwise). The zero-redundancy generation grouping has exactly the
training order once the training axes are split as ``pp = (pp_g, r_p)`` and ``tp = (tp_g, r_t)``:
the training grid ``[p, t, d]`` reshaped to ``[p_g, b, t_g, a, d]`` *is* the generation grid with
``dg = (r_p, r_t)``. So the generation mesh is a reshape, never a permutation, of the training mesh;
only the position of the ``dg`` axis among the mesh axes depends on which strides are 1:

* ``b = 1`` or ``t_g = 1``: axes ``('pp_g', 'tp_g', 'dg', 'dp')``
* ``a = 1``:                axes ``('pp_g', 'dg', 'tp_g', 'dp')``
* otherwise (``a, b, t_g > 1``, e.g. 2-4-1 -> 1-2): ``dg`` is split in two mesh axes
  ``('pp_g', 'dg_pp', 'tp_g', 'dg_tp', 'dp')``; `HybridMeshes.dg_axes` lists what stands for ``dg``.

With sequence parallelism (``TrainParallel.sp > 1``) the training mesh is ``('pp','tp','dp','sp')``: the
same grid with its ``d`` axis split into ``[d/sp, sp]``, so its flat order, and with it every generation mesh
above (built from the unsplit grid, ``dp`` = the whole data-parallel world), is unchanged.

Meshes spanning several processes (multi-controller JAX) are built the same way from the global
device list ordered by `ordered_devices`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxrl_hf.mesh.topology import (GenParallel, TrainParallel, generation_rank_grid, train_mesh_rank_grid,
                                    train_rank_grid)

TRAIN_AXES = ("pp", "tp", "dp")
TRAIN_SP_AXES = ("pp", "tp", "dp", "sp")


def train_mesh_axes(train: TrainParallel) -> tuple[str, ...]:
    """Axis names of ``train``'s training mesh: `TRAIN_SP_AXES` with sequence parallelism, else `TRAIN_AXES`."""
    return TRAIN_SP_AXES if train.sp > 1 else TRAIN_AXES


def ordered_devices(devices: Sequence[jax.Device] | None = None) -> list[jax.Device]:
    """Devices in rank order: by process, then device id (rank r = position r in this list).

    With several processes, consecutive ranks then live in the same process, so the training
    replicas (and the micro-DP groups inside them) stay process-local where the sizes allow.
    """
    devices = list(jax.devices() if devices is None else devices)
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def _auto_mesh(device_grid: np.ndarray, axis_names: tuple[str, ...]) -> Mesh:
    return Mesh(device_grid, axis_names, axis_types=(AxisType.Auto,) * len(axis_names))


def _as_device_array(devices: Sequence[jax.Device], count: int) -> np.ndarray:
    if len(devices) != count:
        raise ValueError(f"layout needs {count} devices (p·t·d), got {len(devices)} devices")
    arr = np.empty(count, dtype=object)
    arr[:] = list(devices)
    return arr


def build_train_mesh(train: TrainParallel, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Training mesh, axes `train_mesh_axes` (``('pp','tp','dp')``, ``+ ('sp',)`` when ``train.sp > 1``);
    ``devices`` in rank order (default `ordered_devices`)."""
    devs = _as_device_array(ordered_devices(devices) if devices is None else list(devices), train.num_devices)
    return _auto_mesh(devs[train_mesh_rank_grid(train)], train_mesh_axes(train))


@dataclasses.dataclass(frozen=True)
class HybridMeshes:
    """Training and generation meshes of one actor over the same devices, same flat device order."""

    config: GenParallel
    train: Mesh
    generation: Mesh
    dg_axes: tuple[str, ...]

    def generation_axis_size(self, name: str) -> int:
        """Size of a logical generation axis (``'dg'`` may span several mesh axes)."""
        if name == "dg":
            return int(np.prod([self.generation.shape[a] for a in self.dg_axes]))
        return int(self.generation.shape[name])


def _generation_axes(gen: GenParallel) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """(mesh axis names, mesh shape, axes standing for dg) whose flat order equals the training order."""
    a, b, d = gen.tp_stride, gen.pp_stride, gen.dp
    if b == 1 or gen.tp == 1:
        return ("pp_g", "tp_g", "dg", "dp"), (gen.pp, gen.tp, gen.dg, d), ("dg",)
    if a == 1:
        return ("pp_g", "dg", "tp_g", "dp"), (gen.pp, gen.dg, gen.tp, d), ("dg",)
    return (("pp_g", "dg_pp", "tp_g", "dg_tp", "dp"), (gen.pp, b, gen.tp, a, d), ("dg_pp", "dg_tp"))


def build_hybrid_meshes(gen: GenParallel, devices: Sequence[jax.Device] | None = None) -> HybridMeshes:
    """Training mesh and zero-redundancy generation mesh (HybridFlow §2.5.3) over the same devices."""
    devs = _as_device_array(ordered_devices(devices) if devices is None else list(devices),
                            gen.train.num_devices)
    train_grid = devs[train_rank_grid(gen.train)]
    names, shape, dg_axes = _generation_axes(gen)
    generation = _auto_mesh(train_grid.reshape(shape), names)
    # The reshape must realise the paper's grouping exactly: check against the rank arithmetic.
    expected = devs[generation_rank_grid(gen)]
    got = np.asarray(generation.devices)
    if len(names) == 5:
        got = got.reshape(gen.pp, gen.pp_stride, gen.tp, gen.tp_stride, gen.dp)
        got = got.transpose(0, 2, 1, 3, 4).reshape(gen.pp, gen.tp, gen.dg, gen.dp)
    elif names[1] == "dg":
        got = got.transpose(0, 2, 1, 3)
    if not (got == expected).all():  # pragma: no cover - guards the derivation above
        raise AssertionError(f"generation mesh for {gen.train.label()}->{gen.label()} breaks the grouping")
    train = _auto_mesh(devs[train_mesh_rank_grid(gen.train)], train_mesh_axes(gen.train))
    return HybridMeshes(gen, train, generation, dg_axes)


def build_vanilla_generation_mesh(gen: GenParallel, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """HybridFlow-V generation mesh ``('pp_g','tp_g','dg','dp')``: the training grouping method reused."""
    devs = _as_device_array(ordered_devices(devices) if devices is None else list(devices),
                            gen.train.num_devices)
    return _auto_mesh(devs[generation_rank_grid(gen, vanilla=True)], ("pp_g", "tp_g", "dg", "dp"))


def flat_device_ids(mesh: Mesh) -> list[int]:
    """Device ids in the mesh's flat order: position k is XLA partition k of a program on this mesh."""
    return [int(d.id) for d in np.asarray(mesh.devices).flat]
