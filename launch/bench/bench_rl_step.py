"""One RL step's wall time split by stage, from a real run through Ray and the worker groups.

    python launch/bench/bench_rl_step.py --algo dapo --preset smoke --steps 4 [--json OUT] [key=value ...]
    python launch/bench/bench_rl_step.py --from-run runs/dapo_default [--json OUT]     # summarise an existing run

Runs ``launch/train.py``'s trainer for ``--steps`` steps (or reads ``RUN_DIR/metrics.jsonl``), drops the first
step (XLA compilation) and prints, per stage (``timing_s/<stage>``: gen, reward, old_log_prob, ref, values,
adv, update_critic, update_actor, ...), the mean seconds per step and its share of ``timing_s/step``, plus
tokens/s (``perf/throughput``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


OUTSIDE_STEP = ("step", "testing", "save_checkpoint")  # validation and checkpoints run after the step's clock


def summarise(records: list[dict], skip_first: int = 1) -> dict:
    """Mean per-stage seconds over the steps after the first ``skip_first`` (compilation) steps."""
    steady = [r for r in records if r["step"] > skip_first] or records
    stages = sorted({k[len("timing_s/"):] for r in steady for k in r if k.startswith("timing_s/")})
    mean = {s: sum(r.get(f"timing_s/{s}", 0.0) for r in steady) / len(steady) for s in stages}
    step = mean.get("step", 0.0)
    return {"steps_measured": [r["step"] for r in steady], "stage_mean_s": mean,
            "stage_share": {s: (v / step if step else 0.0) for s, v in mean.items() if s not in OUTSIDE_STEP},
            "tokens_per_s": sum(r.get("perf/throughput", 0.0) for r in steady) / len(steady),
            "response_length_mean": sum(r.get("response_length/mean", 0.0) for r in steady) / len(steady)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", default="dapo")
    parser.add_argument("--preset", default="smoke")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--from-run", default=None, help="summarise RUN_DIR/metrics.jsonl instead of running")
    parser.add_argument("--json", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.from_run:
        run_dir = args.from_run
    else:
        from jaxrl_hf.trainer import run

        run_dir = tempfile.mkdtemp(prefix="bench_rl_step_")
        status = run(args.algo, preset=args.preset, overrides=[f"trainer.run_dir={run_dir}", f"trainer.total_steps={args.steps}",
                                                                "trainer.save_freq=0", "trainer.val_before_train=false",
                                                                "trainer.test_freq=0", "data.val_files=[]", *args.overrides])
        if status != 0:
            return status
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    result = {"algo": args.algo, "preset": args.preset, "run_dir": run_dir, **summarise(records)}
    print(f"RL step time by stage ({args.algo}, steps {result['steps_measured']}, first step = compile, excluded)")
    print(f"{'stage':<18}{'mean s':>10}  share of step")
    for stage, secs in sorted(result["stage_mean_s"].items(), key=lambda kv: -kv[1]):
        share = ("100% (the step)" if stage == "step" else
                 f"{100 * result['stage_share'][stage]:.1f}%" if stage in result["stage_share"] else "(after the step)")
        print(f"{stage:<18}{secs:>10.3f}  {share}")
    print(f"tokens/s (prompt+response, per device): {result['tokens_per_s']:.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
