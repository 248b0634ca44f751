"""The placement plan a launcher reads: resource pools (device ranges), the models on each pool and
every model's parallel sizes.  Written as YAML by `launch/plan.py`, read by `load_plan`.

  version: 1
  algo: ppo
  cluster: {device: a100-80gb, num_devices: 16, devices_per_node: 8}
  resource_pools:
    - {name: pool0, devices: [0, 16], models: [actor, critic, ref, reward]}
  models:
    actor: {pool: pool0, pp: 4, tp: 2, dp: 2, gen_pp: 1, gen_tp: 2, gen_micro_dp: 4}
  predicted: {step_time_s: 173.6, stage_times_s: {generation: 54.3, ...}}
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from jaxrl_hf.placement.search import Candidate, SearchResult
from jaxrl_hf.placement.strategy import ParallelStrategy

PLAN_VERSION = 1
MODEL_KEYS = ("pool", "pp", "tp", "dp", "gen_pp", "gen_tp", "gen_micro_dp", "stage_times_s", "peak_memory_gib")


@dataclasses.dataclass(frozen=True)
class ResourcePoolPlan:
    name: str
    devices: tuple[int, int]  # [start, end)
    models: tuple[str, ...]

    @property
    def size(self) -> int:
        return self.devices[1] - self.devices[0]


@dataclasses.dataclass(frozen=True)
class PlacementPlan:
    """A validated plan: pools partition a prefix of the devices; each model lives on one pool with
    pp·tp·dp equal to the pool size (and gen_pp | pp, gen_tp | tp when it generates)."""

    algo: str
    num_devices: int
    device: str
    pools: tuple[ResourcePoolPlan, ...]
    strategies: dict[str, ParallelStrategy]
    predicted_step_time_s: float | None = None

    def pool_of(self, model: str) -> ResourcePoolPlan:
        for pool in self.pools:
            if model in pool.models:
                return pool
        raise KeyError(f"model {model!r} is in no resource pool; pools: {[p.name for p in self.pools]}")


def candidate_to_dict(result: SearchResult, cand: Candidate) -> dict[str, Any]:
    """The YAML/JSON form of one search candidate."""
    ranges = cand.device_ranges()
    pools, models = [], {}
    for i, (block, rng, sp) in enumerate(zip(cand.placement, ranges, cand.sets)):
        name = f"pool{i}"
        pools.append({"name": name, "devices": list(rng), "models": list(block)})
        for plan in sp.plans:
            models[plan.model] = {"pool": name, **plan.strategy.to_dict(),
                                  "stage_times_s": {k: round(v, 6) for k, v in plan.stage_latency.items()},
                                  "peak_memory_gib": round(plan.peak_bytes / 2**30, 3)}
    cl = result.cluster
    return {"version": PLAN_VERSION, "algo": result.dataflow.algo,
            "cluster": {"device": cl.device.name, "num_devices": cl.num_devices,
                        "devices_per_node": cl.device.devices_per_node},
            "resource_pools": pools, "models": models,
            "predicted": {"step_time_s": round(cand.step_time_s, 6),
                          "stage_times_s": {k: round(v, 6) for k, v in cand.stage_times.items()}}}


def write_plan(result: SearchResult, path: str | Path, cand: Candidate | None = None) -> dict[str, Any]:
    """Write the best (or given) candidate as a YAML plan; returns the written mapping."""
    data = candidate_to_dict(result, cand or result.best)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return data


def _require(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{where}: {msg}")


def parse_plan(data: Any, where: str = "plan") -> PlacementPlan:
    """Validate a plan mapping; every error names the file and the offending key."""
    _require(isinstance(data, dict), where, f"top level must be a mapping, got {type(data).__name__}")
    missing = [k for k in ("version", "algo", "cluster", "resource_pools", "models") if k not in data]
    _require(not missing, where, f"missing keys {missing}")
    _require(data["version"] == PLAN_VERSION, where, f"version {data['version']!r} unsupported (want {PLAN_VERSION})")
    cl = data["cluster"]
    _require(isinstance(cl, dict) and "num_devices" in cl, where, "cluster.num_devices missing")
    n = cl["num_devices"]
    _require(isinstance(n, int) and n >= 1, where, f"cluster.num_devices must be a positive int, got {n!r}")
    pools, used, owner = [], set(), {}
    for i, raw in enumerate(data["resource_pools"] or []):
        key = f"resource_pools[{i}]"
        _require(isinstance(raw, dict) and {"name", "devices", "models"} <= set(raw), where,
                 f"{key} needs name, devices, models")
        rng = raw["devices"]
        _require(isinstance(rng, list) and len(rng) == 2 and all(isinstance(x, int) for x in rng)
                 and 0 <= rng[0] < rng[1] <= n, where,
                 f"{key}.devices must be [start, end) inside [0, {n}), got {rng!r}")
        ids = set(range(*rng))
        _require(not ids & used, where, f"{key} ({raw['name']}) overlaps another pool's devices")
        used |= ids
        for m in raw["models"]:
            _require(m not in owner, where, f"model {m!r} is in pools {owner.get(m)} and {raw['name']}")
            owner[m] = raw["name"]
        pools.append(ResourcePoolPlan(str(raw["name"]), (rng[0], rng[1]), tuple(raw["models"])))
    _require(bool(pools), where, "resource_pools is empty")
    sizes = {p.name: p.size for p in pools}
    strategies = {}
    for m, spec in (data["models"] or {}).items():
        key = f"models.{m}"
        _require(isinstance(spec, dict), where, f"{key} must be a mapping")
        unknown = sorted(set(spec) - set(MODEL_KEYS))
        _require(not unknown, where, f"{key} has unknown keys {unknown}; valid: {list(MODEL_KEYS)}")
        _require(owner.get(m) == spec.get("pool"), where,
                 f"{key}.pool is {spec.get('pool')!r} but the model is listed in pool {owner.get(m)!r}")
        for k in ("pp", "tp", "dp"):
            _require(isinstance(spec.get(k), int) and spec[k] >= 1, where, f"{key}.{k} must be a positive int")
        _require(spec["pp"] * spec["tp"] * spec["dp"] == sizes[spec["pool"]], where,
                 f"{key}: pp*tp*dp = {spec['pp'] * spec['tp'] * spec['dp']} != pool {spec['pool']} size "
                 f"{sizes[spec['pool']]}")
        try:
            strategies[m] = ParallelStrategy(spec["pp"], spec["tp"], spec["dp"], spec.get("gen_pp"), spec.get("gen_tp"))
        except ValueError as e:
            raise ValueError(f"{where}: {key}: {e}") from e
    missing_models = sorted(set(owner) - set(strategies))
    _require(not missing_models, where, f"models {missing_models} are in a pool but have no entry under models")
    pred = (data.get("predicted") or {}).get("step_time_s")
    return PlacementPlan(str(data["algo"]), n, str(cl.get("device", "?")), tuple(pools), strategies, pred)


def load_plan(path: str | Path) -> PlacementPlan:
    """Read and validate a YAML plan file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"cannot read placement plan {path}: {e}") from e
    return parse_plan(data, where=str(path))


