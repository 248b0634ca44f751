"""Parallel strategies of one model on A devices: (p, t, d) for training/inference and, for a model
that also generates, the generation layout (p_g, t_g) of the 3D-HybridEngine (HybridFlow §2.5:
p_g | p, t_g | t, d_g = p·t / (p_g·t_g) micro-DP replicas per training replica).
"""
from __future__ import annotations

import dataclasses

from jaxrl_hf.placement.dataflow import ModelArch


@dataclasses.dataclass(frozen=True)
class ParallelStrategy:
    """Pipeline p × tensor t × data d = devices; optional generation layout (p_g, t_g)."""

    p: int
    t: int
    d: int
    p_g: int | None = None
    t_g: int | None = None

    def __post_init__(self) -> None:
        if min(self.p, self.t, self.d) < 1:
            raise ValueError(f"parallel sizes must be >= 1, got p={self.p} t={self.t} d={self.d}")
        if (self.p_g is None) != (self.t_g is None):
            raise ValueError("p_g and t_g must be given together")
        if self.p_g is not None:
            if self.p % self.p_g or self.t % self.t_g:
                raise ValueError(f"generation layout needs p_g | p and t_g | t, got p={self.p} p_g={self.p_g} "
                                 f"t={self.t} t_g={self.t_g}")

    @property
    def devices(self) -> int:
        return self.p * self.t * self.d

    @property
    def model_parallel(self) -> int:
        return self.p * self.t

    @property
    def gen_model_parallel(self) -> int:
        if self.p_g is None:
            raise ValueError("strategy has no generation layout")
        return self.p_g * self.t_g

    @property
    def micro_dp(self) -> int:
        """d_g = p·t / (p_g·t_g)."""
        return self.model_parallel // self.gen_model_parallel

    @property
    def gen_replicas(self) -> int:
        """Generation data-parallel replicas on all A devices: A / (p_g·t_g)."""
        return self.devices // self.gen_model_parallel

    def label(self) -> str:
        base = f"p{self.p}-t{self.t}-d{self.d}"
        return base if self.p_g is None else f"{base} gen(p{self.p_g}-t{self.t_g})"

    def to_dict(self) -> dict:
        out = {"pp": self.p, "tp": self.t, "dp": self.d}
        if self.p_g is not None:
            out.update(gen_pp=self.p_g, gen_tp=self.t_g, gen_micro_dp=self.micro_dp)
        return out


def _powers_of_two_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def tensor_sizes(arch: ModelArch, devices: int, devices_per_node: int) -> list[int]:
    """Valid TP sizes: powers of two dividing the head count and the device count, inside a node."""
    return [t for t in _powers_of_two_upto(min(devices, devices_per_node))
            if devices % t == 0 and arch.num_heads % t == 0]


def pipeline_sizes(arch: ModelArch, devices: int) -> list[int]:
    """Valid PP sizes: powers of two dividing both the layer count and the device count."""
    return [p for p in _powers_of_two_upto(min(devices, arch.num_layers))
            if devices % p == 0 and arch.num_layers % p == 0]


def enumerate_strategies(arch: ModelArch, devices: int, devices_per_node: int) -> list[ParallelStrategy]:
    """All (p, t, d) with p·t·d = devices (p, t powers of two; d any integer)."""
    out = []
    for t in tensor_sizes(arch, devices, devices_per_node):
        for p in pipeline_sizes(arch, devices // t):
            out.append(ParallelStrategy(p, t, devices // (p * t)))
    return out


def generation_layouts(strategy: ParallelStrategy) -> list[tuple[int, int]]:
    """All (p_g, t_g) with p_g | p and t_g | t (powers of two, as p and t are)."""
    return [(pg, tg) for pg in _powers_of_two_upto(strategy.p) for tg in _powers_of_two_upto(strategy.t)
            if strategy.p % pg == 0 and strategy.t % tg == 0]
