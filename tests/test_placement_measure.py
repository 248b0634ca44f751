"""The measured workload on 8 fake CPU devices, and calibrate → plan with a measured profile."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from jaxrl_hf.placement import ModelArch, RolloutShape, build_dataflow, load_device_profile  # noqa: E402
from jaxrl_hf.placement.measure import (MeasuredModel, forward, init_params, make_generate,  # noqa: E402
                                        measure_placement, param_specs)

ROOT = Path(__file__).resolve().parents[1]
TINY = ModelArch(1, 64, 4, 2, 128, 128)
needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=8")


@needs8
def test_sharded_forward_and_greedy_decode_match_one_device():
    params = init_params(TINY, 0)
    prompts = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab, (4, 6)), jnp.int32)
    fwd = jax.jit(lambda p, t: forward(TINY, p, t)[0])
    ref_logits = np.asarray(fwd(params, prompts))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("dp", "tp"))
    sharded = jax.device_put(params, {k: NamedSharding(mesh, s) for k, s in param_specs(params).items()})
    p_sh = jax.device_put(prompts, NamedSharding(mesh, P("dp", None)))
    np.testing.assert_allclose(np.asarray(fwd(sharded, p_sh)), ref_logits, rtol=1e-4, atol=1e-5)
    tokens = np.asarray(jax.jit(make_generate(TINY, 6, 2))(sharded, p_sh))
    # greedy decode continues with the argmax of the full-sequence forward's logits (KV cache path
    # vs no-cache path), first from the prompt, then from prompt + first token
    assert (tokens[:, 0] == ref_logits[:, -1].argmax(-1)).all()
    longer = jnp.concatenate([prompts, jnp.asarray(tokens[:, :1])], axis=1)
    assert (tokens[:, 1] == np.asarray(forward(TINY, params, longer)[0])[:, -1].argmax(-1)).all()


@needs8
def test_measure_placement_runs_every_stage_and_rejects_bad_layouts():
    df = build_dataflow("grpo", TINY, RolloutShape(prompts=8, prompt_len=4, response_len=4, mini_batches=1))
    split = [MeasuredModel("actor", (0, 4), 2, 1), MeasuredModel("ref", (4, 8), 1)]
    with pytest.raises(ValueError, match="overlap"):
        measure_placement(df, [split[0], MeasuredModel("ref", (2, 6), 1)], repeats=1)
    with pytest.raises(ValueError, match=r"models \['ref'\] have no placement"):
        measure_placement(df, split[:1], repeats=1)
    times = measure_placement(df, split, repeats=1)  # TP-2 training, reshard to TP-1 generation
    assert set(times) == {"generation", "preparation", "training"} and all(t > 0 for t in times.values())


@needs8
def test_calibrate_then_plan_with_the_measured_profile(tmp_path):
    prof = tmp_path / "profile.json"
    spec = importlib.util.spec_from_file_location("calibrate_cli", ROOT / "launch" / "calibrate.py")
    calibrate_cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate_cli)  # in-process: this test's 8 devices, no second JAX start-up
    calibrate_cli.main(["--quick", "--out", str(prof)])
    dev = load_device_profile(prof)
    raw = json.loads(prof.read_text())["measurements"]
    assert raw["num_devices"] == 8 and dev.devices_per_node == 8 and dev.host_flops_cap is not None
    assert dev.flops("f32") > 1e8 and dev.mem_bandwidth > 1e7 and dev.intra_node_bw > 0
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "plan.py"), "--device-profile", str(prof),
                           "--algo", "grpo", "--model-size", "smollm2-135m", "--gpus", "8", "--prompts", "16",
                           "--prompt-len", "32", "--response-len", "32", "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["num_placements"] == 2 and data["device"].startswith("cpu-8dev")
