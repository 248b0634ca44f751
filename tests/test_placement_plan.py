"""launch/plan.py end to end and the YAML plan a launcher reads."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jaxrl_hf.placement import Cluster, arch_by_name, build_dataflow, load_plan, parse_plan, published_device, search
from jaxrl_hf.placement.plan_io import candidate_to_dict

ROOT = Path(__file__).resolve().parents[1]


def test_plan_cli_outside_check(tmp_path):
    out, plan = tmp_path / "out.json", tmp_path / "plan.yaml"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "plan.py"), "--algo", "ppo", "--model-size", "7b",
                           "--gpus", "16", "--gpu", "a100", "--json", str(out), "--out", str(plan)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["num_placements"] == 15
    assert 0 < data["search_wall_time_s"] < 60
    best = data["best"]
    models = sorted(m for block in best["placement"] for m in block)
    assert models == ["actor", "critic", "ref", "reward"]
    assert best["predicted_step_time_s"] > 0
    assert sum(best["devices"].values()) <= 16
    for block in best["placement"]:
        n = best["devices"]["+".join(block)]
        for m in block:
            par = best["parallel"][m]
            assert par["pp"] * par["tp"] * par["dp"] == n
    assert "gen_tp" in best["parallel"]["actor"]
    assert data["top"][0]["predicted_step_time_s"] == best["predicted_step_time_s"]
    assert "| rank | placement" in proc.stdout  # the readable table
    loaded = load_plan(plan)
    assert loaded.predicted_step_time_s == pytest.approx(best["predicted_step_time_s"])
    assert {p.name: p.size for p in loaded.pools} == {f"pool{i}": best["devices"]["+".join(b)]
                                                     for i, b in enumerate(best["placement"])}


def _plan_dict(placement_sets: int = 2) -> dict:
    res = search(build_dataflow("ppo", arch_by_name("7b")), Cluster(published_device("a100"), 16))
    cand = next(c for c in res.candidates if len(c.placement) == placement_sets)
    return candidate_to_dict(res, cand)


def test_plan_roundtrip_and_pool_layout(tmp_path):
    data = _plan_dict()
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(data))
    plan = load_plan(path)
    ranges = sorted(p.devices for p in plan.pools)
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for m, s in plan.strategies.items():
        assert s.devices == plan.pool_of(m).size


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["resource_pools"][1].__setitem__("devices", [4, 12]), "overlaps"),
    (lambda d: d["resource_pools"][0].__setitem__("devices", [0, 40]), r"devices must be \[start, end\)"),
    (lambda d: d["models"]["actor"].__setitem__("tp", 3), r"models.actor: pp\*tp\*dp"),
    (lambda d: d["models"]["critic"].__setitem__("flavour", 1), r"models.critic has unknown keys \['flavour'\]"),
    (lambda d: d["resource_pools"][1]["models"].append("actor"), "model 'actor' is in pools"),
    (lambda d: d.pop("models"), r"missing keys \['models'\]"),
    (lambda d: d["models"]["actor"].__setitem__("gen_tp", 3), "t_g | t"),
])
def test_bad_plans_name_file_and_key(tmp_path, mutate, message):
    data = _plan_dict()
    mutate(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=message) as e:
        load_plan(path)
    assert "bad.yaml" in str(e.value)


def test_parse_plan_rejects_non_mapping():
    with pytest.raises(ValueError, match="top level must be a mapping"):
        parse_plan([1, 2], "x.yaml")


@pytest.mark.parametrize("args,message", [
    (["--gpus", "12"], "multiple of devices_per_node=8"),
    (["--model-size", "70b", "--gpus", "16"], "no feasible placement.*actor needs 16"),
    (["--gpu", "v100"], "unknown GPU 'v100'; valid"),
])
def test_plan_cli_bad_input_is_a_clear_error(args, message):
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "plan.py"), *args], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert re.search(message, proc.stderr), proc.stderr


def test_plan_to_launcher_overrides():
    from jaxrl_hf.placement import plan_to_overrides
    data = _plan_dict()  # a two-set placement of PPO on 16 A100
    plan = parse_plan(data, "p.yaml")
    over = plan_to_overrides(plan)
    actor = plan.strategies["actor"]
    assert over["placement.num_processes"] == plan.pool_of("actor").size
    assert (over["placement.train.pp"], over["placement.train.tp"], over["placement.train.dp"]) == (actor.p, actor.t,
                                                                                                       actor.d)
    assert (over["placement.generate.pp"], over["placement.generate.tp"]) == (actor.p_g, actor.t_g)
    for role in ("critic", "reward"):
        together = plan.pool_of(role).name == plan.pool_of("actor").name
        assert over[f"placement.{role}.colocate"] == together
        if not together:
            assert over[f"placement.{role}.num_processes"] == plan.pool_of(role).size
    standalone = parse_plan(_plan_dict(placement_sets=4), "s.yaml")
    with pytest.raises(ValueError, match="plan puts ref on pool"):
        plan_to_overrides(standalone)
    colocated = parse_plan(_plan_dict(placement_sets=1), "c.yaml")
    assert all(plan_to_overrides(colocated)[f"placement.{r}.colocate"] for r in ("critic", "reward"))
    with pytest.raises(ValueError, match="not a multiple of devices_per_process=3"):
        plan_to_overrides(colocated, devices_per_process=3)
