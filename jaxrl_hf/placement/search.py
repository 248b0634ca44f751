"""HybridFlow Algorithm 1: the device mapping of an RL dataflow that minimises one iteration's latency.

  for each placement P (a set partition of the models into colocated sets; Bell(k) of them):
      A_min per colocated set from memory (the smallest allocation on which the set fits)
      for each allocation (A_1, ..., A_m), A_i >= A_min_i, A_i an allowed size, Σ A_i <= N:
          per set: auto_parallel → per-model strategies and stage latencies (cached per (set, A))
          d_cost = Σ_stages max_sets Σ_{models of the set in the stage} latency
  return the placement, allocation and strategies of the smallest d_cost.

Allowed allocation sizes are powers of two up to one node, then whole nodes (`Cluster.allocation_sizes`).
Sets are laid out on consecutive device ids, largest first, which keeps every set node-aligned.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Iterator, Sequence

from jaxrl_hf.placement.auto_parallel import SetPlan, StrategyCache
from jaxrl_hf.placement.cluster import Cluster
from jaxrl_hf.placement.dataflow import Dataflow
from jaxrl_hf.placement.memory import SimOptions, min_devices_lower_bound
from jaxrl_hf.placement.strategy import ParallelStrategy

Placement = tuple[tuple[str, ...], ...]


def set_partitions(items: Sequence[str]) -> list[Placement]:
    """All partitions of `items` into non-empty unordered blocks (Bell(len(items)) of them).
    Block order follows the first element's position, items inside a block keep input order."""
    items = list(items)
    if not items:
        return [()]
    first, rest = items[0], items[1:]
    out: list[Placement] = []
    for part in set_partitions(rest):
        out.append(((first,),) + part)  # first alone
        for i in range(len(part)):        # first joins block i
            out.append(part[:i] + ((first,) + part[i],) + part[i + 1:])
    return [tuple(sorted(p, key=lambda block: items.index(block[0]))) for p in out]


def bell_number(n: int) -> int:
    """Bell number via the Bell triangle."""
    row = [1]
    for _ in range(n):
        nxt = [row[-1]]
        for v in row:
            nxt.append(nxt[-1] + v)
        row = nxt
    return row[0]


def allocations(min_sizes: Sequence[int], sizes: Sequence[int], total: int) -> Iterator[tuple[int, ...]]:
    """Every tuple (A_1..A_m) with A_i in `sizes`, A_i >= min_sizes[i] and Σ A_i <= total."""
    if not min_sizes:
        yield ()
        return
    rest_min = sum(min_sizes[1:])
    for a in sizes:
        if a < min_sizes[0]:
            continue
        if a + rest_min > total:
            break
        for tail in allocations(min_sizes[1:], sizes, total - a):
            yield (a,) + tail


def d_cost(dataflow: Dataflow, sets: Sequence[SetPlan], cluster: Cluster,
           dtype: str = "bf16") -> tuple[float, dict[str, float]]:
    """End-to-end iteration latency (Algorithm 1 d_cost): per stage, models of one colocated set add
    up and disjoint sets overlap (the stage takes the max).  On host-shared devices (fake CPU
    devices) disjoint sets also compete for the host's cores: a stage lasts at least
    Σ FLOPs / host FLOP/s + Σ bytes / host bandwidth (the same cores do both)."""
    dev = cluster.device
    stage_times = {}
    for stage in dataflow.stages:
        t = max(s.stage_latency(stage.name) for s in sets)
        if dev.host_flops_cap is not None and len(sets) > 1:
            flops = sum(s.stage_work(stage.name)[0] for s in sets)
            nbytes = sum(s.stage_work(stage.name)[1] for s in sets)
            cap_bw = dev.host_bw_cap if dev.host_bw_cap is not None else math.inf
            t = max(t, flops / dev.host_flops_cap.get(dtype, math.inf) + nbytes / cap_bw)
        stage_times[stage.name] = t
    return sum(stage_times.values()), stage_times


