"""Preflight check of this machine for a run: ``python launch/doctor.py --algo dapo [--preset P] [key=value ...]``.

Prints what each library sees (JAX's backend and devices, torch's CUDA, vLLM's platform), the installed versions
and whether they fit together, memory per device, the GPU memory budget the config implies
(`jaxrl_hf.config.memory_budget`), what the worker processes' host allocator gets (`jaxrl_hf.config.host_malloc`)
and the Ray cluster's nodes and resources (``RAY_ADDRESS``, or ``--ray-local`` to start a local one). Exit status: 0 when the config can run here, 1 naming the first problem and its fix
(e.g. torch sees 8 GPUs but JAX only the CPU), 2 for a config error. ``--json PATH`` writes the report.
``launch/train.py`` runs the quick part (versions and ``nvidia-smi`` only) at every start.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, TextIO

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_hf.config.schema import ALGOS  # noqa: E402


def _gib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 2**30:.1f} GiB"


def format_report(report: dict[str, Any], budget: str, problems: list[Any], notes: list[str], out: TextIO,
                  host_malloc: str = "") -> None:
    """The human-readable report."""
    versions = report["versions"]
    print("versions:  " + ", ".join(f"{k} {v}" for k, v in versions.items() if v), file=out)
    missing = [k for k, v in versions.items() if not v]
    if missing:
        print("           not installed: " + ", ".join(missing), file=out)
    for note in notes:
        print(f"           differs from the tested GPU stack: {note}", file=out)
    gpus = report["nvidia_smi"]
    print(f"nvidia-smi: {len(gpus)} GPU(s)" + "".join(
        f"\n           {g['index']}: {g['name']}, {g['memory_mib']} MiB, driver {g['driver']}" for g in gpus), file=out)
    jax = report["jax"]
    print(f"JAX:       backend {jax['backend']}, {len(jax['devices'])} device(s): {', '.join(jax['devices'][:8])}"
          + (" ..." if len(jax["devices"]) > 8 else ""), file=out)
    if any(b is not None for b in jax["bytes_limit"]):
        print("           memory limit per device: " + ", ".join(_gib(b) for b in jax["bytes_limit"]), file=out)
    else:
        print(f"           host devices share the host's {_gib(report['host_memory'])}", file=out)
    torch = report["torch"]
    if "error" in torch:
        print(f"torch:     not importable ({torch['error']})", file=out)
    else:
        print(f"torch:     {torch['version']}, CUDA {torch['cuda'] or 'none (CPU build)'}, "
              f"{len(torch['devices'])} GPU(s) visible", file=out)
        for d in torch["devices"]:
            print(f"           {d['device']}: {_gib(d['free'])} free of {_gib(d['total'])}", file=out)
    vllm = report["vllm"]
    print(f"vLLM:      {vllm.get('platform') or 'import failed: ' + vllm.get('error', '?')}", file=out)
    ray = report["ray"]
    if "nodes" in ray:
        print(f"Ray:       {ray['address']}: {ray['resources']}", file=out)
        for node in ray["nodes"]:
            print(f"           node {node}", file=out)
    else:
        print(f"Ray:       {ray['cluster']}", file=out)
    print(budget, file=out)
    if host_malloc:
        print(host_malloc, file=out)
    if problems:
        print(f"PROBLEM:   {problems[0].what}\n  fix:     {problems[0].fix}", file=out)
        for other in problems[1:]:
            print(f"  also:    {other}", file=out)
    else:
        print("OK:        this config can run here", file=out)


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", choices=ALGOS, default="dapo")
    parser.add_argument("--preset", default=None)
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE_OR_MODULE")
    parser.add_argument("--vllm", action="store_true",
                        help="import vLLM and report its platform also with rollout.name=jax")
    parser.add_argument("--ray-local", action="store_true", help="start a local Ray (no RAY_ADDRESS) and report it")
    parser.add_argument("--json", default=None, help="also write the report as JSON to this path")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    from jaxrl_hf.config import ConfigError, load_config
    from jaxrl_hf.config.host_malloc import describe_host_malloc
    from jaxrl_hf.config.memory_budget import memory_budget
    from jaxrl_hf.trainer.preflight import full_facts
    from jaxrl_hf.trainer.preflight_checks import find_problems, version_notes

    try:
        config = load_config(args.algo, args.preset, list(args.overrides), imports=list(args.imports))
    except ConfigError as err:
        print(f"config error: {err}", file=out)
        return 2
    facts, report = full_facts(config, probe_vllm_anyway=args.vllm, start_local_ray=args.ray_local)
    budget = memory_budget(config)
    problems = find_problems(facts, config)
    format_report(report, budget.describe(), problems, version_notes(facts), out,
                  describe_host_malloc(config.placement.memory.host_malloc, os.environ))
    if args.json:
        report.update(budget=budget.env(), problems=[str(p) for p in problems], device=config.trainer.device,
                      host_malloc=config.placement.memory.host_malloc)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2, default=str)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
