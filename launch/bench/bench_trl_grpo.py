"""One GRPO step with jaxrl_hf vs TRL's GRPOTrainer: same model, prompts, batch, reward and machine.

    python launch/bench/bench_trl_grpo.py [--steps 4] [--prompts 4] [--samples 4] [--response-length 32]
                                    [--model smollm2-135m-instruct] [--dtype float32|bfloat16] [--json OUT]
    python launch/bench/bench_trl_grpo.py --side trl ...     # only TRL (what the parent runs in a subprocess)
    python launch/bench/bench_trl_grpo.py --from-json OUT [--json OUT2]   # re-summarise a run's per-step data

Both sides run ``--steps`` GRPO steps of ``--prompts`` arithmetic prompts x ``--samples`` samples,
``--response-length`` new tokens at temperature 1, in ``--dtype`` (float32; bfloat16: our ``model.dtype`` and
TRL's ``bf16=True`` mixed precision, float32 master weights on both), one optimizer step per RL step (AdamW, same
lr / weight decay / grad clip, constant schedule), no KL term (beta = 0), GRPO's sequence-mean-token-mean
loss with group-std-normalised advantages, and the same rule reward (``jaxrl_hf.rewards.compute_score``).
The prompts are the rows our trainer loads (``data.train_size = steps x prompts``, sequential sampler),
fed to TRL in the same order as a ``datasets.Dataset`` with the same chat template (checked token by token).

* ours: ``launch/train.py``'s trainer (Ray single controller, JAX worker, native JAX generation engine);
  its per-stage clock is ``timing_s/<stage>`` in ``metrics.jsonl`` (``launch/bench/bench_rl_step.summarise``).
* TRL 1.16: ``GRPOTrainer`` on the HF directory the model is converted into, loaded with transformers
  ``AutoModelForCausalLM`` (float32), ``use_vllm=False`` (``transformers.generate``), run in a subprocess
  (its own torch runtime; ``torch.set_num_threads(os.cpu_count())``). Its stages are timed by wrapping
  ``_generate_single_turn`` (gen), ``_calculate_rewards`` (reward) and ``_generate_and_score_completions``
  (the rest of it: decode, padding, advantages = "other"); "update" is the remainder of the optimizer step
  (policy forward + backward + AdamW), measured from the trainer's on_step_begin to on_step_end.

The first step of each side is dropped (XLA compilation / torch warm-up). Prints a per-stage table of the
median over the remaining steps (the machine may be shared: a step slowed by another job should not carry
the result; means are in the JSON) with the ratio ours/TRL of seconds (> 1: ours slower) and of tokens/s
(prompt + response tokens per second of step time), the 1-minute load average sampled during each side,
and writes everything, per step, to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)

from bench_rl_step import summarise  # noqa: E402

STAGES = ("gen", "reward", "old_log_prob", "other", "update")
STAGE_NOTES = {"gen": "generation", "reward": "rule reward", "old_log_prob": "separate log-prob pass",
               "other": "advantages, batching, driver", "update": "fwd+bwd+AdamW"}


def bench_config_overrides(args: argparse.Namespace) -> list[str]:
    """Our config for the benchmark (dotted overrides on configs/grpo.yaml)."""
    micro = args.prompts * args.samples
    return [f"model.path={args.model}", f"model.dtype={args.dtype}",
            "data.train_files=[arithmetic]", f"data.train_size={args.steps * args.prompts}", "data.shuffle=false",
            f"data.train_batch_size={args.prompts}", f"data.max_response_length={args.response_length}",
            "data.val_files=[]", f"rollout.n={args.samples}", "rollout.temperature=1.0", "rollout.top_p=1.0",
            "rollout.top_k=0", f"actor.ppo_mini_batch_size={args.prompts}", f"actor.ppo_micro_batch_size_per_device={micro}",
            f"actor.log_prob_micro_batch_size_per_device={micro}", "actor.ppo_epochs=1", "actor.use_kl_loss=false",
            "actor.loss_agg_mode=seq-mean-token-mean", "actor.clip_ratio=0.2", "actor.entropy_coeff=0.0",
            "actor.grad_clip=1.0", f"actor.optim.lr={args.lr}", "actor.optim.warmup_steps=0",
            "actor.optim.lr_scheduler=constant", "actor.optim.weight_decay=0.01", "algorithm.norm_adv_by_std_in_grpo=true",
            f"trainer.total_steps={args.steps}", "trainer.save_freq=0", "trainer.val_before_train=false",
            "trainer.test_freq=0", "trainer.logger=[console,jsonl]", "trainer.progress_bar=false", *args.ours_set]


def bench_rows(args: argparse.Namespace) -> tuple[list[dict], str]:
    """The prompt rows our trainer trains on, in order, and the model's HF directory."""
    from jaxrl_hf.config import load_config
    from jaxrl_hf.models.pretrained import resolve_hf_dir
    from jaxrl_hf.trainer.data import load_split, load_tokenizer

    config = load_config("grpo", None, bench_config_overrides(args))
    rows = load_split(config, "train", load_tokenizer(config.model.path))["arithmetic"]
    return rows[: args.steps * args.prompts], resolve_hf_dir(args.model)


