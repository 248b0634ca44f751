"""Learning curve of our trainer vs TRL's GRPOTrainer on the same task: held-out accuracy at fixed steps.

    python launch/bench/bench_learning_vs_trl.py [--algo grpo|dapo] --seeds N --steps K --json OUT [--plot PNG]
    python launch/bench/bench_learning_vs_trl.py ... --seeds 1 --first-seed 2 --json OUT2   # one more seed
    python launch/bench/bench_learning_vs_trl.py --merge OUT OUT2 [--json MERGED] [--plot PNG]
    python launch/bench/bench_learning_vs_trl.py --from-json OUT [--plot PNG]     # re-print / re-plot
    python launch/bench/bench_learning_vs_trl.py --side trl --spec SPEC --json OUT   # one TRL seed (what the parent runs)

Both sides train SmolLM2-135M-Instruct (ours: ``model.path=smollm2-135m-instruct``; TRL: the HF directory it is
converted into) on the same arithmetic prompts (the rows our trainer loads, sequential sampler, fed to TRL in the
same order), with the same rule reward (``jaxrl_hf.rewards.compute_score``), group size, batch, lr / schedule,
clip, loss aggregation, no KL, response length, temperature, one optimizer step per RL step and float32 (or the
same bf16 mixed precision with ``--dtype bfloat16``). ``--algo dapo`` is the closest DAPO both can express:
token-mean loss + clip-higher (0.2 / 0.28); our dynamic sampling and overlong shaping are turned off (TRL has
neither). The settings are read from our resolved config and mapped to ``trl.GRPOConfig`` arguments by
``trl_kwargs_from_config``, which refuses anything it cannot map (``tests/test_bench_learning_vs_trl.py``).

Evaluation, identical on both sides: mean@``--val-n`` accuracy on the same ``--val-size`` held-out arithmetic
rows (the ones our validation loads for ``data.val_files=[arithmetic]``, written out and fed to TRL), sampled at
the training temperature / top-p / top-k with the training response length, at step 0 (before training), every
``--eval-every`` steps and at the last step. Ours: our trainer's own validation (``trainer.val_before_train``,
``trainer.test_freq``, ``rollout.val.*``), read from the run's ``validation.jsonl``. TRL: a ``TrainerCallback``
that generates with the trainer's own ``generation_config`` (``transformers.generate``) and scores with the same
scorer. ``eval_wall_s``: wall seconds at the end of each evaluation since the step-0 evaluation began (ours: a
thread watching ``validation.jsonl``; TRL: ``time.perf_counter`` in the callback); our side's includes XLA
compilation, TRL's the torch warm-up.

Seeds 0..N-1 change only the sampling seed (ours ``rollout.seed``, TRL ``seed``); prompts and held-out rows are
fixed. Each seed of each side is its own process, one after the other. Prints a markdown table (step, ours
mean ± std, TRL mean ± std over seeds) and writes everything to ``--json``; ``--plot`` draws accuracy vs step and
vs wall time (matplotlib). Reference: ``docs/LEARNING_VS_TRL.md``.
"""

from __future__ import annotations

import argparse
import copy
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
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

from bench_trl_grpo import (LoadSampler, bench_config_overrides, check_same_prompt_tokens,  # noqa: E402
                            rule_reward)

# our actor.loss_agg_mode -> TRL's loss_type computing the same aggregation (one micro-batch, one optimizer step)
LOSS_TYPE_OF_AGG = {"seq-mean-token-mean": "grpo", "token-mean": "dapo"}
DAPO_EPS_HIGH = 0.28


# ------------------------------------------------------------------------------------------ settings


def eval_steps(steps: int, every: int) -> list[int]:
    """Steps at which both sides evaluate: 0 (before training), every ``every`` steps, and the last step."""
    out = [0, *range(every, steps + 1, every)] if every > 0 else [0]
    return out if out[-1] == steps else [*out, steps]


