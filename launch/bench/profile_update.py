"""Where the actor update's time goes, by op: one ``update_actor`` call of `bench_packed_update.py`'s worker and
rows, traced by ``jax.profiler`` after two warm-up calls, its ops summed by name and by kind.

    python launch/bench/profile_update.py [--shape smollm2-135m|qwen2.5-1.5b] [--variant padded|packed] [--json OUT]

On a GPU the ops are the device's kernels (the trace's ``/device:GPU`` processes); on a CPU the XLA thunks of the
runtime's threads (``tf_XLA*``; Python's events and the runtime's wrapper events left out). Kinds, by the op's name:
``matmul`` (cuBLAS / cuBLASLt / XLA:CPU dot kernels), ``attention`` (cuDNN fused attention), ``copy`` (copies,
transposes, concatenations, slices), ``fusion`` (XLA's elementwise / reduction fusions), ``other``. Sums of
concurrent ops can exceed the wall time; the wall time of the traced call is printed beside them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_packed_update import SHAPES, VARIANTS, build  # noqa: E402

KINDS = (("attention", r"cudnn|fmha|flash|sdpa|attention"),
         ("matmul", r"gemm|nvjet|cutlass|cublas|xmma|ynn_fusion|dot_general|^dot|matmul"),
         ("copy", r"copy|memcpy|memset|transpose|concatenate|slice|gather|scatter"),
         ("fusion", r"fusion|convert|reduce|add|multiply|broadcast|select|exp"))
SKIP = re.compile(r"^\$|Thunk|Slinky|^end: |PjitFunction|ExecuteHelper|ProfileTrace")


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, name, re.IGNORECASE):
            return kind
    return "other"


def device_op_times(trace_dir: str) -> dict[str, list[float]]:
    """``{op name: [total µs, count]}`` of the traced ops (GPU kernels where the trace has a GPU, else CPU ops)."""
    path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]
    events = json.load(gzip.open(path))["traceEvents"]
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    gpu = {pid for pid, name in names.items() if "/device:GPU" in name}
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.get("ph") != "X" or SKIP.search(e.get("name", "")):
            continue
        if e.get("pid") not in gpu if gpu else "XLA" not in threads.get((e.get("pid"), e.get("tid")), ""):
            continue  # a GPU's kernels; on a CPU the XLA runtime's threads (not Python's)
        entry = totals[re.sub(r"[._]\d+$", "", e["name"]) if not gpu else e["name"]]
        entry[0] += float(e.get("dur", 0.0))
        entry[1] += 1
    return dict(totals)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--variant", default="padded", choices=VARIANTS)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    import jax

    worker, batch, lengths, _ = build(args.shape, args.variant)

    def update() -> float:
        t = time.perf_counter()
        worker.update_actor(batch)
        jax.block_until_ready(worker.state)
        return time.perf_counter() - t

    warm = [update(), update()]
    trace_dir = tempfile.mkdtemp(prefix="profile_update_")
    jax.profiler.start_trace(trace_dir)
    wall = update()
    jax.profiler.stop_trace()
    ops = device_op_times(trace_dir)
    total = sum(v[0] for v in ops.values())
    kinds: dict[str, float] = collections.defaultdict(float)
    for name, (us, _) in ops.items():
        kinds[kind_of(name)] += us
    print(f"{args.shape} {args.variant} on {jax.devices()[0].device_kind}: traced call {wall:.3f} s "
          f"(warm-up {warm[0]:.1f}, {warm[1]:.3f} s); op time {total / 1e6:.3f} s; real tokens {int(lengths.sum())}")
    print(f"\n{'kind':10s} {'ms':>9s} {'share':>6s}")
    for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{kind:10s} {us / 1e3:9.1f} {us / max(total, 1e-9):6.1%}")
    print(f"\n{'ms':>9s} {'calls':>6s}  op")
    top = sorted(ops.items(), key=lambda kv: -kv[1][0])[:args.top]
    for name, (us, count) in top:
        print(f"{us / 1e3:9.1f} {count:6d}  {name[:110]}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"shape": args.shape, "variant": args.variant, "device": jax.devices()[0].device_kind,
                       "wall_s": wall, "warmup_s": warm, "op_s": total / 1e6, "kinds_s": {k: v / 1e6 for k, v in kinds.items()},
                       "top": [{"op": n, "s": v[0] / 1e6, "calls": v[1]} for n, v in top]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
