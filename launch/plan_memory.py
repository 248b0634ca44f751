"""Will this run fit? Compile the actor's programs ahead of time for a topology you do not have (MaxText's
``train_compile.py``, for RL): no weights, no allocation, verl's keys as written.

    python launch/plan_memory.py --model qwen2.5-7b --devices 8 --json plan.json \\
        actor_rollout_ref.actor.strategy=fsdp data.max_prompt_length=1024 data.max_response_length=15360 ...
    python launch/plan_memory.py --model qwen2.5-32b --args-file configs/verl_recipes/dapo_qwen2.5_32b.args

Compiles ``update_actor`` (one optimizer step of the actor loss + AdamW over a mini-batch of micro-batches),
``log_prob`` (one log-prob micro-batch) and ``generate`` (one decode step with the KV cache, on the generation
layout) with ``jax.jit(...).lower(...).compile()`` on ``jax.ShapeDtypeStruct``s carrying ``NamedSharding``s, on
``--devices`` simulated XLA:CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count`` is set here, before
jax is imported). Prints a table and writes ``--json``: ``model``, ``num_params``, ``devices``,
``device_memory_bytes``, ``programs`` {``update_actor``, ``log_prob``, ``generate``} (each with
``peak_bytes_per_device`` = argument + output − alias + temp from ``compiled.memory_analysis()``,
``param_bytes_per_device``, ``optimizer_bytes_per_device``, ``resident_bytes_per_device``,
``total_bytes_per_device``, ``collectives``, ``cost_model``), ``fits`` (every program's total within the usable
share of ``--device-memory``), plus the layout, offload flags and what was done with each key.

Backend: XLA:CPU (no jax CUDA plugin is installed, so XLA:GPU deviceless compilation is not reachable). Params,
optimizer, argument and output bytes and the collectives are exact; temp bytes can differ on a GPU (other
fusions; cuDNN's fused attention where the plan compiles the blockwise one). See `jaxrl_hf.memory_plan.plan`.

Defaults (verl's, applied before the keys; `jaxrl_hf.memory_plan.plan.PLAN_DEFAULTS`): ``actor.strategy=fsdp``,
bf16 compute over float32 params, ``data.gen_batch_size`` = ``data.train_batch_size``, one sequence per device per
micro-batch. ``fits`` compares with JAX's share of ``--device-memory`` under the project's GPU memory budget
(``1 − placement.memory.margin``; less vLLM's share with ``rollout.name=vllm``). ``generate`` is compiled for the
decode batch whose KV cache fits that budget beside the weights and resident state (at most all rows of a
replica), as a continuous-batching engine would run it; ``waves`` says how many such rounds the rollout takes.

Keys: verl's spelling (``actor_rollout_ref.actor.X`` = ``actor.X``); see `jaxrl_hf.memory_plan.verl_keys` for which
are applied, mapped (``trainer.nnodes`` × ``n_gpus_per_node`` = devices, rollout ``tensor_model_parallel_size`` ->
generation tp, FSDP offload flags), ignored, or not modelled yet; a likely typo is an error naming the key.
Offload: ``fsdp_config.optimizer_offload`` keeps the Adam moments off the device outside ``update_actor`` (not
counted as resident in ``log_prob``/``generate``), as verl and ``actor.offload_optimizer`` do; every planned
program takes the params as an argument, so ``param_offload`` (which verl, too, undoes before each phase) changes
no count; ``ref.fsdp_config.param_offload`` keeps the reference copy (present with a KL term) off the device.
Exit status: 0 when the plan fits, 1 when it does not, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def read_args_file(path: str) -> list[str]:
    """The ``key=value`` words of a file, split and unquoted as a shell would (``data.truncation='left'`` is
    ``data.truncation=left``); ``#`` comments skipped."""
    try:
        return shlex.split(Path(path).read_text(encoding="utf-8"), comments=True)
    except (OSError, ValueError) as err:
        raise SystemExit(f"--args-file {path}: {err}")


def devices_from_keys(keys: list[str]) -> int | None:
    """``trainer.nnodes`` × ``trainer.n_gpus_per_node`` when either is among ``keys`` (read before jax loads)."""
    found = {}
    for text in keys:
        key, _, value = text.lstrip("+").partition("=")
        if key.strip() in ("trainer.nnodes", "trainer.n_gpus_per_node"):
            found[key.strip()] = value.strip()
    if not found:
        return None
    try:
        return int(found.get("trainer.nnodes", 1)) * int(found.get("trainer.n_gpus_per_node", 1))
    except ValueError:
        raise SystemExit(f"trainer.nnodes / trainer.n_gpus_per_node must be integers, got {found}")


def force_host_devices(devices: int) -> None:
    """Make XLA:CPU expose ``devices`` devices (replacing any count already in ``XLA_FLAGS``)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="qwen2.5-7b, qwen2.5-32b, llama3.1-8b, llama3.1-70b, qwen3-8b, "
                                                       "gemma2-9b, or a config.json (or a directory holding one)")
    parser.add_argument("--devices", type=int, help="devices of the run (default: trainer.nnodes × n_gpus_per_node)")
    parser.add_argument("--device-memory", default="80GiB", help="memory of one device (default 80GiB)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--algo", default="dapo", help="algorithm config the keys are layered on (default dapo)")
    parser.add_argument("--args-file", help="more verl keys, one key=value per line (# comments)")
    parser.add_argument("keys", nargs="*", help="verl keys as written, e.g. actor_rollout_ref.actor.strategy=fsdp")
    opts = parser.parse_args(argv)
    keys = (read_args_file(opts.args_file) if opts.args_file else []) + list(opts.keys)
    devices = opts.devices or devices_from_keys(keys)
    if not devices or devices < 1:
        parser.error("give --devices N (or trainer.nnodes and trainer.n_gpus_per_node)")
    force_host_devices(devices)
    sys.path.insert(0, str(ROOT))
    from jaxrl_hf.memory_plan import format_table, parse_bytes, plan_memory

    try:
        report = plan_memory(opts.model, devices, keys, parse_bytes(opts.device_memory), algo=opts.algo)
    except ValueError as err:
        print(f"plan_memory: {err}", file=sys.stderr)
        return 2
    print(format_table(report))
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0 if report["fits"] else 1


if __name__ == "__main__":
    sys.exit(main())