def our_overrides(args: argparse.Namespace, seed: int) -> list[str]:
    """Dotted overrides of configs/<algo>.yaml for our side: bench_trl_grpo's GRPO-step config (model, prompts,
    batch, n, response length, temperature, one optimizer step, no KL, constant lr) plus the held-out
    validation, the seed and, for dapo, the DAPO loss with dynamic sampling / overlong shaping off."""
    step_args = argparse.Namespace(model=args.model, dtype=args.dtype, steps=args.steps, prompts=args.prompts,
                                   samples=args.samples, response_length=args.response_length, lr=args.lr, ours_set=[])
    out = [o for o in bench_config_overrides(step_args)
           if not o.startswith(("data.val_files=", "trainer.val_before_train=", "trainer.test_freq="))]
    out += ["data.val_files=[arithmetic]", f"data.val_size={args.val_size}", "trainer.val_before_train=true",
            f"trainer.test_freq={args.eval_every}", f"rollout.val.n={args.val_n}", "rollout.val.temperature=1.0",
            "rollout.val.top_p=1.0", "rollout.val.greedy=false", f"rollout.val.response_length={args.response_length}",
            f"rollout.seed={seed}", "data.seed=0", f"actor.optim.warmup_steps={args.warmup_steps}",
            "actor.optim.lr_scheduler=constant", "actor.optim.lr_warmup_steps_ratio=0.0"]
    if args.algo == "dapo":
        out += ["actor.loss_agg_mode=token-mean", "actor.clip_ratio_low=0.2", f"actor.clip_ratio_high={DAPO_EPS_HIGH}",
                "algorithm.filter_groups.enable=false", "reward_model.overlong_buffer.enable=false",
                "reward_model.reward_manager=naive", "data.gen_batch_size=null", "algorithm.overlong_filter=false"]
    return [*out, *args.ours_set]


def load_our_config(args: argparse.Namespace, seed: int = 0) -> Any:
    """Our resolved RunConfig for this benchmark (reads YAML only: no model, no data)."""
    from jaxrl_hf.config import load_config

    return load_config(args.algo, None, our_overrides(args, seed))