# ----------------------------------------------------------------------------------------------- ours


def run_ours(args: argparse.Namespace) -> dict:
    """``--steps`` GRPO steps through ``jaxrl_hf.trainer.run``; per-step stage seconds and tokens/s."""
    from jaxrl_hf.trainer import run

    run_dir = tempfile.mkdtemp(prefix="bench_trl_grpo_ours_")
    with LoadSampler() as load:
        start = time.perf_counter()
        status = run("grpo", overrides=[f"trainer.run_dir={run_dir}", *bench_config_overrides(args)])
        wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"bench_trl_grpo: our trainer exited with status {status} (run dir {run_dir})")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    steps = []
    for r in records:
        t = {k[len("timing_s/"):]: v for k, v in r.items() if k.startswith("timing_s/")}
        known = t.get("gen", 0.0) + t.get("reward", 0.0) + t.get("old_log_prob", 0.0) + t.get("update_actor", 0.0)
        steps.append({"step": r["step"], "step_s": t["step"], "gen_s": t.get("gen", 0.0), "reward_s": t.get("reward", 0.0),
                      "old_log_prob_s": t.get("old_log_prob", 0.0), "update_s": t.get("update_actor", 0.0),
                      "other_s": max(t["step"] - known, 0.0), "tokens": r["perf/total_num_tokens"],
                      "tokens_per_s": r["perf/total_num_tokens"] / t["step"],
                      "response_length_mean": r.get("response_length/mean"), "reward_mean": r.get("critic/score/mean")})
    return {"engine": "jaxrl_hf (JAX, Ray single controller, native JAX generation)", "run_dir": run_dir,
            "wall_s": wall, "loadavg_1min": load.summary(), "steps": steps, "timing_summary": summarise(records)}


# ------------------------------------------------------------------------------------------------ TRL


def rule_reward(prompts: list, completions: list, ground_truth: list, data_source: list, **_: Any) -> list[float]:
    """TRL reward function: our rule scorer on each completion's text (what our reward manager scores)."""
    from jaxrl_hf.rewards import as_score_dict, compute_score

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(as_score_dict(compute_score(src, text, truth))["score"])
            for src, text, truth in zip(data_source, texts, ground_truth)]


def check_same_prompt_tokens(rows: list[dict], hf_dir: str) -> list[int]:
    """Fail unless TRL's tokenizer (transformers) templates every prompt into our trainer's token ids;
    returns each row's prompt length in tokens."""
    from transformers import AutoTokenizer

    from jaxrl_hf.data import prompt_token_ids
    from jaxrl_hf.trainer.data import load_tokenizer

    ours, theirs = load_tokenizer(hf_dir), AutoTokenizer.from_pretrained(hf_dir)
    for i, row in enumerate(rows):
        a = prompt_token_ids(row["prompt"], ours)
        b = prompt_token_ids(row["prompt"], theirs)
        if a != b:
            raise SystemExit(f"bench_trl_grpo: prompt row {i} templates differently (ours {len(a)} tokens, "
                             f"transformers {len(b)}): the two sides would not see the same prompts")
    return [len(prompt_token_ids(row["prompt"], ours)) for row in rows]


