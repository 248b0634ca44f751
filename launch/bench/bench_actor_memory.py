"""Actor-worker memory and rollout time: optimizer offload on/off, and hybrid generation layout vs training layout.

    python launch/bench/bench_actor_memory.py --json OUT [--model tiny-random|smollm2-135m-instruct]
        [--train 1-4-2] [--generate 1-2] [--devices 8] [--prompts 8] [--max-new 32] [--repeats 3]

Everything runs through the real ``ActorRolloutRefWorker`` in this process (``--devices`` fake CPU devices).

* ``actor.offload_optimizer``: device bytes held between updates (all live arrays; the largest device's
  share) with the optimizer state offloaded vs on the devices, the bytes freed, and the wall time of one
  offload and one restore (median of ``--repeats``).
* ``placement.generate``: the actor's per-device parameter bytes in the training and the generation
  layout, the 3D-HybridEngine reshard times (training -> generation all-gather inside micro-DP groups,
  generation -> training local slice), and the wall time of ``generate_sequences`` (greedy, ``--prompts`` x
  ``--max-new``) on the generation layout (reshards included) vs on the training layout, same params.

Prints a table and writes JSON (``offload``, ``hybrid`` sections, machine and load).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--model", default="tiny-random",
                        help="tiny-random (a 4-layer 256-wide model) or a model path/name")
    parser.add_argument("--train", default="1-4-2", help="training p-t-d")
    parser.add_argument("--generate", default="1-2", help="generation p_g-t_g")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


ARGS = _args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={ARGS.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_hf import mesh as meshlib  # noqa: E402
from jaxrl_hf.controller import Batch  # noqa: E402
from jaxrl_hf.controller.worker import WorkerContext  # noqa: E402
from jaxrl_hf.workers import ActorRolloutRefWorker  # noqa: E402
from jaxrl_hf.workers.offload import HOST_MEMORY_KINDS  # noqa: E402

TINY = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=4,
            max_position_embeddings=512)


def config_for(args: argparse.Namespace, generate: tuple[int, int] | None, offload: bool) -> dict:
    p, t, d = (int(x) for x in args.train.split("-"))
    model = {"path": args.model, "seed": 0, **({"tiny": TINY} if args.model == "tiny-random" else {})}
    config = {
        "model": model,
        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 1, "offload_optimizer": offload,
                  "optim": {"lr": 1e-5}},
        "rollout": {"name": "jax", "n": 1, "response_length": args.max_new, "seed": 0},
        "placement": {"num_processes": 1, "devices_per_process": args.devices, "train": {"pp": p, "tp": t, "dp": d}},
    }
    if generate is not None:
        config["placement"]["generate"] = {"pp": generate[0], "tp": generate[1]}
    return config


def make_worker(config: dict) -> ActorRolloutRefWorker:
    context = WorkerContext("actor", "bench", 0, 1)
    worker = ActorRolloutRefWorker._instantiate(context, (copy.deepcopy(config), "actor_rollout"), {})
    worker.init_model()
    return worker


def live_bytes_per_device() -> dict[int, int]:
    """Device-memory bytes of every live (not deleted, not host-memory) array, per device id."""
    gc.collect()
    arrays = [a for a in jax.live_arrays()
              if not a.is_deleted() and getattr(a.sharding, "memory_kind", None) not in HOST_MEMORY_KINDS]
    return tree_bytes_per_device([a.sharding for a in arrays], arrays)


def tree_bytes_per_device(shardings: list, arrays: list) -> dict[int, int]:
    out: dict[int, int] = {}
    for sharding, x in zip(shardings, arrays):
        per_shard = int(np.prod(sharding.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize
        for device in sharding.addressable_devices:
            out[device.id] = out.get(device.id, 0) + per_shard
    return out


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def prompts(args: argparse.Namespace, vocab: int) -> Batch:
    rng = np.random.default_rng(0)
    width = 16
    ids, mask = np.zeros((args.prompts, width), np.int32), np.zeros((args.prompts, width), np.int32)
    for i in range(args.prompts):
        n = int(rng.integers(4, width + 1))
        ids[i, width - n:], mask[i, width - n:] = rng.integers(3, vocab, n), 1
    return Batch.from_dict({"prompts": ids, "prompt_mask": mask}, meta_info={"greedy": True, "n": 1})


def bench_offload(args: argparse.Namespace) -> dict:
    worker = make_worker(config_for(args, None, offload=True))
    offloaded = live_bytes_per_device()
    worker.state = worker.offload.restore(worker.state)
    on_device = live_bytes_per_device()
    restore_s, offload_s = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        worker.state = worker.offload.offload(worker.state)
        offload_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        worker.state = worker.offload.restore(worker.state)
        restore_s.append(time.perf_counter() - t0)
    worker.state = worker.offload.offload(worker.state)
    result = {"mode": worker.offload.mode, "freed_bytes_all_devices": worker.offload.freed_bytes,
              "max_device_bytes_offloaded": max(offloaded.values()),
              "max_device_bytes_on_device": max(on_device.values()),
              "offload_s": statistics.median(offload_s), "restore_s": statistics.median(restore_s)}
    del worker
    gc.collect()
    return result


def bench_hybrid(args: argparse.Namespace) -> dict:
    pg, tg = (int(x) for x in args.generate.split("-"))
    plain = make_worker(config_for(args, None, offload=False))
    hybrid = make_worker(config_for(args, (pg, tg), offload=False))
    layout = hybrid.layout
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), hybrid.state.params)
    train_bytes = meshlib.shard_bytes_per_device(layout.train_shardings, shapes)
    gen_bytes = meshlib.shard_bytes_per_device(layout.gen_shardings, shapes)
    batch = prompts(args, hybrid.model.config.vocab_size)
    a, b = hybrid.generate_sequences(batch), plain.generate_sequences(batch)  # compile both
    same = bool(np.array_equal(a["responses"], b["responses"]))
    tokens = int(a["response_mask"].sum())
    hybrid_s = timed(lambda: hybrid.generate_sequences(batch), args.repeats)
    plain_s = timed(lambda: plain.generate_sequences(batch), args.repeats)
    to_gen, to_train = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        gen = layout.to_generation(hybrid.state.params)
        to_gen.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hybrid.state = hybrid.state._replace(params=layout.to_training(gen))
        to_train.append(time.perf_counter() - t0)
    return {"train": args.train, "generate": layout.gen.label(), "generation_mesh": dict(layout.mesh.shape),
            "param_bytes_per_device_train": train_bytes, "param_bytes_per_device_generation": gen_bytes,
            "to_generation_s": statistics.median(to_gen), "to_training_s": statistics.median(to_train),
            "rollout_s_hybrid": hybrid_s, "rollout_s_train_layout": plain_s,
            "rollout_ratio_hybrid_over_train": hybrid_s / plain_s,
            "generated_tokens": tokens, "greedy_identical": same,
            "engine_compilations": {"hybrid": hybrid.engine.num_compilations,
                                    "train_layout": plain.engine.num_compilations}}


def main() -> None:
    args = ARGS
    offload = bench_offload(args)
    hybrid = bench_hybrid(args)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "devices": jax.device_count(),
               "backend": jax.default_backend(), "loadavg": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    mib = 1 << 20
    print(f"model={args.model} devices={args.devices} train={args.train} load={machine['loadavg']}")
    print("| optimizer offload | value |\n|---|---|")
    print(f"| mode | {offload['mode']} |")
    print(f"| freed (all devices) | {offload['freed_bytes_all_devices'] / mib:.2f} MiB |")
    print(f"| largest device, opt state on device | {offload['max_device_bytes_on_device'] / mib:.2f} MiB |")
    print(f"| largest device, opt state offloaded | {offload['max_device_bytes_offloaded'] / mib:.2f} MiB "
          f"({offload['max_device_bytes_offloaded'] / offload['max_device_bytes_on_device']:.2f}x) |")
    print(f"| offload / restore | {offload['offload_s'] * 1e3:.1f} ms / {offload['restore_s'] * 1e3:.1f} ms |")
    print(f"\n| hybrid layout {hybrid['train']} -> {hybrid['generate']} | value |\n|---|---|")
    print(f"| params per device, train / generation | {hybrid['param_bytes_per_device_train'] / mib:.2f} / "
          f"{hybrid['param_bytes_per_device_generation'] / mib:.2f} MiB |")
    print(f"| reshard to generation / back to training | {hybrid['to_generation_s'] * 1e3:.1f} / "
          f"{hybrid['to_training_s'] * 1e3:.1f} ms |")
    print(f"| rollout hybrid / train layout | {hybrid['rollout_s_hybrid']:.3f} / "
          f"{hybrid['rollout_s_train_layout']:.3f} s "
          f"({hybrid['rollout_ratio_hybrid_over_train']:.2f}x), {hybrid['generated_tokens']} tokens, "
          f"greedy identical: {hybrid['greedy_identical']} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "machine": machine, "offload": offload, "hybrid": hybrid}, fh, indent=2)


if __name__ == "__main__":
    main()