def trl_kwargs_from_config(config: Any, seed: int = 0) -> dict[str, Any]:
    """``trl.GRPOConfig`` arguments that compute what our resolved ``config`` computes; ``ValueError`` for a
    setting TRL cannot express (so the comparison never silently diverges)."""
    a, d, r, alg = config.actor, config.data, config.rollout, config.algorithm
    problems = []
    if alg.adv_estimator != "grpo":
        problems.append(f"algorithm.adv_estimator={alg.adv_estimator!r} (TRL: GRPO's group advantage only)")
    if a.loss_agg_mode not in LOSS_TYPE_OF_AGG:
        problems.append(f"actor.loss_agg_mode={a.loss_agg_mode!r} (mapped: {sorted(LOSS_TYPE_OF_AGG)})")
    if a.ppo_mini_batch_size != d.train_batch_size or a.ppo_epochs != 1:
        problems.append(f"one optimizer step per RL step needs actor.ppo_mini_batch_size == data.train_batch_size "
                        f"and ppo_epochs=1 (got {a.ppo_mini_batch_size}, {d.train_batch_size}, {a.ppo_epochs})")
    if a.use_kl_loss and a.kl_loss_type not in ("low_var_kl", "k3"):
        problems.append(f"actor.kl_loss_type={a.kl_loss_type!r} (TRL's beta term is k3 = low_var_kl)")
    if alg.use_kl_in_reward:
        problems.append("algorithm.use_kl_in_reward=true (TRL has no KL in the reward)")
    if alg.filter_groups.enable:
        problems.append("algorithm.filter_groups.enable=true (TRL has no dynamic sampling)")
    if config.reward_model.overlong_buffer.enable:
        problems.append("reward_model.overlong_buffer.enable=true (TRL has no overlong reward shaping)")
    if a.entropy_coeff != 0.0:
        problems.append(f"actor.entropy_coeff={a.entropy_coeff} (kept at 0 on both sides)")
    if a.optim.lr_scheduler != "constant":
        problems.append(f"actor.optim.lr_scheduler={a.optim.lr_scheduler!r} (mapped: constant)")
    if (a.optim.total_steps or config.trainer.total_steps) != config.trainer.total_steps:
        problems.append("actor.optim.total_steps differs from trainer.total_steps")
    if problems:
        raise ValueError("our config has settings TRL's GRPOTrainer cannot express: " + "; ".join(problems))
    eps_low = a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio
    eps_high = a.clip_ratio_high if a.clip_ratio_high is not None else eps_low
    warmup = a.optim.warmup_steps or int(a.optim.lr_warmup_steps_ratio * config.trainer.total_steps)
    return {
        "max_steps": config.trainer.total_steps,
        "per_device_train_batch_size": d.train_batch_size * r.n, "gradient_accumulation_steps": 1,
        "steps_per_generation": 1, "num_iterations": a.ppo_epochs, "num_generations": r.n,
        "max_completion_length": r.response_length or d.max_response_length,
        "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
        "beta": a.kl_loss_coef if a.use_kl_loss else 0.0,
        "loss_type": LOSS_TYPE_OF_AGG[a.loss_agg_mode],
        "scale_rewards": "group" if alg.norm_adv_by_std_in_grpo else "none",
        "epsilon": eps_low, "epsilon_high": eps_high,
        "learning_rate": a.optim.lr, "lr_scheduler_type": "constant_with_warmup" if warmup else "constant",
        "warmup_steps": warmup, "weight_decay": a.optim.weight_decay, "adam_beta1": a.optim.betas[0],
        "adam_beta2": a.optim.betas[1], "adam_epsilon": a.optim.eps, "max_grad_norm": a.grad_clip,
        "mask_truncated_completions": False, "bf16": config.model.dtype == "bfloat16", "fp16": False,
        "shuffle_dataset": False, "seed": seed,
    }


def val_settings(config: Any) -> dict[str, Any]:
    """Our validation's sampling settings, which the TRL callback uses as they are."""
    v, r = config.rollout.val, config.rollout
    return {"n": v.n, "greedy": v.greedy, "temperature": v.temperature, "top_p": v.top_p, "top_k": r.top_k,
            "response_length": v.response_length or r.response_length or config.data.max_response_length}


def matched_table(config: Any, trl_kwargs: dict[str, Any]) -> list[tuple[str, Any, str, Any]]:
    """(our key, our value, TRL argument, its value) of every matched setting (the doc's table)."""
    a, d, r = config.actor, config.data, config.rollout
    return [("data.train_batch_size x rollout.n", d.train_batch_size * r.n, "per_device_train_batch_size",
             trl_kwargs["per_device_train_batch_size"]),
            ("rollout.n", r.n, "num_generations", trl_kwargs["num_generations"]),
            ("rollout.response_length", r.response_length, "max_completion_length", trl_kwargs["max_completion_length"]),
            ("rollout.temperature", r.temperature, "temperature", trl_kwargs["temperature"]),
            ("rollout.top_p / top_k", (r.top_p, r.top_k), "top_p / top_k", (trl_kwargs["top_p"], trl_kwargs["top_k"])),
            ("actor.loss_agg_mode", a.loss_agg_mode, "loss_type", trl_kwargs["loss_type"]),
            ("actor.clip_ratio_low / high", (a.clip_ratio_low or a.clip_ratio, a.clip_ratio_high or a.clip_ratio),
             "epsilon / epsilon_high", (trl_kwargs["epsilon"], trl_kwargs["epsilon_high"])),
            ("actor.use_kl_loss", a.use_kl_loss, "beta", trl_kwargs["beta"]),
            ("actor.optim.lr", a.optim.lr, "learning_rate", trl_kwargs["learning_rate"]),
            ("actor.optim.warmup_steps, lr_scheduler", (a.optim.warmup_steps, a.optim.lr_scheduler),
             "warmup_steps, lr_scheduler_type", (trl_kwargs["warmup_steps"], trl_kwargs["lr_scheduler_type"])),
            ("actor.ppo_mini_batch_size, ppo_epochs", (a.ppo_mini_batch_size, a.ppo_epochs),
             "steps_per_generation, num_iterations", (trl_kwargs["steps_per_generation"], trl_kwargs["num_iterations"])),
            ("algorithm.norm_adv_by_std_in_grpo", config.algorithm.norm_adv_by_std_in_grpo, "scale_rewards",
             trl_kwargs["scale_rewards"]),
            ("actor.optim.weight_decay", a.optim.weight_decay, "weight_decay", trl_kwargs["weight_decay"]),
            ("actor.optim.betas, eps", (*a.optim.betas, a.optim.eps), "adam_beta1/2, adam_epsilon",
             (trl_kwargs["adam_beta1"], trl_kwargs["adam_beta2"], trl_kwargs["adam_epsilon"])),
            ("actor.grad_clip", a.grad_clip, "max_grad_norm", trl_kwargs["max_grad_norm"]),
            ("model.dtype", config.model.dtype, "bf16", trl_kwargs["bf16"])]


