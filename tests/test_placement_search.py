"""Algorithm 1: placement counts, memory feasibility, optimality against exhaustive search, speed."""
from __future__ import annotations

import dataclasses
import itertools
import math
import time

import pytest

from jaxrl_hf.placement import (Cluster, Dataflow, DeviceSpec, ModelArch, ModelSpec, Op, RolloutShape, SimOptions,
                                Stage, Workload, allocations, arch_by_name, bell_number, build_dataflow, d_cost,
                                published_device, search, set_partitions)
from jaxrl_hf.placement.auto_parallel import ModelPlan, SetPlan, StrategyCache
from jaxrl_hf.placement.strategy import enumerate_strategies, generation_layouts


def stirling2_sum(n: int) -> int:
    """Bell(n) = Σ_k S(n, k), S(n, k) = 1/k! Σ_j (-1)^j C(k, j) (k-j)^n (explicit formula)."""
    return sum(sum((-1) ** j * math.comb(k, j) * (k - j) ** n for j in range(k + 1)) // math.factorial(k)
               for k in range(n + 1)) if n else 1


@pytest.mark.parametrize("n", range(0, 8))
def test_set_partitions_count_and_validity(n):
    items = [f"m{i}" for i in range(n)]
    parts = set_partitions(items)
    assert len(parts) == bell_number(n) == stirling2_sum(n)
    canon = {frozenset(frozenset(b) for b in p) for p in parts}
    assert len(canon) == len(parts), "duplicate partitions"
    for p in parts:
        flat = [m for b in p for m in b]
        assert sorted(flat) == sorted(items) and all(b for b in p)


def test_bell_numbers_known_values():
    assert [bell_number(n) for n in range(8)] == [1, 1, 2, 5, 15, 52, 203, 877]


@pytest.mark.parametrize("algo,expected", [("ppo", 15), ("safe_rlhf", 52), ("remax", 5), ("grpo", 2), ("dapo", 1)])
def test_num_placements_per_algorithm(algo, expected):
    res = search(build_dataflow(algo, arch_by_name("7b")), Cluster(published_device("a100"), 16))
    assert res.num_placements == expected
    assert len(res.candidates) + len(res.infeasible) == expected


def test_allocations_match_brute_force():
    sizes = (1, 2, 4, 8, 16, 24, 32)
    mins = (2, 1, 8)
    got = sorted(allocations(mins, sizes, 32))
    want = sorted(t for t in itertools.product(sizes, repeat=3)
                  if sum(t) <= 32 and all(a >= m for a, m in zip(t, mins)))
    assert got == want and got


def test_allocation_sizes_follow_node_units():
    assert Cluster(published_device("a100"), 32).allocation_sizes() == (1, 2, 4, 8, 16, 24, 32)
    with pytest.raises(ValueError, match="multiple of devices_per_node"):
        Cluster(published_device("a100"), 12)


def _plan(model: str, stages: dict[str, float]) -> ModelPlan:
    from jaxrl_hf.placement.strategy import ParallelStrategy
    return ModelPlan(model, ParallelStrategy(1, 1, 1), stages, {k: (0.0, 0.0) for k in stages}, 0.0, 0.0)


def test_d_cost_adds_within_a_set_and_takes_max_across_sets():
    df = build_dataflow("ppo", arch_by_name("7b"))
    cl = Cluster(published_device("a100"), 16)
    a = SetPlan(("actor", "ref"), 8, (_plan("actor", {"generation": 5.0, "training": 3.0}),
                                      _plan("ref", {"preparation": 2.0})))
    b = SetPlan(("critic", "reward"), 8, (_plan("critic", {"preparation": 1.5, "training": 4.0}),
                                          _plan("reward", {"preparation": 1.0})))
    total, stages = d_cost(df, [a, b], cl)
    assert stages == {"generation": 5.0, "preparation": max(2.0, 1.5 + 1.0), "training": max(3.0, 4.0)}
    assert total == pytest.approx(5.0 + 2.5 + 4.0)
    merged = SetPlan(("actor", "ref", "critic", "reward"), 16, a.plans + b.plans)
    total, stages = d_cost(df, [merged], cl)
    assert stages == {"generation": 5.0, "preparation": 4.5, "training": 7.0}


def _toy_device(memory: float, per_node: int = 4) -> DeviceSpec:
    return DeviceSpec("toy", memory_bytes=memory, matmul_flops={"bf16": 1e14}, mem_bandwidth=1e12,
                      intra_node_bw=1e11, inter_node_bw=1e10, devices_per_node=per_node,
                      usable_memory_fraction=1.0)


def _two_frozen_models(arch: ModelArch) -> Dataflow:
    wl = Workload("infer", 16, 32, 32)
    return Dataflow("toy", (ModelSpec("a", arch, False), ModelSpec("b", arch, False)),
                    (Stage("s1", (Op("a", wl), Op("b", wl))),))


