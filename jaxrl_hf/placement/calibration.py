"""Measure the simulator's device constants on the current machine (used by `launch/calibrate.py`).

matmul rate (f32, and bf16 inputs with f32 accumulation) of one device and of all devices at once
(the aggregate caps the rate of host-shared fake CPU devices), memory bandwidth likewise, ring
collective α/β fitted over several sizes of all-reduce and all-gather, and the fixed per-layer and
per-decode-step costs fitted from a tiny decode loop at two depths, and the backward pass's rate
relative to the forward's, profiled on one decoder layer of a fixed reference size.
"""
from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_hf.placement.cluster import DeviceSpec
from jaxrl_hf.placement.dataflow import ModelArch


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of fn() after one warm-up call."""
    jax.block_until_ready(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def matmul_rate(n: int, dtype: str, devices: int, repeats: int = 3) -> float:
    """FLOP/s of `devices` concurrent n×n matmuls (one per device); bf16 accumulates in f32."""
    devs = jax.devices()[:devices]
    mesh = Mesh(np.array(devs), ("x",))
    dt = jnp.bfloat16 if dtype == "bf16" else jnp.float32
    a = jax.device_put(jnp.ones((devices, n, n), dt), NamedSharding(mesh, P("x")))
    f = jax.jit(lambda a: jnp.einsum("bij,bjk->bik", a, a, preferred_element_type=jnp.float32))
    return devices * 2 * n**3 / _time(lambda: f(a), repeats)


def memory_bandwidth(nbytes: int, devices: int, repeats: int = 3) -> float:
    """Bytes/s of an elementwise read+write over `devices` devices at once."""
    devs = jax.devices()[:devices]
    mesh = Mesh(np.array(devs), ("x",))
    x = jax.device_put(jnp.ones((devices, nbytes // 4), jnp.float32), NamedSharding(mesh, P("x")))
    f = jax.jit(lambda x: x * 1.0001 + 1.0)
    return devices * 2 * nbytes / _time(lambda: f(x), repeats)


def collective_times(sizes: list[int], devices: int, repeats: int = 3) -> dict[str, list[float]]:
    """Wall times of all-reduce (psum of a per-device buffer of `size` bytes) and all-gather
    (producing `size` bytes per device) over `devices` devices, per size."""
    mesh = Mesh(np.array(jax.devices()[:devices]), ("x",))
    sh = NamedSharding(mesh, P("x"))
    out: dict[str, list[float]] = {"all_reduce": [], "all_gather": []}
    for size in sizes:
        n = size // 4
        x = jax.device_put(jnp.ones((devices * n,), jnp.float32), sh)
        psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        small = jax.device_put(jnp.ones((n,), jnp.float32), sh)  # n/devices per device
        gather = jax.jit(jax.shard_map(lambda v: jax.lax.all_gather(v, "x", tiled=True), mesh=mesh,
                                       in_specs=P("x"), out_specs=P(None), check_vma=False))
        out["all_reduce"].append(_time(lambda: psum(x), repeats))
        out["all_gather"].append(_time(lambda: gather(small), repeats))
    return out


def fit_ring(sizes: list[int], times: list[float], n: int, kind: str) -> tuple[float, float]:
    """Least-squares (α, β) of the ring model: all-reduce 2(n-1)α + 2(n-1)/n·V/β,
    all-gather (n-1)α + (n-1)/n·V/β.  Returns (alpha_s, bandwidth_bytes_per_s)."""
    k = 2 if kind == "all_reduce" else 1
    A = np.array([[k * (n - 1), k * (n - 1) / n * v] for v in sizes], float)
    coef, *_ = np.linalg.lstsq(A, np.array(times), rcond=None)
    alpha, inv_beta = max(coef[0], 1e-7), max(coef[1], 1e-13)
    return float(alpha), float(1.0 / inv_beta)


def decode_overheads(repeats: int = 3, response_len: int = 32) -> tuple[float, float]:
    """(per-layer, per-step) fixed costs from a tiny greedy decode at depths 1 and 8 (hidden 64,
    batch 1: negligible FLOPs), fitted as step_time = step_overhead + L · layer_overhead."""
    from jaxrl_hf.placement.measure import init_params, make_generate
    per_step = {}
    for layers in (1, 8):
        arch = ModelArch(layers, 64, 4, 4, 128, 256)
        params = jax.device_put(init_params(arch, 0), jax.devices()[0])
        gen = jax.jit(make_generate(arch, 4, response_len))
        prompts = jnp.zeros((1, 4), jnp.int32)
        per_step[layers] = _time(lambda: gen(params, prompts), repeats) / response_len
    layer = max((per_step[8] - per_step[1]) / 7, 1e-7)
    return layer, max(per_step[1] - layer, 0.0)


def backward_efficiency(tokens: int = 512, repeats: int = 3) -> float:
    """Backward-pass rate relative to the forward rate, profiled on one decoder layer of a fixed
    reference size (hidden 192, 4 heads, FFN 512, vocabulary 1024, sequences of 64; layer-level
    profiling as auto-parallel planners do): (2 · t_forward) / (t_forward+backward − t_forward)."""
    from jaxrl_hf.placement.measure import forward, init_params
    arch = ModelArch(1, 192, 4, 4, 512, 1024)
    params = init_params(arch, 0)
    toks = (jnp.arange(tokens, dtype=jnp.int32) * 7 % arch.vocab).reshape(-1, 64)

    def loss(p):
        logits, _ = forward(arch, p, toks)
        return -jnp.mean(jax.nn.log_softmax(logits, -1)[..., 0])

    fwd, both = jax.jit(loss), jax.jit(jax.value_and_grad(loss))
    jax.block_until_ready((fwd(params), both(params)))
    t_fwd = t_both = float("inf")
    for _ in range(max(repeats, 5)):  # interleaved, best of each: robust to a drifting host load
        t0 = time.perf_counter()
        jax.block_until_ready(fwd(params))
        t1 = time.perf_counter()
        jax.block_until_ready(both(params))
        t_fwd, t_both = min(t_fwd, t1 - t0), min(t_both, time.perf_counter() - t1)
    return float(min(1.0, max(0.05, 2 * t_fwd / max(t_both - t_fwd, 1e-9))))


def host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate_device(quick: bool = False) -> tuple[DeviceSpec, dict]:
    """Measure the host's devices; returns the DeviceSpec and the raw measurements.
    `quick` (for tests): small sizes, 2 repeats, f32 matmul only, 2 collective sizes."""
    n_dev = len(jax.devices())
    reps = 2 if quick else 3
    mm = 256 if quick else 768
    raw: dict = {"num_devices": n_dev, "platform": jax.devices()[0].platform, "cpu_count": os.cpu_count()}
    for dt in ("f32", "bf16"):
        raw[f"matmul_{dt}_1dev"] = matmul_rate(mm, dt, 1, reps)
        raw[f"matmul_{dt}_all"] = matmul_rate(mm, dt, n_dev, reps)
        if quick:  # one dtype only; bf16 recorded at the f32 rate
            raw["matmul_bf16_1dev"], raw["matmul_bf16_all"] = raw["matmul_f32_1dev"], raw["matmul_f32_all"]
            break
    mb = (4 if quick else 32) * 2**20
    raw["membw_1dev"] = memory_bandwidth(mb, 1, reps)
    raw["membw_all"] = memory_bandwidth(mb // n_dev * 2, n_dev, reps)
    sizes = [2**16, 2**20] if quick else [2**18, 2**20, 2**22, 2**23]
    coll = collective_times(sizes, n_dev, reps) if n_dev > 1 else {"all_reduce": [], "all_gather": []}
    raw["collective_sizes"], raw["collective_times"] = sizes, coll
    if n_dev > 1:
        ar_alpha, ar_bw = fit_ring(sizes, coll["all_reduce"], n_dev, "all_reduce")
        ag_alpha, ag_bw = fit_ring(sizes, coll["all_gather"], n_dev, "all_gather")
    else:
        ar_alpha = ag_alpha = 1e-6
        ar_bw = ag_bw = raw["membw_1dev"]
    raw.update(all_reduce_alpha_s=ar_alpha, all_reduce_bw=ar_bw, all_gather_alpha_s=ag_alpha, all_gather_bw=ag_bw)
    layer_oh, step_oh = decode_overheads(reps, response_len=8 if quick else 32)
    raw.update(layer_overhead_s=layer_oh, decode_step_overhead_s=step_oh)
    raw["backward_efficiency"] = backward_efficiency(128 if quick else 512, repeats=reps)
    shared = jax.devices()[0].platform == "cpu"
    spec = DeviceSpec(
        name=f"{raw['platform']}-{n_dev}dev-measured", memory_bytes=host_memory_bytes() / n_dev,
        matmul_flops={"f32": raw["matmul_f32_1dev"], "bf16": raw["matmul_bf16_1dev"]},
        mem_bandwidth=raw["membw_1dev"], intra_node_bw=(ar_bw + ag_bw) / 2, inter_node_bw=(ar_bw + ag_bw) / 2,
        devices_per_node=n_dev, collective_latency_s=(ar_alpha + ag_alpha) / 2, layer_overhead_s=layer_oh,
        decode_step_overhead_s=step_oh, backward_efficiency=raw["backward_efficiency"],
        host_flops_cap={"f32": raw["matmul_f32_all"], "bf16": raw["matmul_bf16_all"]} if shared else None,
        host_bw_cap=raw["membw_all"] if shared else None, source="measured",
    )
    return spec, raw