# ----------------------------------------------------------------------------------------------- ours


class FileWatcher:
    """Notes the wall time at which each new line of a jsonl file appears (polled every ``period_s``)."""

    def __init__(self, path: str, period_s: float = 0.2) -> None:
        self.path, self.period_s, self.times = path, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _count(self) -> int:
        try:
            with open(self.path) as fh:
                return sum(1 for line in fh if line.strip())
        except OSError:
            return 0

    def _loop(self) -> None:
        while True:
            n = self._count()
            while len(self.times) < n:
                self.times.append(time.perf_counter())
            if self._stop.wait(self.period_s):
                break

    def __enter__(self) -> "FileWatcher":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        n = self._count()
        while len(self.times) < n:
            self.times.append(time.perf_counter())


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def run_ours_seed(args: argparse.Namespace, seed: int, run_dir: str) -> dict:
    """One seed of our trainer (``launch/train.py`` in a subprocess); the held-out curve from validation.jsonl."""
    os.makedirs(run_dir, exist_ok=True)
    cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "--algo", args.algo,
           f"trainer.run_dir={run_dir}", *our_overrides(args, seed)]
    print(f"[ours seed {seed}] {' '.join(cmd)}", flush=True)
    val_path = os.path.join(run_dir, "validation.jsonl")
    if os.path.exists(val_path):
        os.remove(val_path)
    with LoadSampler() as load, FileWatcher(val_path) as watch:
        start = time.perf_counter()
        proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"bench_learning_vs_trl: our trainer exited with {proc.returncode} (run dir {run_dir})")
    records = read_jsonl(val_path)
    key = f"val-core/arithmetic/acc/mean@{args.val_n}"
    steps = [int(r["step"]) for r in records]
    acc = [float(r[key]) for r in records]
    origin = watch.times[0] - float(records[0].get("timing_s/testing", 0.0))
    eval_wall = [t - origin for t in watch.times[: len(records)]]
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    train = [{"step": m["step"], "reward_mean": m.get("critic/score/mean"), "response_length_mean":
              m.get("response_length/mean"), "entropy": m.get("actor/entropy"), "step_s": m.get("timing_s/step")}
             for m in metrics]
    return {"seed": seed, "eval_steps": steps, "heldout_acc": acc, "eval_wall_s": eval_wall,
            "eval_s": [float(r.get("timing_s/testing", 0.0)) for r in records], "wall_s": wall,
            "loadavg_1min": load.summary(), "train": train, "run_dir": run_dir}


# ------------------------------------------------------------------------------------------------ TRL


