"""The optimizer update of one actor step (global-norm clip + AdamW + the skip on a non-finite gradient norm) over
a model's float32 master parameters, three ways (four where the CPU kernels run):

    python launch/bench/bench_optimizer_update.py [--model smollm2-135m-instruct] [--repeats 8] [--json OUT]
    python launch/bench/bench_optimizer_update.py --random-config qwen2.5-7b|CONFIG.json   # shapes only, no weights

- ``selects`` (the peer: `apply_update` of 2026-11-26's first change): the raw gradients go in, the selects of the
  new state against the old (``where(finite, new, old)`` over every parameter and moment) discard a non-finite
  update;
- ``apply_update`` (the current one): the update runs inside ``lax.cond(finite, update, identity)``, no selects;
- ``no skip`` (a floor, not a valid update: a NaN gradient would corrupt the state): clip + AdamW alone;
- ``fused`` (where the CPU kernels run: `workers.fused_adamw`): ``apply_update`` with the one-pass kernel in place
  of optax's update, as the train step runs it on one CPU device.
Each is one jitted program with the state donated, as in the train step; best and median of ``--repeats`` calls.
The optax variants must give bit-identical parameters and moments on finite gradients (checked); ``fused`` must
agree with them to float32 rounding (per leaf max |Δ| / max |value|, printed; checked ≤ 1e-5 after the
``repeats + 1`` updates), and ``apply_update`` must leave the state unchanged on NaN gradients (checked).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


def selects_update(state, grads, optimizer, optim):
    """``apply_update`` with the selects of new against old (the peer)."""
    from jaxrl_hf.workers.optim import learning_rate, set_learning_rate
    from jaxrl_hf.workers.train_step import TrainState

    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(grad_norm)
    lr = learning_rate(optim, state.step)
    updates, new_opt = optimizer.update(grads, set_learning_rate(state.opt_state, lr), state.params)
    new_params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
    return TrainState(jax.tree.map(keep, new_params, state.params), jax.tree.map(keep, new_opt, state.opt_state),
                      state.step + finite.astype(jnp.int32)), {"grad_norm": grad_norm}


def unchecked_update(state, grads, optimizer, optim):
    """Clip + AdamW with no skip on a non-finite norm: the floor."""
    from jaxrl_hf.workers.optim import learning_rate, set_learning_rate
    from jaxrl_hf.workers.train_step import TrainState

    lr = learning_rate(optim, state.step)
    updates, new_opt = optimizer.update(grads, set_learning_rate(state.opt_state, lr), state.params)
    return TrainState(optax.apply_updates(state.params, updates), new_opt, state.step + 1), {}


@jax.jit
def _fingerprint(leaf: jax.Array) -> jax.Array:
    """Two wrapping uint32 sums of a 32-bit leaf's bit patterns, the second weighted by position: computed where
    the leaf lives (a host copy and hash of a 1.5B-parameter state took minutes on the GPU machine)."""
    bits = jax.lax.bitcast_convert_type(leaf, jnp.uint32).reshape(-1)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) + jnp.uint32(1)
    return jnp.stack([bits.sum(dtype=jnp.uint32), (bits * weights).sum(dtype=jnp.uint32)])


def digests(tree) -> list[tuple[int, int]]:
    """A bit-pattern fingerprint of every leaf: bit-identity checks without keeping copies of a large state."""
    return [tuple(int(v) for v in np.asarray(_fingerprint(leaf))) for leaf in jax.tree.leaves(tree)]


def time_variant(fn, state, grads, repeats: int) -> tuple[dict, list[tuple[int, int]], Any]:
    """Best and median seconds of ``repeats`` donated calls ``fn(state, grads)`` (``state`` is consumed), the
    digests of the state after the first call and the state after the last."""
    step = jax.jit(fn, donate_argnums=(0,))
    state, _ = step(state, grads)
    jax.block_until_ready(state)
    first = digests(state)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, _ = step(state, grads)
        jax.block_until_ready(state)
        seconds.append(time.perf_counter() - start)
    return {"best_s": min(seconds), "median_s": statistics.median(seconds), "all_s": seconds}, first, state


def max_relative_difference(a, b) -> float:
    """The largest over the float leaves of two states of max |a - b| / max |b| (on the device, leaf by leaf)."""
    rel = jax.jit(lambda x, y: jnp.max(jnp.abs(x - y)) / jnp.maximum(jnp.max(jnp.abs(y)), 1e-30))
    return max(float(rel(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
               if jnp.issubdtype(x.dtype, jnp.floating) and x.size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--random-config", default=None,
                        help="random parameters of this architecture (a name of models/known_configs.py or a "
                             "config.json) instead of --model's weights")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from jaxrl_hf.config.schema import OptimConfig
    from jaxrl_hf.models import load_pretrained
    from jaxrl_hf.workers.fused_adamw import fused_update_for
    from jaxrl_hf.workers.optim import make_optimizer
    from jaxrl_hf.workers.train_step import apply_update, init_train_state

    if args.random_config:
        from jaxrl_hf.models.forward import init_params
        from jaxrl_hf.models.known_configs import known_decoder_config
        params, args.model = init_params(known_decoder_config(args.random_config)), args.random_config
    else:
        params = load_pretrained(args.model, dtype="float32").params
    n_params = sum(x.size for x in jax.tree.leaves(params))
    optim = OptimConfig(lr=1e-5, weight_decay=0.01)
    optimizer = make_optimizer(optim, 1.0)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(0), len(leaves))
    grads = treedef.unflatten([jax.random.normal(k, p.shape, jnp.float32) * 1e-3 for k, p in zip(keys, leaves)])

    fresh_state = lambda: init_train_state(jax.tree.map(jnp.copy, params), optimizer)  # noqa: E731
    variants = {"selects (before)": selects_update,
                "apply_update (now)": apply_update, "no skip (floor)": unchecked_update}
    fused = fused_update_for(optim, 1.0, params, None)
    if fused is not None:
        variants["fused (CPU kernel)"] = functools.partial(apply_update, fused=fused)
    rows, states, finals = {}, {}, {}
    for name, update in variants.items():
        rows[name], states[name], finals[name] = time_variant(
            functools.partial(update, optimizer=optimizer, optim=optim), fresh_state(), grads, args.repeats)
    for name in ("apply_update (now)", "no skip (floor)"):
        rows[name]["bit_identical_to_before"] = states[name] == states["selects (before)"]
    if fused is not None:
        row = rows["fused (CPU kernel)"]
        row["max_rel_diff_vs_apply_update"] = max_relative_difference(finals["fused (CPU kernel)"],
                                                                      finals["apply_update (now)"])
    kept = fresh_state()
    before = digests(kept)
    after, _ = jax.jit(functools.partial(apply_update, optimizer=optimizer, optim=optim))(
        kept, jax.tree.map(lambda g: g * jnp.nan, grads))
    rows["apply_update (now)"]["nan_grads_leave_state_unchanged"] = digests(after) == before

    peer = rows["selects (before)"]["median_s"]
    device = jax.devices()[0].device_kind
    print(f"optimizer update, {args.model} ({n_params / 1e6:.1f} M float32 params), {device} "
          f"({jax.default_backend()}), {os.cpu_count()} CPUs, jax {jax.__version__}; median of {args.repeats}")
    print("| variant | median s | best s | vs before | bit-identical to before |")
    print("|---|---:|---:|---:|---|")
    for name, row in rows.items():
        row["speedup_vs_before"] = peer / row["median_s"]
        same = row.get("bit_identical_to_before", "—")
        if "max_rel_diff_vs_apply_update" in row:
            same = f"max rel. diff {row['max_rel_diff_vs_apply_update']:.1e}"
        print(f"| {name} | {row['median_s']:.3f} | {row['best_s']:.3f} | {row['speedup_vs_before']:.2f}x | {same} |")
    print(f"NaN gradients leave the state unchanged: {rows['apply_update (now)']['nan_grads_leave_state_unchanged']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "params": n_params, "device": device, "cpus": os.cpu_count(),
                       "jax": jax.__version__, "rows": rows}, fh, indent=1)
    ok = all(rows[n]["bit_identical_to_before"] for n in ("apply_update (now)", "no skip (floor)"))
    ok = ok and rows.get("fused (CPU kernel)", {}).get("max_rel_diff_vs_apply_update", 0.0) <= 1e-5
    return 0 if ok and rows["apply_update (now)"]["nan_grads_leave_state_unchanged"] else 1


if __name__ == "__main__":
    sys.exit(main())