@dataclasses.dataclass(frozen=True)
class Candidate:
    """The best allocation and strategies found for one placement."""

    placement: Placement
    devices: tuple[int, ...]
    sets: tuple[SetPlan, ...]
    step_time_s: float
    stage_times: dict[str, float]

    def device_ranges(self) -> list[tuple[int, int]]:
        """[start, end) device ids per set: largest set first on consecutive ids."""
        order = sorted(range(len(self.devices)), key=lambda i: (-self.devices[i], i))
        ranges: list[tuple[int, int]] = [(0, 0)] * len(self.devices)
        start = 0
        for i in order:
            ranges[i] = (start, start + self.devices[i])
            start += self.devices[i]
        return ranges


@dataclasses.dataclass(frozen=True)
class SearchResult:
    dataflow: Dataflow
    cluster: Cluster
    options: SimOptions
    candidates: tuple[Candidate, ...]       # best per feasible placement, fastest first
    infeasible: tuple[tuple[Placement, str], ...]
    num_placements: int
    allocations_evaluated: int
    wall_time_s: float
    cache_stats: dict[str, int]

    @property
    def best(self) -> Candidate:
        if not self.candidates:
            reasons = "; ".join(f"{p}: {r}" for p, r in self.infeasible[:5])
            raise ValueError(f"no feasible placement for {self.dataflow.algo} on {self.cluster.num_devices} "
                             f"x {self.cluster.device.name}: {reasons}")
        return self.candidates[0]


def search(dataflow: Dataflow, cluster: Cluster, opts: SimOptions = SimOptions()) -> SearchResult:
    """Run Algorithm 1 over every placement of `dataflow` on `cluster`."""
    t0 = time.perf_counter()
    cache = StrategyCache(dataflow, cluster, opts)
    sizes = cluster.allocation_sizes()
    usable = cluster.device.usable_memory
    placements = set_partitions(dataflow.model_names)
    candidates, infeasible, evaluated = [], [], 0
    for placement in placements:
        a_min = []
        for block in placement:
            bound = min_devices_lower_bound([(dataflow.model(m).arch, dataflow.model(m).trainable) for m in block],
                                            usable, opts)
            fits = [a for a in sizes if a >= bound and cache.set_plan(block, a) is not None]
            a_min.append(fits[0] if fits else None)
        if any(a is None for a in a_min) or sum(a_min) > cluster.num_devices:
            why = [f"{'+'.join(b)} needs {'> ' + str(cluster.num_devices) if a is None else a}"
                   for b, a in zip(placement, a_min)]
            infeasible.append((placement, "A_min exceeds the cluster: " + ", ".join(why)))
            continue
        best = None
        for alloc in allocations(a_min, sizes, cluster.num_devices):
            sets = [cache.set_plan(block, a) for block, a in zip(placement, alloc)]
            if any(s is None for s in sets):
                continue
            evaluated += 1
            total, stages = d_cost(dataflow, sets, cluster, opts.dtype)
            if best is None or total < best.step_time_s - 1e-12 or (
                    math.isclose(total, best.step_time_s) and sum(alloc) < sum(best.devices)):
                best = Candidate(placement, alloc, tuple(sets), total, stages)
        if best is None:
            infeasible.append((placement, "no allocation fits in memory"))
        else:
            candidates.append(best)
    candidates.sort(key=lambda c: c.step_time_s)
    return SearchResult(dataflow, cluster, opts, tuple(candidates), tuple(infeasible), len(placements),
                        evaluated, time.perf_counter() - t0, cache.stats())


def evaluate_placement(dataflow: Dataflow, cluster: Cluster, placement: Placement,
                       strategies: dict[str, ParallelStrategy], opts: SimOptions = SimOptions()) -> Candidate:
    """Predicted stage and step times of a given placement with given strategies (no search)."""
    named = [m for block in placement for m in block]
    if sorted(named) != sorted(dataflow.model_names):
        raise ValueError(f"placement {placement} must name each of {list(dataflow.model_names)} exactly once")
    cache = StrategyCache(dataflow, cluster, opts)
    sets = tuple(cache.fixed_set_plan(tuple(block), strategies) for block in placement)
    if sum(s.devices for s in sets) > cluster.num_devices:
        raise ValueError(f"placement {placement} uses {sum(s.devices for s in sets)} > {cluster.num_devices} devices")
    total, stages = d_cost(dataflow, sets, cluster, opts.dtype)
    return Candidate(tuple(tuple(b) for b in placement), tuple(s.devices for s in sets), sets, total, stages)
