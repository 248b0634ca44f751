"""The actor update with glibc's default allocator vs the tunables that keep freed memory for reuse:

    python launch/bench/bench_host_malloc.py [--rows 4 --tokens 96 --dtype bfloat16 --calls 6 --rounds 2] [--json OUT]

Each side is a fresh process (glibc reads ``GLIBC_TUNABLES`` only when a process starts): ``system`` with the
variable removed, ``reuse`` with `jaxrl_hf.config.host_malloc.KEEP_FREED_MEMORY` (what ``placement.memory.host_malloc``
gives CPU worker processes). In each, one jitted forward + backward of the token log-likelihood of the model over
``[rows, tokens]`` (the default DAPO run's 4-row update mini-batch, unrolled layers as ``configs/dapo.yaml``),
compiled and run once, then ``--calls`` timed calls: the median seconds, and per call the minor page faults and
the system CPU seconds (``getrusage``), plus the process's peak RSS. The sides alternate for ``--rounds`` rounds;
the ratio is system / reuse of the medians, per round. Both sides compute the same numbers (the loss is checked
equal bit for bit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def child(args: argparse.Namespace) -> dict:
    """Time the update in this process (run with the allocator setting already in the environment)."""
    import dataclasses
    import resource
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrl_hf.models import load_pretrained
    from jaxrl_hf.models.forward import next_token_targets, token_log_probs_and_entropy

    lm = load_pretrained(args.model, dtype=args.dtype)
    config = dataclasses.replace(lm.config, scan_layers=False)
    ids = jnp.asarray(np.random.RandomState(0).randint(0, config.vocab_size, (args.rows, args.tokens)), jnp.int32)

    def loss(params):
        logp, _ = token_log_probs_and_entropy(params, config, ids, next_token_targets(ids), jnp.ones_like(ids),
                                              with_entropy=False)
        return -logp.mean()

    step = jax.jit(jax.value_and_grad(loss)).lower(lm.params).compile()
    value = float(jax.block_until_ready(step(lm.params))[0])
    times, faults, system = [], [], []
    for _ in range(args.calls):
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        jax.block_until_ready(step(lm.params))
        times.append(time.perf_counter() - start)
        after = resource.getrusage(resource.RUSAGE_SELF)
        faults.append(after.ru_minflt - before.ru_minflt)
        system.append(after.ru_stime - before.ru_stime)
    return {"loss": value, "median_s": statistics.median(times), "times_s": times,
            "minor_faults_per_call": statistics.median(faults), "system_s_per_call": statistics.median(system),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run_side(side: str, argv: list[str]) -> dict:
    from jaxrl_hf.config.host_malloc import ENV_GLIBC_TUNABLES, KEEP_FREED_MEMORY

    env = {k: v for k, v in os.environ.items() if k != ENV_GLIBC_TUNABLES}
    if side == "reuse":
        env[ENV_GLIBC_TUNABLES] = KEEP_FREED_MEMORY
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", *argv], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{side} side failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    passed = [f"--{k}={getattr(args, k)}" for k in ("model", "rows", "tokens", "dtype", "calls")]
    print(f"{platform.machine()} {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {args.model} {args.dtype} "
          f"update [{args.rows},{args.tokens}], {args.calls} calls per side")
    print("| round | allocator | median s | minor faults / call | system s / call | peak RSS GiB | system / reuse |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    rounds = []
    for r in range(1, args.rounds + 1):
        sides = {side: run_side(side, passed) for side in ("system", "reuse")}
        if sides["system"]["loss"] != sides["reuse"]["loss"]:
            raise SystemExit(f"round {r}: the losses differ: {sides['system']['loss']} vs {sides['reuse']['loss']}")
        ratio = sides["system"]["median_s"] / sides["reuse"]["median_s"]
        for side, res in sides.items():
            print(f"| {r} | {side} | {res['median_s']:.3f} | {res['minor_faults_per_call']:.0f} | "
                  f"{res['system_s_per_call']:.2f} | {res['peak_rss_gib']:.2f} | "
                  f"{f'{ratio:.2f}' if side == 'reuse' else ''} |", flush=True)
        rounds.append({"round": r, **sides, "system_over_reuse": ratio})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "machine": platform.machine(), "cpus": os.cpu_count(),
                       "rounds": rounds}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