def run_trl(args: argparse.Namespace, rows: list[dict], hf_dir: str) -> dict:
    """``--steps`` steps of TRL's GRPOTrainer configured like ours; per-step stage seconds and tokens/s."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    prompt_tokens = check_same_prompt_tokens(rows, hf_dir)
    timings: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    class TimedGRPOTrainer(trl.GRPOTrainer):
        """GRPOTrainer with wall clocks around generation, reward and generate-and-score."""

        def _generate_single_turn(self, *a: Any, **k: Any) -> Any:
            return timed("gen", super()._generate_single_turn)(*a, **k)

        def _calculate_rewards(self, *a: Any, **k: Any) -> Any:
            return timed("reward", super()._calculate_rewards)(*a, **k)

        def _generate_and_score_completions(self, *a: Any, **k: Any) -> Any:
            return timed("gen_and_score", super()._generate_and_score_completions)(*a, **k)

    steps: list[dict] = []

    class StepClock(TrainerCallback):
        """Wall time and tokens (prompt + completion, TRL's num_input_tokens_seen) of each optimizer step."""

        def on_step_begin(self, a: Any, state: Any, control: Any, **k: Any) -> None:
            timings.clear()
            self.start, self.tokens = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, a: Any, state: Any, control: Any, **k: Any) -> None:
            step_s = time.perf_counter() - self.start
            gen_score = timings.get("gen_and_score", 0.0)
            tokens = float(state.num_input_tokens_seen - self.tokens)
            steps.append({"step": state.global_step, "step_s": step_s, "gen_s": timings.get("gen", 0.0),
                          "reward_s": timings.get("reward", 0.0), "old_log_prob_s": 0.0,
                          "other_s": max(gen_score - timings.get("gen", 0.0) - timings.get("reward", 0.0), 0.0),
                          "update_s": max(step_s - gen_score, 0.0), "tokens": tokens, "tokens_per_s": tokens / step_s})

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "ground_truth": str(r["reward_model"]["ground_truth"]),
                                           "data_source": r["data_source"]} for r in rows])
    out_dir = tempfile.mkdtemp(prefix="bench_trl_grpo_trl_")
    config = trl.GRPOConfig(
        output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=args.prompts * args.samples,
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=args.samples, num_iterations=1,
        max_completion_length=args.response_length, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        loss_type="grpo", scale_rewards="group", epsilon=0.2, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
        use_vllm=False, bf16=args.dtype == "bfloat16", fp16=False, use_cpu=True, report_to="none", logging_steps=1,
        save_strategy="no", shuffle_dataset=False, seed=0, disable_tqdm=True, dataloader_num_workers=0,
        log_completions=False)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=rule_reward, args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepClock()])
    with LoadSampler() as load:
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    logs = {h["step"]: h for h in trainer.state.log_history if "reward" in h}
    for s in steps:
        s["response_length_mean"] = logs.get(s["step"], {}).get("completions/mean_length")
        s["reward_mean"] = logs.get(s["step"], {}).get("reward")
    return {"engine": f"TRL {trl.__version__} GRPOTrainer (torch {torch.__version__}, transformers "
                      f"{transformers.__version__} generate)", "hf_dir": hf_dir, "torch_threads": torch.get_num_threads(),
            "prompt_tokens": prompt_tokens,
            "wall_s": wall, "loadavg_1min": load.summary(), "steps": steps}


# ------------------------------------------------------------------------------------------- comparison


