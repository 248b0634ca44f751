"""One rank of the vLLM TP=2 check (run by test_rollout_vllm_tp.py): a JAX process of a two-process program that
hosts one vLLM tensor-parallel rank (external_launcher) and feeds it only its shard of FSDP-sharded params.

Usage: python vllm_tp_worker.py RANK WORLD JAX_COORDINATOR TP OUT_JSON [CASE] (TP groups of TP consecutive
processes; CASE: a model of `_vllm_tp_case.CASES`, default dense)
Writes: greedy tokens and sampler log-probs before and after a weight update, and the sync's bytes and paths.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from _vllm_tp_case import CASES, OPTIONS, PAD, SAMPLING, perturbed, prompts, reference_params  # noqa: E402


def main() -> None:
    rank, world, coordinator, tp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
    config = CASES[sys.argv[6] if len(sys.argv) > 6 else "dense"]
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=world, process_id=rank,
                               initialization_timeout=120)
    from jaxrl_hf import mesh as meshlib
    from jaxrl_hf.models import param_shardings
    from jaxrl_hf.rollout.vllm_engine import VllmRolloutEngine
    from jaxrl_hf.rollout.vllm_tp import make_tp_group

    train = meshlib.TrainParallel(pp=1, tp=1, dp=world)
    mesh = meshlib.build_train_mesh(train, meshlib.ordered_devices())
    shardings = param_shardings(config, mesh, meshlib.get_rule_set("fsdp").params)  # ZeRO-3 over both processes

    def on_mesh(tree):
        return jax.tree.map(lambda ref, s: jax.make_array_from_callback(ref.shape, s, lambda i, r=ref: r[i]),
                            tree, shardings)

    params = on_mesh(reference_params(config))
    group = make_tp_group(tp)
    engine = VllmRolloutEngine(config, params, pad_token_id=PAD, eos_token_ids=config.eos_token_ids,
                               options={**OPTIONS, "tensor_parallel_size": tp}, tp_group=group)
    first = engine.last_sync_stats
    before = engine.generate(prompts(), SAMPLING)
    engine.set_params(on_mesh(perturbed(config=config)))
    after = engine.generate(prompts(), SAMPLING)
    record = {
        "rank": rank, "tp_rank": group.rank, "master_port": group.master_port, "fsdp_sharded": any(not x.is_fully_replicated for x in jax.tree.leaves(params)),
        "expected_shard_bytes": sum(int(np.prod(s)) * 4 for s in engine._tp_stream.shapes().values()),
        "sync_bytes": first.bytes_total, "sync_bytes_by_path": first.bytes_by_path,
        "second_sync_bytes": engine.last_sync_stats.bytes_total, "metrics": engine.sync_metrics(),
        "before": {"ids": before.response_ids.tolist(), "mask": before.response_mask.tolist(),
                   "logp": before.log_probs.tolist(), "prompt_ids": before.prompt_ids.tolist(),
                   "prompt_mask": before.prompt_mask.tolist()},
        "after": {"ids": after.response_ids.tolist(), "mask": after.response_mask.tolist(),
                  "logp": after.log_probs.tolist()},
    }
    with open(out, "w") as f:
        json.dump(record, f)
    engine.close()


if __name__ == "__main__":
    main()
