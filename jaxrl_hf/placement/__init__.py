"""Auto device mapping (HybridFlow §2.6, Algorithm 1) with calibrated latency simulators.

    from jaxrl_hf.placement import build_dataflow, arch_by_name, Cluster, published_device, search
    result = search(build_dataflow("ppo", arch_by_name("7b")), Cluster(published_device("a100"), 16))
    result.best.placement, result.best.devices, result.best.step_time_s

Modules: dataflow (models, stages, workloads), cluster (device constants), memory, strategy,
simulators (train / infer / generate cost models), auto_parallel (per-model strategies, cached),
search (placements, allocations, d_cost), plan_io (YAML plans), report (tables), measure (a small
real workload on fake CPU devices for checking the simulators).
"""
from jaxrl_hf.placement.cluster import (Cluster, DeviceSpec, load_device_profile, published_device)
from jaxrl_hf.placement.dataflow import (ALGOS, ARCHS, Dataflow, ModelArch, ModelSpec, Op, RolloutShape, Stage,
                                         Workload, arch_by_name, build_dataflow)
from jaxrl_hf.placement.memory import SimOptions
from jaxrl_hf.placement.plan_io import PlacementPlan, best_plan, load_plan, parse_plan, plan_to_overrides, write_plan
from jaxrl_hf.placement.report import format_top_table
from jaxrl_hf.placement.search import (Candidate, SearchResult, allocations, bell_number, d_cost, search,
                                       set_partitions)
from jaxrl_hf.placement.strategy import ParallelStrategy

__all__ = ["ALGOS", "ARCHS", "Candidate", "Cluster", "Dataflow", "DeviceSpec", "ModelArch", "ModelSpec", "Op",
           "ParallelStrategy", "PlacementPlan", "RolloutShape", "SearchResult", "SimOptions", "Stage", "Workload",
           "allocations", "arch_by_name", "bell_number", "best_plan", "build_dataflow", "d_cost", "format_top_table",
           "load_device_profile", "load_plan", "parse_plan", "plan_to_overrides", "published_device", "search", "set_partitions",
           "write_plan"]