def best_plan(result: SearchResult) -> PlacementPlan:
    """The search's best candidate as a validated PlacementPlan (what `placement=auto` uses)."""
    return parse_plan(candidate_to_dict(result, result.best), where=f"auto plan for {result.dataflow.algo}")


# roles the launcher's `placement` config can place on their own pool (others share the actor's)
SEPARABLE_ROLES = ("critic", "reward")


def plan_to_overrides(plan: PlacementPlan, devices_per_process: int = 1) -> dict[str, Any]:
    """Dotted `placement.*` overrides for the launcher config (jaxrl_hf.config PlacementConfig):
    the actor's pool size and (p, t, d) / generation (p_g, t_g), and for critic / reward either
    `colocate: true` or their own pool's process count.  Raises when the plan places a role the
    launcher cannot place (e.g. ref away from the actor) or a pool size is not a multiple of
    `devices_per_process`."""
    if "actor" not in plan.strategies:
        raise ValueError("plan has no actor")
    actor_pool, s = plan.pool_of("actor"), plan.strategies["actor"]

    def processes(pool: ResourcePoolPlan) -> int:
        if pool.size % devices_per_process:
            raise ValueError(f"pool {pool.name} has {pool.size} devices, not a multiple of "
                             f"devices_per_process={devices_per_process}")
        return pool.size // devices_per_process

    out: dict[str, Any] = {
        "placement.num_processes": processes(actor_pool), "placement.devices_per_process": devices_per_process,
        "placement.train.pp": s.p, "placement.train.tp": s.t, "placement.train.dp": s.d,
        "placement.generate.pp": s.p_g or s.p, "placement.generate.tp": s.t_g or s.t,
    }
    for role in plan.strategies:
        if role == "actor":
            continue
        pool = plan.pool_of(role)
        if role in SEPARABLE_ROLES:
            out[f"placement.{role}.colocate"] = pool.name == actor_pool.name
            if pool.name != actor_pool.name:
                out[f"placement.{role}.num_processes"] = processes(pool)
                out[f"placement.{role}.devices_per_process"] = devices_per_process
        elif pool.name != actor_pool.name:
            raise ValueError(f"plan puts {role} on {pool.name}, away from the actor's {actor_pool.name}; the "
                             f"launcher places only {list(SEPARABLE_ROLES)} on their own pools")
    return out