def run_trl_seed(spec: dict) -> dict:
    """One seed of TRL's GRPOTrainer with the held-out evaluation callback (run in its own process)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from jaxrl_hf.data import prompt_token_ids
    from jaxrl_hf.rewards import as_score_dict, compute_score

    torch.set_num_threads(os.cpu_count() or 1)
    rows, val_rows, hf_dir, val = spec["rows"], spec["val_rows"], spec["hf_dir"], spec["val"]
    check_same_prompt_tokens(rows, hf_dir)
    check_same_prompt_tokens(val_rows, hf_dir)
    kwargs = dict(spec["trl_kwargs"])
    torch.manual_seed(kwargs["seed"])
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    evals: list[dict] = []
    train_steps: list[dict] = []

    class HeldoutEval(TrainerCallback):
        """mean@n accuracy of the held-out rows at step 0 and the given steps, sampled with the trainer's own
        generation config (the training sampling settings; max_new_tokens = the held-out response length)."""

        trainer: Any = None

        def evaluate(self, step: int, model: Any) -> None:
            start = time.perf_counter()
            gen = copy.deepcopy(self.trainer.generation_config)
            gen.max_new_tokens = val["response_length"]
            if val["greedy"]:
                gen.do_sample = False
            else:
                gen.temperature, gen.top_p, gen.top_k = val["temperature"], val["top_p"], val["top_k"]
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            ids = [prompt_token_ids(r["prompt"], tokenizer) for r in val_rows for _ in range(val["n"])]
            width = max(len(x) for x in ids)
            input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
            was_training = model.training
            model.eval()
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bool(kwargs.get("bf16"))):
                out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=gen)
            if was_training:
                model.train()
            eos = set(self.trainer.eos_token_ids if isinstance(self.trainer.eos_token_ids, list)
                      else [self.trainer.eos_token_ids])
            accs = []
            for i, seq in enumerate(out[:, width:].tolist()):
                cut = next((j for j, t in enumerate(seq) if t in eos), len(seq))
                text = tokenizer.decode(seq[: cut + 1], skip_special_tokens=True)
                row = val_rows[i // val["n"]]
                accs.append(float(as_score_dict(compute_score(row["data_source"], text,
                                                              str(row["reward_model"]["ground_truth"])))["acc"]))
            now = time.perf_counter()
            evals.append({"step": step, "acc": statistics.fmean(accs), "eval_s": now - start,
                          "wall_s": now - self.t0})
            print(f"[trl] held-out step {step}: acc={evals[-1]['acc']:.3f} ({now - start:.1f} s)", flush=True)

        def on_train_begin(self, a: Any, state: Any, control: Any, model: Any = None, **k: Any) -> None:
            self.t0 = time.perf_counter()
            self.evaluate(0, model)

        def on_step_begin(self, a: Any, state: Any, control: Any, **k: Any) -> None:
            self.step_start = time.perf_counter()

        def on_step_end(self, a: Any, state: Any, control: Any, model: Any = None, **k: Any) -> None:
            train_steps.append({"step": state.global_step, "step_s": time.perf_counter() - self.step_start})
            if state.global_step in spec["eval_steps"]:
                self.evaluate(state.global_step, model)

    dataset = datasets.Dataset.from_list([{"prompt": r["prompt"], "ground_truth": str(r["reward_model"]["ground_truth"]),
                                           "data_source": r["data_source"]} for r in rows])
    out_dir = tempfile.mkdtemp(prefix="bench_learning_trl_")
    config = trl.GRPOConfig(output_dir=out_dir, use_vllm=False, use_cpu=True, report_to="none", logging_steps=1,
                            save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
                            **kwargs)
    callback = HeldoutEval()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=rule_reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[callback])
    callback.trainer = trainer
    with LoadSampler() as load:
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
    logs = {h["step"]: h for h in trainer.state.log_history if "reward" in h}
    for s in train_steps:
        log = logs.get(s["step"], {})
        s.update({"reward_mean": log.get("reward"), "response_length_mean": log.get("completions/mean_length"),
                  "entropy": log.get("entropy")})
    return {"seed": kwargs["seed"], "eval_steps": [e["step"] for e in evals], "heldout_acc": [e["acc"] for e in evals],
            "eval_wall_s": [e["wall_s"] for e in evals], "eval_s": [e["eval_s"] for e in evals], "wall_s": wall,
            "loadavg_1min": load.summary(), "train": train_steps,
            "engine": f"TRL {trl.__version__} GRPOTrainer (torch {torch.__version__}, transformers "
                      f"{transformers.__version__} generate)"}


def run_trl_seed_subprocess(spec: dict, seed: int, tmp: str) -> dict:
    spec_path, out = os.path.join(tmp, f"trl_spec_{seed}.json"), os.path.join(tmp, f"trl_{seed}.json")
    with open(spec_path, "w") as fh:
        json.dump(spec, fh)
    cmd = [sys.executable, os.path.abspath(__file__), "--side", "trl", "--spec", spec_path, "--json", out]
    print(f"[trl seed {seed}] {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bench_learning_vs_trl: the TRL side failed (exit {proc.returncode}): {' '.join(cmd)}")
    with open(out) as fh:
        return json.load(fh)


# ------------------------------------------------------------------------------------------- summary


def _mean_std(curves: list[list[float]]) -> tuple[list[float], list[float]]:
    cols = list(zip(*curves))
    return ([statistics.fmean(c) for c in cols], [statistics.pstdev(c) if len(c) > 1 else 0.0 for c in cols])


def summarise_side(per_seed: list[dict]) -> dict:
    """Mean / std over seeds of the held-out curve and of the wall seconds at each evaluation."""
    steps = per_seed[0]["eval_steps"]
    for s in per_seed:
        if s["eval_steps"] != steps:
            raise ValueError(f"seed {s['seed']} evaluated at {s['eval_steps']}, seed {per_seed[0]['seed']} at {steps}")
    acc, acc_std = _mean_std([s["heldout_acc"] for s in per_seed])
    wall, wall_std = _mean_std([s["eval_wall_s"] for s in per_seed])
    # the same clock less the evaluations' own seconds so far: training time alone (the two sides' evaluation
    # code differs: our trainer's validation vs this script's transformers.generate callback)
    train_wall, _ = _mean_std([[w - sum(s["eval_s"][: i + 1]) for i, w in enumerate(s["eval_wall_s"])]
                               if "eval_s" in s else s["eval_wall_s"] for s in per_seed])
    return {"eval_steps": steps, "heldout_acc": acc, "heldout_acc_std": acc_std, "eval_wall_s": wall,
            "eval_wall_s_std": wall_std, "train_wall_s": train_wall,
            "wall_s": statistics.fmean(s["wall_s"] for s in per_seed), "per_seed": per_seed}


def format_table(result: dict) -> str:
    o, t = result["ours"], result["trl"]
    n = len(o["per_seed"])
    lines = [f"| step | ours mean ± std (n={n}) | TRL mean ± std (n={len(t['per_seed'])}) | ours wall s (train only) "
             f"| TRL wall s (train only) |", "|---:|---:|---:|---:|---:|"]
    for i, step in enumerate(o["eval_steps"]):
        ow, tw = o.get("train_wall_s", o["eval_wall_s"]), t.get("train_wall_s", t["eval_wall_s"])
        lines.append(f"| {step} | {o['heldout_acc'][i]:.3f} ± {o['heldout_acc_std'][i]:.3f} | "
                     f"{t['heldout_acc'][i]:.3f} ± {t['heldout_acc_std'][i]:.3f} | {o['eval_wall_s'][i]:.0f} ({ow[i]:.0f}) | "
                     f"{t['eval_wall_s'][i]:.0f} ({tw[i]:.0f}) |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench_learning_vs_trl: matplotlib is not importable; no plot written", file=sys.stderr)
        return
    s = result["settings"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for side, label, color in (("ours", "jaxrl_hf", "tab:blue"), ("trl", "TRL GRPOTrainer", "tab:orange")):
        d = result[side]
        mean, std = d["heldout_acc"], d["heldout_acc_std"]
        lo, hi = [m - e for m, e in zip(mean, std)], [m + e for m, e in zip(mean, std)]
        train_wall = d.get("train_wall_s", d["eval_wall_s"])
        for ax, x in ((axes[0], d["eval_steps"]), (axes[1], [w / 60 for w in d["eval_wall_s"]]),
                      (axes[2], [w / 60 for w in train_wall])):
            ax.plot(x, mean, "o-", color=color, label=f"{label} (n={len(d['per_seed'])} seeds)")
            ax.fill_between(x, lo, hi, color=color, alpha=0.2)
    axes[0].set_xlabel("RL step")
    axes[1].set_xlabel("wall minutes since the step-0 evaluation began")
    axes[2].set_xlabel("the same, less the evaluations' own time (training only)")
    for ax in axes:
        ax.set_ylabel(f"held-out mean@{s['val_n']} accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{s['algo']}: SmolLM2-135M-Instruct, arithmetic, {s['prompts']} prompts x {s['samples']}, "
                 f"{s['response_length']} tokens, lr {s['lr']:g}, {s['dtype']}; {s['val_size']} held-out prompts")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def report(result: dict, json_out: str | None, png: str | None) -> int:
    s = result["settings"]
    print(f"\n{s['algo']}: held-out mean@{s['val_n']} accuracy on {s['val_size']} arithmetic prompts, "
          f"{s['steps']} steps, seeds {s['seeds']}")
    print(format_table(result))
    print(f"wall (s, mean over seeds): ours {result['ours']['wall_s']:.0f}, TRL {result['trl']['wall_s']:.0f}; "
          f"total {result.get('total_wall_s', 0):.0f}")
    if json_out:
        os.makedirs(os.path.dirname(os.path.abspath(json_out)), exist_ok=True)
        with open(json_out, "w") as fh:
            json.dump(result, fh, indent=1)
    if png:
        plot(result, png)
    return 0


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algo", choices=("grpo", "dapo"), default="grpo")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds FIRST..FIRST+N-1 (runs of separate "
                        "sessions, each a few seeds, combine with --merge)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eval-every", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per RL step")
    parser.add_argument("--samples", type=int, default=4, help="group size: rollout.n = TRL num_generations")
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--warmup-steps", type=int, default=0)
    parser.add_argument("--val-size", type=int, default=32, help="held-out prompts")
    parser.add_argument("--val-n", type=int, default=4, help="samples per held-out prompt (mean@N)")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                        help="an extra override of our side (must not break the match: it is re-checked)")
    parser.add_argument("--run-root", default=None, help="our run dirs go under it (default: a temporary directory)")
    parser.add_argument("--side", choices=("both", "trl"), default="both", help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--from-json", default=None, help="re-print / re-plot an earlier --json OUT")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="combine earlier --json OUTs of the same settings and other seeds into one (--json, --plot)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, metavar="PNG")
    args = parser.parse_args(argv)
    if args.samples < 2:
        parser.error("--samples must be >= 2 (GRPO normalises within a group)")
    return args


SEED_FREE_SETTINGS = ("seeds", "date", "ours_overrides", "trl_kwargs", "hf_dir")
"""Settings that may differ between runs that `merge_results` combines (the seed, and what derives from it)."""


def merge_results(results: list[dict]) -> dict:
    """One result from runs of the same settings over disjoint seeds: the per-seed curves pooled, each side
    summarised again. Runs of other settings (anything but `SEED_FREE_SETTINGS`) or a repeated seed are refused."""
    base = {k: v for k, v in results[0]["settings"].items() if k not in SEED_FREE_SETTINGS}
    seeds: list[int] = []
    for result in results:
        other = {k: v for k, v in result["settings"].items() if k not in SEED_FREE_SETTINGS}
        if other != base:
            differing = sorted(k for k in set(base) | set(other) if base.get(k) != other.get(k))
            raise ValueError(f"--merge: the runs' settings differ in {differing}")
        seeds += list(result["settings"]["seeds"])
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--merge: a seed appears twice among {seeds} (run other seeds with --first-seed)")
    settings = {**results[0]["settings"], "seeds": seeds}
    merged = {"settings": settings, "total_wall_s": sum(r.get("total_wall_s", 0.0) for r in results)}
    for side in ("ours", "trl"):
        merged[side] = summarise_side([s for r in results for s in r[side]["per_seed"]])
    return merged


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.merge:
        results = []
        for path in args.merge:
            with open(path) as fh:
                results.append(json.load(fh))
        return report(merge_results(results), args.json, args.plot)
    if args.from_json:
        with open(args.from_json) as fh:
            result = json.load(fh)
        for side in ("ours", "trl"):  # re-summarised from the per-seed curves (a file of an older version too)
            result[side] = summarise_side(result[side]["per_seed"])
        return report(result, args.json, args.plot)
    if args.side == "trl":
        with open(args.spec) as fh:
            out = run_trl_seed(json.load(fh))
        with open(args.json, "w") as fh:
            json.dump(out, fh)
        return 0

    from jaxrl_hf.models.pretrained import resolve_hf_dir
    from jaxrl_hf.trainer.data import load_split, load_tokenizer

    t_start = time.perf_counter()
    config = load_our_config(args)
    tokenizer = load_tokenizer(config.model.path)
    rows = load_split(config, "train", tokenizer)["arithmetic"][: args.steps * args.prompts]
    val_rows = load_split(config, "val", tokenizer)["arithmetic"]
    hf_dir = resolve_hf_dir(args.model)
    steps_at = eval_steps(args.steps, args.eval_every)
    trl0 = trl_kwargs_from_config(config, 0)
    settings = {"algo": args.algo, "model": args.model, "hf_dir": hf_dir, "steps": args.steps,
                "seeds": list(range(args.first_seed, args.first_seed + args.seeds)), "prompts": args.prompts, "samples": args.samples,
                "response_length": args.response_length, "lr": args.lr, "warmup_steps": args.warmup_steps,
                "dtype": args.dtype, "val_size": len(val_rows), "val_n": args.val_n, "eval_every": args.eval_every,
                "eval_steps": steps_at, "val": val_settings(config), "ours_overrides": our_overrides(args, 0),
                "trl_kwargs": trl0, "matched": [list(m) for m in matched_table(config, trl0)],
                "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                "train_rows": len(rows), "val_rows": val_rows}
    root = args.run_root or tempfile.mkdtemp(prefix="bench_learning_vs_trl_")
    ours, theirs = [], []
    for seed in settings["seeds"]:
        seed_config = load_our_config(args, seed)
        spec = {"rows": rows, "val_rows": val_rows, "hf_dir": hf_dir, "eval_steps": steps_at,
                "val": val_settings(seed_config), "trl_kwargs": trl_kwargs_from_config(seed_config, seed)}
        ours.append(run_ours_seed(args, seed, os.path.join(root, f"ours_{args.algo}_seed{seed}")))
        theirs.append(run_trl_seed_subprocess(spec, seed, root))
    result = {"settings": settings, "ours": summarise_side(ours), "trl": summarise_side(theirs),
              "total_wall_s": time.perf_counter() - t_start}
    if result["ours"]["eval_steps"] != result["trl"]["eval_steps"]:
        raise SystemExit(f"evaluation steps differ: ours {result['ours']['eval_steps']}, TRL {result['trl']['eval_steps']}")
    return report(result, args.json, args.plot)


if __name__ == "__main__":
    sys.exit(main())