def test_memory_infeasible_placements_are_excluded():
    arch = ModelArch(8, 1024, 8, 8, 4096, 1000)
    weights = arch.num_params * 2
    # one model needs 2 devices (weights/2 + activations fit, weights do not), both together need 4
    dev = _toy_device(0.75 * weights)
    df = _two_frozen_models(arch)
    res = search(df, Cluster(dev, 4))
    assert {c.placement: c.devices for c in res.candidates} == {(("a", "b"),): (4,), (("a",), ("b",)): (2, 2)}
    res3 = search(df, Cluster(dev, 3))
    assert not res3.candidates and len(res3.infeasible) == 2
    reasons = dict(res3.infeasible)
    assert "a+b needs > 3" in reasons[(("a", "b"),)] and "a needs 2" in reasons[(("a",), ("b",))]
    with pytest.raises(ValueError, match="no feasible placement"):
        _ = res3.best


def test_70b_ppo_does_not_fit_16_a100_and_every_plan_fits_memory():
    res = search(build_dataflow("ppo", arch_by_name("70b")), Cluster(published_device("a100-80gb"), 16))
    assert not res.candidates and len(res.infeasible) == 15
    ok = search(build_dataflow("ppo", arch_by_name("13b")), Cluster(published_device("a100-40gb"), 32))
    usable = ok.cluster.device.usable_memory
    for cand in ok.candidates:
        for s in cand.sets:
            resident = sum(p.persistent_bytes for p in s.plans)
            for p in s.plans:
                assert resident - p.persistent_bytes + p.peak_bytes <= usable * (1 + 1e-9)


def _brute_force(df: Dataflow, cluster: Cluster, opts: SimOptions) -> float:
    """Exhaustive reference: every placement × allocation × strategy combination (incl. every
    generation layout), evaluated without fronts, caches or pruning."""
    cache = StrategyCache(df, cluster, opts)
    per = cluster.device.devices_per_node

    def strategies(model: str, n: int):
        base = enumerate_strategies(df.model(model).arch, n, per)
        if any(wl.kind == "generate" for _, wl in df.ops_of(model)):
            return [dataclasses.replace(s, p_g=pg, t_g=tg) for s in base for pg, tg in generation_layouts(s)]
        return base

    best = math.inf
    sizes = cluster.allocation_sizes()
    for placement in set_partitions(df.model_names):
        for alloc in allocations([1] * len(placement), sizes, cluster.num_devices):
            per_set_best = []
            for block, n in zip(placement, alloc):
                plans = []
                for combo in itertools.product(*[strategies(m, n) for m in block]):
                    try:
                        plans.append(cache.fixed_set_plan(block, dict(zip(block, combo))))
                    except ValueError:
                        pass
                per_set_best.append(plans)
            if not all(per_set_best):
                continue
            for sets in itertools.product(*per_set_best):
                best = min(best, d_cost(df, sets, cluster, opts.dtype)[0])
    return best


@pytest.mark.parametrize("memory_gib,infeasible", [(16.0, 0), (6.0, 0), (4.0, 4)])
def test_search_finds_the_exhaustive_optimum(memory_gib, infeasible):
    """ReMax (3 models) on 2 nodes × 4 devices; 6 and 4 GiB make memory bind (strategies change,
    at 4 GiB only full colocation fits), so fronts and pruning are exercised."""
    arch = ModelArch(16, 2048, 16, 16, 5504, 32000)
    shape = RolloutShape(prompts=64, prompt_len=256, response_len=256, mini_batches=2)
    df = build_dataflow("remax", arch, shape)
    cluster = Cluster(dataclasses.replace(published_device("a100"), memory_bytes=memory_gib * 2**30,
                                          devices_per_node=4), 8)
    res = search(df, cluster)
    assert len(res.infeasible) == infeasible
    ref = _brute_force(df, cluster, SimOptions())
    assert res.best.step_time_s == pytest.approx(ref, rel=1e-9)


def test_sequential_stages_prefer_colocation_on_all_devices():
    """Two models used in different stages: colocating gives each stage all N devices (no idle)."""
    arch = ModelArch(8, 1024, 8, 8, 4096, 8000)
    wl = Workload("infer", 256, 512, 512)
    df = Dataflow("seq", (ModelSpec("a", arch, False), ModelSpec("b", arch, False)),
                  (Stage("s1", (Op("a", wl),)), Stage("s2", (Op("b", wl),))))
    res = search(df, Cluster(published_device("h100"), 16))
    assert res.best.placement == (("a", "b"),) and res.best.devices == (16,)


@pytest.mark.parametrize("size", ["7b", "13b"])
def test_search_128_devices_four_models_under_a_minute(size):
    t0 = time.perf_counter()
    res = search(build_dataflow("ppo", arch_by_name(size)), Cluster(published_device("a100"), 128))
    wall = time.perf_counter() - t0
    assert wall < 60 and res.wall_time_s < 60
    assert res.num_placements == 15 and res.allocations_evaluated > 1000
    assert sum(res.best.devices) <= 128
    for s in res.best.sets:
        assert all(p.strategy.devices == s.devices for p in s.plans)
