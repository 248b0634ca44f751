"""One process of the two-process `jax.distributed` reshard check (run by test_mesh_multiprocess.py).

Usage: python mesh_multiprocess_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR_ADDRESS CONFIG...
Prints one JSON line per config: shard checks, round-trip identity, received bytes and whether
every all-gather replica group stays inside one process.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxrl_hf.mesh.device_mesh import ordered_devices  # noqa: E402
from jaxrl_hf.mesh.hybrid_engine import HybridEngine  # noqa: E402
from jaxrl_hf.mesh.synthetic import llama_logical_axes, llama_param_shapes, llama_shape, param_bytes  # noqa: E402
from jaxrl_hf.mesh.topology import micro_dp_groups, parse_config  # noqa: E402
from jaxrl_hf.mesh.transition_report import analyze_transition  # noqa: E402


def main() -> None:
    process_id, num_processes, address = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120)
    warnings.simplefilter("ignore")
    shape = llama_shape("tiny")
    axes = llama_logical_axes(shape)
    shapes = llama_param_shapes(shape, np.float32)
    rng = np.random.default_rng(1234)  # same seed in every process: identical global reference
    reference = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
    devices = ordered_devices()
    rank_of = {d.id: r for r, d in enumerate(devices)}
    process_of = {d.id: d.process_index for d in devices}
    for label in sys.argv[4:]:
        gen = parse_config(label)
        engine = HybridEngine(gen, axes, shapes, devices)
        train = jax.tree.map(lambda ref, sh: jax.make_array_from_callback(ref.shape, sh, lambda idx, r=ref: r[idx]),
                             reference, engine.train_shardings)
        gen_params = engine.to_generation(train)
        shards_ok = all(np.array_equal(np.asarray(s.data), ref[s.index])
                        for ref, arr in zip(jax.tree.leaves(reference), jax.tree.leaves(gen_params))
                        for s in arr.addressable_shards)
        train_again = engine.to_training(gen_params)
        round_trip = all(np.array_equal(np.asarray(s.data), ref[s.index])
                         for ref, arr in zip(jax.tree.leaves(reference), jax.tree.leaves(train_again))
                         for s in arr.addressable_shards)
        summary = analyze_transition(engine, shapes)  # every program of the (chunked) reshard
        groups = [[rank_of[d] for d in g] for g in summary.device_groups()]
        micro = [list(g) for g in micro_dp_groups(gen)]
        print(json.dumps({
            "config": label, "process": process_id, "num_devices": jax.device_count(),
            "local_devices": jax.local_device_count(), "shards_ok": shards_ok, "round_trip": round_trip,
            "kinds": sorted(summary.collective_kinds), "groups": sorted(groups), "micro_dp_groups": micro,
            "process_local": all(len({process_of[d] for d in g}) == 1 for g in summary.device_groups()),
            "bytes": summary.bytes_per_device, "param_bytes": param_bytes(shapes),
        }), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
