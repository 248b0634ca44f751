"""A small real RL iteration on (fake) devices, to check the simulators against wall-clock time.

Self-contained pure-JAX decoder (the same layer shapes the simulators assume: MHA, SwiGLU, RMSNorm,
dense causal attention, untied LM head or a value head) with tensor parallelism over a 'tp' mesh
axis and data parallelism over 'dp' (GSPMD via NamedSharding), on a sub-mesh of the devices.
Per placement: every colocated set runs its models one after another in one thread, disjoint sets
run in parallel threads, stages are barriers — the execution model d_cost assumes.  Pipeline
parallelism is not exercised here (p = 1).
"""
from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxrl_hf.placement.dataflow import Dataflow, ModelArch, Workload


def init_params(arch: ModelArch, seed: int) -> dict[str, Any]:
    """Random f32 weights with the layout of `ModelArch` (per-layer arrays stacked on axis 0)."""
    L, h, f, V = arch.num_layers, arch.hidden, arch.ffn_hidden, arch.vocab
    kv = arch.num_kv_heads * arch.head_dim
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 10))

    def w(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jax.random.normal(next(ks), shape, jnp.float32) / np.sqrt(fan_in)

    return {"embed": w((V, h), 1), "wq": w((L, h, h), h), "wk": w((L, h, kv), h), "wv": w((L, h, kv), h),
            "wo": w((L, h, h), h), "w_gate": w((L, h, f), h), "w_up": w((L, h, f), h), "w_down": w((L, f, h), f),
            "norm1": jnp.ones((L, h)), "norm2": jnp.ones((L, h)), "norm_f": jnp.ones((h,)),
            "head": w((h, arch.head_width), h)}


def param_specs(params: dict[str, Any]) -> dict[str, P]:
    """Megatron-style TP: column-parallel q/k/v/gate/up and LM head, row-parallel o/down."""
    col, row = P(None, None, "tp"), P(None, "tp", None)
    specs = {"wq": col, "wk": col, "wv": col, "w_gate": col, "w_up": col, "wo": row, "w_down": row}
    return {k: specs.get(k, P(None, "tp") if k == "head" and params[k].shape[1] > 1 else P()) for k in params}


def _rms(x: jax.Array, g: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g


def _layer(arch: ModelArch, lp: dict[str, jax.Array], x: jax.Array, k_all: jax.Array, v_all: jax.Array,
           q_pos: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decoder layer on x [B, S, h] attending to k_all/v_all [B, T, g, hd] (positions < T)."""
    B, S, _ = x.shape
    a, g, hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
    y = _rms(x, lp["norm1"])
    q = (y @ lp["wq"]).reshape(B, S, a, hd)
    k = (y @ lp["wk"]).reshape(B, S, g, hd)
    v = (y @ lp["wv"]).reshape(B, S, g, hd)
    k_all = jax.lax.dynamic_update_slice(k_all, k, (0, q_pos[0], 0, 0))
    v_all = jax.lax.dynamic_update_slice(v_all, v, (0, q_pos[0], 0, 0))
    rep = a // g
    kk, vv = jnp.repeat(k_all, rep, axis=2), jnp.repeat(v_all, rep, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, kk) / np.sqrt(hd)
    mask = jnp.arange(k_all.shape[1])[None, :] <= q_pos[:, None]
    scores = jnp.where(mask[None, None], scores, -1e30)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), vv).reshape(B, S, -1)
    x = x + o @ lp["wo"]
    y = _rms(x, lp["norm2"])
    x = x + (jax.nn.silu(y @ lp["w_gate"]) * (y @ lp["w_up"])) @ lp["w_down"]
    return x, k_all, v_all


LAYER_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "norm1", "norm2")


def forward(arch: ModelArch, params: dict[str, Any], tokens: jax.Array, cache: tuple | None = None,
            start: jax.Array | int = 0) -> tuple[jax.Array, tuple]:
    """Logits (or values) [B, S, head_width] of `tokens` [B, S] written at positions start..start+S
    of the KV cache (allocated to S positions when `cache` is None)."""
    B, S = tokens.shape
    if cache is None:
        shape = (arch.num_layers, B, S, arch.num_kv_heads, arch.head_dim)
        cache = (jnp.zeros(shape), jnp.zeros(shape))
    x = params["embed"][tokens]
    q_pos = start + jnp.arange(S)

    def body(x, xs):
        lp, kc, vc = xs
        x, kc, vc = _layer(arch, lp, x, kc, vc, q_pos)
        return x, (kc, vc)

    x, new_cache = jax.lax.scan(body, x, ({k: params[k] for k in LAYER_KEYS}, *cache))
    return _rms(x, params["norm_f"]) @ params["head"], new_cache


def make_train_step(arch: ModelArch, lr: float = 1e-5) -> tuple[Callable, optax.GradientTransformation]:
    """Adam step on next-token cross-entropy (LM head) or value regression (value head)."""
    tx = optax.adam(lr)

    def loss_fn(params, tokens):
        out, _ = forward(arch, params, tokens)
        if arch.value_head:
            return jnp.mean((out[..., 0] - 1.0) ** 2)
        logp = jax.nn.log_softmax(out[:, :-1], -1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, tx


def make_infer(arch: ModelArch) -> Callable:
    """Per-token log-prob of the given tokens (LM head) or per-token values (value head)."""
    def infer(params, tokens):
        out, _ = forward(arch, params, tokens)
        if arch.value_head:
            return out[..., 0]
        return jnp.take_along_axis(jax.nn.log_softmax(out, -1), tokens[..., None], -1)[..., 0]
    return infer


def make_generate(arch: ModelArch, prompt_len: int, response_len: int) -> Callable:
    """Greedy decoding: prefill the prompt into a KV cache of prompt+response positions, then
    `response_len` single-token steps in a fori_loop."""
    total = prompt_len + response_len

    def generate(params, prompts):
        B = prompts.shape[0]
        shape = (arch.num_layers, B, total, arch.num_kv_heads, arch.head_dim)
        cache = (jnp.zeros(shape), jnp.zeros(shape))
        logits, cache = forward(arch, params, prompts, cache, 0)
        out = jnp.zeros((B, response_len), jnp.int32)
        tok = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)

        def step(i, carry):
            tok, cache, out = carry
            out = out.at[:, i].set(tok)
            logits, cache = forward(arch, params, tok[:, None], cache, prompt_len + i)
            return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache, out

        _, _, out = jax.lax.fori_loop(0, response_len, step, (tok, cache, out))
        return out

    return generate


@dataclasses.dataclass(frozen=True)
class MeasuredModel:
    """Where and how one model runs: a device sub-range and (t, d) for train/infer, t_g for generation."""

    name: str
    devices: tuple[int, int]
    t: int
    t_g: int | None = None


def _mesh(devs: Sequence[Any], t: int) -> Mesh:
    return Mesh(np.array(devs).reshape(len(devs) // t, t), ("dp", "tp"))


class _Runner:
    """Compiled ops of one model placed on its sub-mesh."""

    def __init__(self, arch: ModelArch, placed: MeasuredModel, ops: Sequence[Workload], seed: int):
        devs = jax.devices()[placed.devices[0]:placed.devices[1]]
        if len(devs) != placed.devices[1] - placed.devices[0]:
            raise ValueError(f"{placed.name}: devices {placed.devices} exceed the {len(jax.devices())} available")
        self.arch, self.ops = arch, ops
        mesh = _mesh(devs, placed.t)
        params = init_params(arch, seed)
        psh = {k: NamedSharding(mesh, s) for k, s in param_specs(params).items()}
        self.params = jax.device_put(params, psh)
        data = NamedSharding(mesh, P("dp", None))
        self.fns: dict[int, Callable[[], Any]] = {}
        rng = np.random.default_rng(seed)
        for i, wl in enumerate(ops):
            if wl.kind == "train":
                step, tx = make_train_step(arch)
                self.opt_state = jax.jit(tx.init)(self.params)
                toks = jax.device_put(rng.integers(0, arch.vocab, (wl.num_sequences, wl.seq_len)), data)
                fn = jax.jit(step, donate_argnums=(0, 1))

                def run(fn=fn, toks=toks):
                    self.params, self.opt_state, loss = fn(self.params, self.opt_state, toks)
                    return loss
            elif wl.kind == "infer":
                toks = jax.device_put(rng.integers(0, arch.vocab, (wl.num_sequences, wl.seq_len)), data)
                fn = jax.jit(make_infer(arch))

                def run(fn=fn, toks=toks):
                    return fn(self.params, toks)
            else:
                t_g = placed.t_g or placed.t
                gmesh = _mesh(devs, t_g)
                gsh = {k: NamedSharding(gmesh, s) for k, s in param_specs(params).items()}
                prompts = jax.device_put(rng.integers(0, arch.vocab, (wl.num_sequences, wl.prompt_len)),
                                         NamedSharding(gmesh, P("dp", None)))
                fn = jax.jit(make_generate(arch, wl.prompt_len, wl.response_len))
                reshard = jax.jit(lambda p: p, out_shardings=gsh)

                def run(fn=fn, prompts=prompts, reshard=reshard, same=(t_g == placed.t)):
                    return fn(self.params if same else reshard(self.params), prompts)
            self.fns[i] = run

    def run(self, i: int) -> None:
        jax.block_until_ready(self.fns[i]())


def measure_placement(dataflow: Dataflow, placed: Sequence[MeasuredModel], repeats: int = 3,
                      seed: int = 0) -> dict[str, float]:
    """Median wall time per stage of `dataflow` with the models placed as given.

    Models sharing a device range form a colocated set (run sequentially in one thread); distinct
    ranges must be disjoint and run in parallel threads.  One warm-up iteration compiles everything.
    """
    by_name = {m.name: m for m in placed}
    missing = [m for m in dataflow.model_names if m not in by_name]
    if missing:
        raise ValueError(f"measure_placement: models {missing} have no placement")
    ranges = sorted({m.devices for m in placed})
    for a, b in zip(ranges, ranges[1:]):
        if b[0] < a[1]:
            raise ValueError(f"measure_placement: device ranges {a} and {b} overlap without being equal")
    runners = {}
    for i, name in enumerate(dataflow.model_names):
        ops = [wl for _, wl in dataflow.ops_of(name)]
        runners[name] = _Runner(dataflow.model(name).arch, by_name[name], ops, seed + i)
    op_index = {name: 0 for name in runners}
    plan = []  # per stage: {range: [(runner, op idx)]}
    for stage in dataflow.stages:
        groups: dict[tuple[int, int], list] = {}
        for op in stage.ops:
            groups.setdefault(by_name[op.model].devices, []).append((runners[op.model], op_index[op.model]))
            op_index[op.model] += 1
        plan.append((stage.name, list(groups.values())))

    def run_stage(groups) -> float:
        def work(items):
            for r, i in items:
                r.run(i)
        threads = [threading.Thread(target=work, args=(g,)) for g in groups]
        t0 = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {name: [] for name, _ in plan}
    for rep in range(repeats + 1):
        for name, groups in plan:
            dt = run_stage(groups)
            if rep:
                times[name].append(dt)
    return {name: statistics.median(v) for name, v in times.items()}
