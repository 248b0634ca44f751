"""``launch/ablate.py``: the row table (each row adds exactly one mechanism; the last is the DAPO recipe) and the
summary it writes (mean and std over seeds of each run's final validation accuracy, JSON + PNG). The runs
themselves are ``jaxrl_hf.trainer.run`` (tested end to end in test_trainer_e2e.py)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import numpy as np

from jaxrl_hf.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ablate():
    spec = importlib.util.spec_from_file_location("ablate", os.path.join(REPO, "launch", "ablate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flat(config, prefix=""):
    out = {}
    for key, value in (dataclasses.asdict(config) if prefix == "" else config).items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_each_row_adds_one_mechanism_and_the_last_is_the_recipe():
    table = ablate().row_overrides()
    configs = [flat(load_config("dapo", overrides=overrides)) for overrides in table.values()]
    changed = [sorted(k for k in b if a[k] != b[k]) for a, b in zip(configs, configs[1:])]
    assert changed == [["algorithm.overlong_filter"], ["actor.clip_ratio_high"],
                       ["reward_model.overlong_buffer.enable"], ["actor.loss_agg_mode"],
                       ["algorithm.filter_groups.enable"]]
    naive, dapo, recipe = configs[0], configs[-1], flat(load_config("dapo"))
    assert naive["actor.clip_ratio_high"] == naive["actor.clip_ratio_low"] == 0.2
    assert naive["actor.loss_agg_mode"] == "seq-mean-token-mean" and not naive["algorithm.filter_groups.enable"]
    for key in ("actor.clip_ratio_high", "actor.loss_agg_mode", "reward_model.overlong_buffer.enable",
                "algorithm.filter_groups.enable"):
        assert dapo[key] == recipe[key], key


def test_summary_json_and_png(tmp_path):
    module = ablate()
    accs = {"naive_grpo": [0.1, 0.3, 0.2], "dynamic_sampling": [0.5, 0.4, 0.6]}
    rows = {}
    for name, values in accs.items():
        for seed, acc in enumerate(values):
            run_dir = tmp_path / name / f"seed{seed}"
            run_dir.mkdir(parents=True)
            records = [{"step": 0, "val-core/arithmetic/acc/mean@4": 0.0},
                       {"step": 30, "val-core/arithmetic/acc/mean@4": acc, "val-core/gsm8k/acc/mean@4": acc / 10}]
            (run_dir / "validation.jsonl").write_text("\n".join(json.dumps(r) for r in records))
            steps = [{"step": t, "actor/entropy": acc * t, "response_length/mean": 10.0 + t} for t in (1, 2, 3)]
            (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in steps[: 2 + (seed > 0)]))
            rows.setdefault(name, []).append({"seed": seed, "overrides": [], "run_dir": str(run_dir),
                                              "final_acc": module.final_accuracy(str(run_dir))})
    summary = module.summarize(rows)
    for row, values in zip(summary, accs.values()):
        np.testing.assert_allclose(row["mean"]["arithmetic"], np.mean(values))
        np.testing.assert_allclose(row["std"]["arithmetic"], np.std(values, ddof=1))
        np.testing.assert_allclose(row["mean"]["gsm8k"], np.mean(values) / 10)
        curve = [module.metric_curve(r["run_dir"], "actor/entropy") for r in row["runs"]]
        steps, means = module.mean_curve(curve)  # seed 0 stops at step 2: only steps every seed reached
        assert steps == [1, 2]
        np.testing.assert_allclose(means, [np.mean(values) * t for t in (1, 2)])
    module.plot(summary, str(tmp_path / "ablation.png"))
    module.plot_curves(summary, str(tmp_path / "curves.png"))
    for name in ("ablation.png", "curves.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_run_summarizes_only_the_finished_runs(tmp_path):
    """``--no-run``: the summary of a cut-off ablation covers the runs whose metrics reach total_steps, no others."""
    for seed, steps, acc in ((0, 3, 0.25), (1, 2, 0.75)):  # seed 1 stopped at step 2 of 3
        run_dir = tmp_path / "naive_grpo" / f"seed{seed}"
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps({"step": t, "actor/entropy": 1.0})
                                                         for t in range(1, steps + 1)))
        (run_dir / "validation.jsonl").write_text(json.dumps({"step": steps, "val-core/arithmetic/acc/mean@4": acc}))
    assert ablate().main(["--no-run", "--seeds", "3", "--rows", "naive_grpo", "--out", str(tmp_path),
                          "trainer.total_steps=3"]) == 0
    (row,) = json.loads((tmp_path / "ablation.json").read_text())["rows"]
    assert [r["seed"] for r in row["runs"]] == [0] and row["mean"] == {"arithmetic": 0.25}
    assert not (tmp_path / "naive_grpo" / "seed2").exists()


def test_a_run_counted_in_epochs_is_as_long_as_its_resolved_config_says(tmp_path):
    """``trainer.total_epochs`` without a step count: the length the run wrote into its config.yaml, unknown
    (never reached) before it started; an explicit step count is used as given."""
    mod = ablate()
    assert mod.run_length(str(tmp_path), None) == float("inf")
    (tmp_path / "config.yaml").write_text("trainer:\n  total_steps: 16\n  total_epochs: 1\n")
    assert mod.run_length(str(tmp_path), None) == 16 and mod.run_length(str(tmp_path), 7) == 7


def test_merge_carries_an_earlier_result_only_for_the_same_unfinished_run(tmp_path):
    """``--no-run --merge OLD``: a (row, seed) finished in OUT is read from OUT; one not finished takes OLD's result
    when OLD ran it with the same overrides (marked ``carried_from``), never when an override differs; the
    carried run has no metrics, so it stays out of the curves."""
    mod = ablate()
    out = tmp_path / "out"
    run_dir = out / "naive_grpo" / "seed0"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps({"step": t, "actor/entropy": 2.0 - t})
                                                     for t in (1, 2, 3)))
    (run_dir / "validation.jsonl").write_text(json.dumps({"step": 3, "val-core/arithmetic/acc/mean@4": 0.25}))
    base = mod.row_overrides()["naive_grpo"]

    def old_run(seed, lr):
        ov = [*base, f"rollout.seed={seed}", f"data.seed={seed}", f"trainer.seed={seed}", "trainer.total_steps=3",
              f"actor.optim.lr={lr}", f"trainer.run_dir=/elsewhere/seed{seed}"]  # (no trainer.overwrite: older)
        return {"seed": seed, "run_dir": f"/elsewhere/seed{seed}", "status": 0, "overrides": ov, "final_step": 3,
                "final_acc": {"arithmetic": 0.5 + seed / 10}}

    old = {"rows": [{"row": "naive_grpo", "runs": [old_run(0, "1e-5"), old_run(1, "1e-5"), old_run(2, "3e-5")]}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert mod.main(["--no-run", "--merge", str(tmp_path / "old.json"), "--seeds", "3", "--rows", "naive_grpo",
                     "--out", str(out), "trainer.total_steps=3", "actor.optim.lr=1e-5"]) == 0
    (row,) = json.loads((out / "ablation.json").read_text())["rows"]
    assert [(r["seed"], r["final_acc"]["arithmetic"], "carried_from" in r) for r in row["runs"]] == \
        [(0, 0.25, False), (1, 0.6, True)]  # seed 2 ran with another lr: not carried
    assert np.isclose(row["mean"]["arithmetic"], (0.25 + 0.6) / 2)
    curves = [c for c in (mod.metric_curve(r["run_dir"], "actor/entropy") for r in row["runs"]) if c]
    assert mod.mean_curve(curves) == ([1, 2, 3], [1.0, 0.0, -1.0])


def test_a_run_stopped_by_sigterm_or_ctrl_c_stops_the_ablation(tmp_path, monkeypatch):
    """A run that exits 75 (SIGTERM / first Ctrl-C, checkpoint saved) or 130 (second Ctrl-C) ends the ablation with
    that status instead of starting the next run."""
    import jaxrl_hf.trainer

    mod = ablate()
    for status in (75, 130):
        calls = []
        monkeypatch.setattr(jaxrl_hf.trainer, "run", lambda algo, preset=None, overrides=(): calls.append(1) or status)
        assert mod.main(["--seeds", "2", "--rows", "naive_grpo,clip_higher", "--out", str(tmp_path / str(status)),
                         "trainer.total_steps=3"]) == status
        assert calls == [1]
