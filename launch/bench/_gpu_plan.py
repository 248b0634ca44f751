"""The project's ahead-of-time memory plan of ``update_actor`` for the ``update`` section's variants, on XLA:CPU.

    JAX_PLATFORMS=cpu python launch/bench/_gpu_plan.py --out PLAN.json [--quick] VARIANT...

Runs beside the GPU work (started first by ``bench_gpu.py``, low priority): for each variant, the worker's own
config (`_gpu_update.worker_config`) through `jaxrl_hf.memory_plan.programs.ActorLayout` and
``update_actor_program`` on one CPU device, as ``launch/plan_memory.py`` plans a run, and XLA's memory analysis
(`jaxrl_hf.memory_plan.report.memory_stats`: ``peak_bytes_per_device`` = argument + output - alias + temp). No
reference copy (role ``actor_rollout``), so nothing else is resident during the update. ``auto`` attention
is planned as ``blockwise`` (`planned_attention`; XLA:CPU has no cuDNN: see `jaxrl_hf.memory_plan.plan`).
Each variant's result is written to ``--out`` as soon as it is compiled.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def planned_attention(name: str) -> str:
    """``auto`` (cuDNN's fused attention on the GPU) is planned as ``blockwise``, the nearest kernel XLA:CPU has
    (both O(T) memory; at T = 1024 keys XLA:CPU's own ``auto`` would take the [T, T] ``eager`` one)."""
    return "blockwise" if name in ("auto", "cudnn") else name


def plan_variant(variant: str, quick: bool) -> dict:
    import jax

    from _gpu_common import UPDATE_SHAPES, full_shapes
    from _gpu_update import worker_config
    from jaxrl_hf.memory_plan import programs as P
    from jaxrl_hf.memory_plan.report import memory_stats
    from jaxrl_hf.models.attention import resolve_implementation
    from jaxrl_hf.workers.common import tiny_decoder_config, worker_run_config

    shape = UPDATE_SHAPES["quick"] if quick else full_shapes()[0]
    config = worker_run_config(worker_config(shape, variant, 1.0))
    m = config.model
    decoder = tiny_decoder_config(m.tiny, m.dtype, m.remat,
                                  attn_implementation=planned_attention(m.attn_implementation))
    decoder = dataclasses.replace(decoder, scan_layers=m.scan_layers)
    layout = P.ActorLayout.build(config, decoder, jax.devices()[:1])
    program = P.update_actor_program(layout)
    stats = memory_stats(program.compiled)
    return {**stats, "param_bytes_per_device": program.param_bytes,
            "optimizer_bytes_per_device": program.optimizer_bytes, "compile_s": program.compile_s,
            "shapes": program.shapes, "backend": jax.default_backend(),
            "attention_planned": resolve_implementation(decoder.attn_implementation,
                                                        shape["prompt"] + shape["response"], decoder.dtype,
                                                        decoder.head_dim)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("variants", nargs="+")
    args = parser.parse_args()
    results: dict = {}
    done: dict = {}  # (planned attention, remat) -> the variant that planned it: the same program
    for variant in args.variants:
        t = time.perf_counter()
        _, attn, remat = variant.split("-")
        same = done.get((planned_attention(attn), remat))
        try:
            if same is not None:
                results[variant] = {**results[same], "same_program_as": same}
            else:
                results[variant] = {"status": "ok", **plan_variant(variant, args.quick)}
                done[(planned_attention(attn), remat)] = variant
        except Exception as err:
            results[variant] = {"status": "error", "error": f"{type(err).__name__}: {err}"[:2000],
                                "traceback": traceback.format_exc()[-4000:]}
        results[variant]["wall_s"] = time.perf_counter() - t
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1, default=str)
        os.replace(tmp, args.out)
        print(f"[bench_gpu plan] {variant}: {results[variant]['status']} in {results[variant]['wall_s']:.1f}s",
              flush=True)


if __name__ == "__main__":
    main()
