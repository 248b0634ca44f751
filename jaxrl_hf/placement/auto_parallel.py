"""auto_parallel (HybridFlow Algorithm 1): the fastest parallel strategy of each model of a colocated
set on A devices, under the set's shared memory.

Per (model, A) the candidate strategies are simulated once and cached (the paper's cache).  Only the
Pareto front over (resident bytes, latency with the device to itself) is kept, since a strategy that
needs more memory *and* is slower can never be chosen.  A colocated set then picks one front member
per model so that Σ resident bytes + each model's own transient fits one device, minimising the sum
of its models' latencies; generation layouts (p_g, t_g) are chosen last, with the KV-cache budget
actually left over.  Set results are cached per (set, A).
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from jaxrl_hf.placement.cluster import Cluster
from jaxrl_hf.placement.dataflow import Dataflow, ModelSpec, Workload
from jaxrl_hf.placement.memory import (SimOptions, generation_weight_extra_bytes, infer_transient_bytes,
                                       persistent_bytes, train_transient_bytes)
from jaxrl_hf.placement.simulators import OpCost, reshard_for_generation_s, simulate_op
from jaxrl_hf.placement.strategy import ParallelStrategy, enumerate_strategies, generation_layouts


@dataclasses.dataclass(frozen=True)
class ModelOption:
    """A (p, t, d) of one model: its resident bytes, fixed-cost ops and train/infer transient."""

    strategy: ParallelStrategy
    persistent: float
    transient: float
    fixed: tuple[tuple[str, OpCost], ...]  # (stage, cost) of train/infer ops
    ample_latency: float


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """The chosen strategy of one model and its predicted per-stage latency."""

    model: str
    strategy: ParallelStrategy
    stage_latency: dict[str, float]
    stage_work: dict[str, tuple[float, float]]  # stage -> (flops, bytes) for host contention
    persistent_bytes: float
    peak_bytes: float

    @property
    def latency(self) -> float:
        return sum(self.stage_latency.values())


@dataclasses.dataclass(frozen=True)
class SetPlan:
    """One colocated set on `devices` devices with a plan per model."""

    models: tuple[str, ...]
    devices: int
    plans: tuple[ModelPlan, ...]

    def stage_latency(self, stage: str) -> float:
        """Colocated models run one after another: their latencies in a stage add up."""
        return sum(p.stage_latency.get(stage, 0.0) for p in self.plans)

    def stage_work(self, stage: str) -> tuple[float, float]:
        w = [p.stage_work.get(stage, (0.0, 0.0)) for p in self.plans]
        return sum(x[0] for x in w), sum(x[1] for x in w)


class StrategyCache:
    """Per (model, A) strategy fronts and per (set, A) set plans for one dataflow and cluster."""

    def __init__(self, dataflow: Dataflow, cluster: Cluster, opts: SimOptions):
        self.dataflow, self.cluster, self.opts = dataflow, cluster, opts
        self._fronts: dict[tuple[str, int], list[ModelOption]] = {}
        self._sets: dict[tuple[tuple[str, ...], int], SetPlan | None] = {}
        self.model_hits = self.model_misses = self.set_hits = self.set_misses = 0

    # ---- per model ----------------------------------------------------------------------------
    def _ops(self, name: str) -> tuple[tuple[str, Workload], ...]:
        return self.dataflow.ops_of(name)

    def _generates(self, name: str) -> bool:
        return any(wl.kind == "generate" for _, wl in self._ops(name))

    def front(self, name: str, devices: int) -> list[ModelOption]:
        """Pareto front of (p, t, d) strategies of `name` on `devices` devices (cached)."""
        key = (name, devices)
        if key in self._fronts:
            self.model_hits += 1
            return self._fronts[key]
        self.model_misses += 1
        spec = self.dataflow.model(name)
        usable = self.cluster.device.usable_memory
        options = []
        for s in enumerate_strategies(spec.arch, devices, self.cluster.device.devices_per_node):
            opt = self._option(spec, s)
            if opt.persistent + opt.transient > usable:
                continue
            plan = self._finish(spec, opt, usable - opt.persistent)
            if plan is None:
                continue
            options.append(dataclasses.replace(opt, ample_latency=plan.latency))
        options.sort(key=lambda o: (o.persistent, o.ample_latency))
        front: list[ModelOption] = []
        for o in options:
            if not front or o.ample_latency < front[-1].ample_latency:
                front.append(o)
        self._fronts[key] = front
        return front

    def _option(self, spec: ModelSpec, s: ParallelStrategy) -> ModelOption:
        fixed, transient = [], 0.0
        for stage, wl in self._ops(spec.name):
            if wl.kind == "generate":
                continue
            fixed.append((stage, simulate_op(spec.arch, wl, s, self.cluster, self.opts)))
            fn = train_transient_bytes if wl.kind == "train" else infer_transient_bytes
            transient = max(transient, fn(spec.arch, wl, s, self.opts))
        return ModelOption(s, persistent_bytes(spec.arch, spec.trainable, s, self.opts), transient,
                           tuple(fixed), math.inf)

    def _finish(self, spec: ModelSpec, opt: ModelOption, budget: float) -> ModelPlan | None:
        """Complete an option into a plan given the transient budget (usable − Σ resident):
        pick the fastest feasible generation layout for a generating model."""
        if opt.transient > budget:
            return None
        lat: dict[str, float] = {}
        work: dict[str, tuple[float, float]] = {}

        def add(stage: str, cost: OpCost, extra_s: float = 0.0) -> None:
            lat[stage] = lat.get(stage, 0.0) + cost.latency_s + extra_s
            f, b = work.get(stage, (0.0, 0.0))
            work[stage] = (f + cost.flops, b + cost.bytes_moved)

        for stage, cost in opt.fixed:
            add(stage, cost)
        strategy, peak = opt.strategy, opt.persistent + opt.transient
        gen_ops = [(st, wl) for st, wl in self._ops(spec.name) if wl.kind == "generate"]
        if gen_ops:
            trains = any(wl.kind == "train" for _, wl in self._ops(spec.name))
            best = None
            if opt.strategy.p_g is not None:  # a fixed layout (evaluating a given plan)
                layouts = [(opt.strategy.p_g, opt.strategy.t_g)]
            else:
                layouts = generation_layouts(opt.strategy) if trains else [(opt.strategy.p, opt.strategy.t)]
            for pg, tg in layouts:
                s = dataclasses.replace(opt.strategy, p_g=pg, t_g=tg)
                extra = generation_weight_extra_bytes(spec.arch, s, self.opts)
                costs = [simulate_op(spec.arch, wl, s, self.cluster, self.opts, budget - extra) for _, wl in gen_ops]
                if any(c is None for c in costs):
                    continue
                reshard = reshard_for_generation_s(spec.arch, s, self.cluster, self.opts)
                total = sum(c.latency_s for c in costs) + reshard
                if best is None or total < best[0]:
                    best = (total, s, costs, reshard, extra)
            if best is None:
                return None
            _, strategy, costs, reshard, extra = best
            for i, ((stage, _), cost) in enumerate(zip(gen_ops, costs)):
                add(stage, cost, reshard if i == 0 else 0.0)
            peak = max(peak, opt.persistent + extra + max(c.kv_bytes for c in costs))
        return ModelPlan(spec.name, strategy, lat, work, opt.persistent, peak)

    # ---- per colocated set --------------------------------------------------------------------
    def set_plan(self, models: tuple[str, ...], devices: int) -> SetPlan | None:
        """Best plans for a colocated set on `devices` devices, or None if it cannot fit (cached)."""
        key = (models, devices)
        if key in self._sets:
            self.set_hits += 1
            return self._sets[key]
        self.set_misses += 1
        fronts = [self.front(m, devices) for m in models]
        usable = self.cluster.device.usable_memory
        best: SetPlan | None = None
        best_total = math.inf
        if all(fronts):
            # cheapest-first bound: Σ ample latencies can only grow when memory is shared
            for combo in itertools.product(*fronts):
                resident = sum(o.persistent for o in combo)
                if resident > usable or sum(o.ample_latency for o in combo) >= best_total:
                    continue
                plans = []
                for m, o in zip(models, combo):
                    plan = self._finish(self.dataflow.model(m), o, usable - resident)
                    if plan is None:
                        break
                    plans.append(plan)
                else:
                    total = sum(p.latency for p in plans)
                    if total < best_total:
                        best_total, best = total, SetPlan(models, devices, tuple(plans))
        self._sets[key] = best
        return best

    def fixed_set_plan(self, models: tuple[str, ...], strategies: dict[str, ParallelStrategy]) -> SetPlan:
        """Plans for a colocated set with given strategies (no search); raises if it does not fit."""
        devices = {strategies[m].devices for m in models}
        if len(devices) != 1:
            raise ValueError(f"colocated set {models}: strategies cover different device counts {sorted(devices)}")
        options = [self._option(self.dataflow.model(m), strategies[m]) for m in models]
        resident = sum(o.persistent for o in options)
        usable = self.cluster.device.usable_memory
        plans = []
        for m, o in zip(models, options):
            plan = self._finish(self.dataflow.model(m), o, usable - resident)
            if plan is None:
                raise ValueError(f"model {m} with {strategies[m].label()} does not fit next to {models}: resident "
                                 f"{resident / 2**30:.2f} GiB of {usable / 2**30:.2f} GiB usable")
            plans.append(plan)
        return SetPlan(models, devices.pop(), tuple(plans))

    def stats(self) -> dict[str, int]:
        return dict(model_cache_entries=len(self._fronts), model_cache_hits=self.model_hits,
                    set_cache_entries=len(self._sets), set_cache_hits=self.set_hits)