def steady_mean(side: dict, skip_first: int = 1) -> dict[str, Any]:
    """Per-stage seconds over the steps after the first ``skip_first`` (warm-up): the median (the headline,
    robust to a step slowed by other jobs on a shared machine; stage medians need not add up to the step's),
    the mean and the fastest step (the least disturbed one); tokens/s = median tokens / median step seconds
    (mean: total tokens / total seconds)."""
    steady = [s for s in side["steps"] if s["step"] > skip_first] or side["steps"]
    keys = ["step_s", *(f"{st}_s" for st in STAGES), "tokens"]
    out: dict[str, Any] = {k: statistics.median(s[k] for s in steady) for k in keys}
    out["tokens_per_s"] = out["tokens"] / out["step_s"]
    out["mean"] = {k: statistics.fmean(s[k] for s in steady) for k in keys}
    out["mean"]["tokens_per_s"] = sum(s["tokens"] for s in steady) / sum(s["step_s"] for s in steady)
    fastest = min(steady, key=lambda s: s["step_s"])
    out["fastest_step"] = {k: fastest[k] for k in ["step", "step_s", *(f"{st}_s" for st in STAGES), "tokens", "tokens_per_s"]}
    out["steps_measured"] = [s["step"] for s in steady]
    return out


class LoadSampler:
    """Samples the 1-minute load average every ``period_s`` while a side runs (the machine is shared)."""

    def __init__(self, period_s: float = 5.0) -> None:
        self.period_s, self.samples = period_s, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        """min / mean / max of the sampled 1-minute load averages."""
        return {"min": min(self.samples), "mean": statistics.fmean(self.samples), "max": max(self.samples)}


def compare(ours: dict, theirs: dict) -> dict[str, float | None]:
    """ours/TRL ratios of the median seconds per stage (> 1: ours slower) and of tokens/s (> 1: ours faster)."""
    out: dict[str, float | None] = {}
    for key in ["step_s", *(f"{st}_s" for st in STAGES)]:
        out[key] = ours[key] / theirs[key] if theirs[key] > 0 else None
    out["tokens_per_s"] = ours["tokens_per_s"] / theirs["tokens_per_s"] if theirs["tokens_per_s"] > 0 else None
    if "fastest_step" in ours and "fastest_step" in theirs:
        out["fastest_step_s"] = ours["fastest_step"]["step_s"] / theirs["fastest_step"]["step_s"]
    return out


def format_table(result: dict) -> str:
    """Markdown table: per stage median seconds of each side and the ratio ours/TRL."""
    o, t, r = result["ours"]["steady"], result["trl"]["steady"], result["ratio_ours_over_trl"]

    def ratio(x: float | None) -> str:
        return f"{x:.2f}" if x is not None else "—"

    lines = ["| stage (median of steady steps) | jaxrl_hf s | TRL s | ours/TRL |", "|---|---:|---:|---:|",
             f"| **step** | {o['step_s']:.3f} | {t['step_s']:.3f} | {ratio(r['step_s'])} |"]
    for st in STAGES:
        lines.append(f"| {st} ({STAGE_NOTES[st]}) | {o[f'{st}_s']:.3f} | {t[f'{st}_s']:.3f} | {ratio(r[f'{st}_s'])} |")
    if "fastest_step_s" in r:
        lines.append(f"| step, fastest steady step | {o['fastest_step']['step_s']:.3f} | {t['fastest_step']['step_s']:.3f} "
                     f"| {ratio(r['fastest_step_s'])} |")
    lines.append(f"| tokens / step | {o['tokens']:.0f} | {t['tokens']:.0f} | |")
    lines.append(f"| **tokens/s** | {o['tokens_per_s']:.1f} | {t['tokens_per_s']:.1f} | {ratio(r['tokens_per_s'])} |")
    return "\n".join(lines)


def format_steps(side: dict) -> str:
    """One line per step: seconds of the step and its stages, tokens, tokens/s."""
    return "\n".join(f"  step {s['step']}: {s['step_s']:.2f} s (gen {s['gen_s']:.2f}, update {s['update_s']:.2f}, "
                     f"old_log_prob {s['old_log_prob_s']:.2f}), {s['tokens']:.0f} tokens, {s['tokens_per_s']:.1f} tok/s"
                     for s in side["steps"])


def format_load(side: dict) -> str:
    """``min/mean/max`` of a side's sampled 1-minute load average."""
    load = side["loadavg_1min"]
    return f"{load['min']:.1f}/{load['mean']:.1f}/{load['max']:.1f}"


def run_trl_subprocess(args: argparse.Namespace, rows: list[dict], hf_dir: str) -> dict:
    """``run_trl`` in a fresh interpreter (its own torch runtime, away from the driver's JAX/Ray)."""
    tmp = tempfile.mkdtemp(prefix="bench_trl_grpo_")
    rows_path, out = os.path.join(tmp, "rows.json"), os.path.join(tmp, "trl.json")
    with open(rows_path, "w") as fh:
        json.dump({"rows": rows, "hf_dir": hf_dir}, fh)
    cmd = [sys.executable, os.path.abspath(__file__), "--side", "trl", "--rows", rows_path, "--json", out,
           "--steps", str(args.steps), "--prompts", str(args.prompts), "--samples", str(args.samples),
           "--response-length", str(args.response_length), "--lr", str(args.lr), "--model", args.model,
           "--dtype", args.dtype]
    proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bench_trl_grpo: the TRL side failed (exit {proc.returncode}): {' '.join(cmd)}")
    with open(out) as fh:
        return json.load(fh)["trl"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=("both", "ours", "trl"), default="both")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="known model name or an HF directory")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="compute dtype of both sides: ours model.dtype, TRL's bf16 mixed precision (autocast)")
    parser.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra config override of our side (repeatable), e.g. model.use_remove_padding=true")
    parser.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--from-json", default=None, help="re-summarise the per-step data of an earlier --json OUT")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for name in ("steps", "prompts", "response_length"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.samples < 2:
        parser.error(f"--samples must be >= 2 (GRPO normalises within a group), got {args.samples}")
    if args.from_json:
        with open(args.from_json) as fh:
            result = json.load(fh)
        return report(result, args.json)
    if args.rows:
        with open(args.rows) as fh:
            given = json.load(fh)
        rows, hf_dir = given["rows"], given["hf_dir"]
    else:
        rows, hf_dir = bench_rows(args)
    setup = {"algo": "grpo", "model": args.model, "hf_dir": hf_dir, "steps": args.steps, "prompts": args.prompts,
             "samples": args.samples, "response_length": args.response_length, "lr": args.lr, "dtype": args.dtype,
             "ours_set": args.ours_set,
             "kl": "none (beta=0)", "loss": "GRPO seq-mean-token-mean (TRL loss_type='grpo')",
             "optimizer_steps_per_rl_step": 1, "cpu_count": os.cpu_count(), "prompt_rows": len(rows)}
    result: dict[str, Any] = {"setup": setup}
    if args.side in ("both", "ours"):
        result["ours"] = run_ours(args)
    if args.side == "trl":
        result["trl"] = run_trl(args, rows, hf_dir)
    elif args.side == "both":
        result["trl"] = run_trl_subprocess(args, rows, hf_dir)
    return report(result, args.json)


def report(result: dict, json_out: str | None) -> int:
    """Summarise the measured steps of each side, print the per-step lines and the table, write the JSON."""
    for side in ("ours", "trl"):
        if side in result:
            result[side]["steady"] = steady_mean(result[side])
            print(f"{side}: {result[side]['engine']}\n{format_steps(result[side])}")
    if "ours" in result and "trl" in result:
        setup = result["setup"]
        result["ratio_ours_over_trl"] = compare(result["ours"]["steady"], result["trl"]["steady"])
        variant = " ".join([setup.get("dtype", "float32"), *setup.get("ours_set", [])])
        print(f"\nGRPO step, {setup['prompts']} prompts x {setup['samples']} samples, {setup['response_length']} new "
              f"tokens, {setup['model']} {variant}; median of steps {result['ours']['steady']['steps_measured']} "
              f"(step 1 = warm-up); 1-min load average min/mean/max: ours {format_load(result['ours'])}, "
              f"TRL {format_load(result['trl'])}")
        print(format_table(result))
    if json_out:
        with open(json_out, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
