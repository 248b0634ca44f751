"""launch/bench/bench_learning_vs_trl.py: our resolved config maps onto TRL GRPOConfig arguments that compute the
same thing, a setting TRL cannot express is refused, and the summary / table follow the per-seed curves.
Config loading only: no model, no Ray, no TRL."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "launch", "bench", "bench_learning_vs_trl.py")


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, os.path.join(REPO, "launch", "bench"))
    spec = importlib.util.spec_from_file_location("bench_learning_vs_trl", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("algo, loss_type, eps_high", [("grpo", "grpo", 0.2), ("dapo", "dapo", 0.28)])
def test_our_config_maps_to_matching_trl_arguments(bench, algo, loss_type, eps_high):
    args = bench.parse_args(["--algo", algo, "--steps", "7", "--prompts", "3", "--samples", "5",
                             "--response-length", "24", "--lr", "2e-5", "--warmup-steps", "2", "--val-size", "6",
                             "--eval-every", "3"])
    config = bench.load_our_config(args, seed=2)
    trl = bench.trl_kwargs_from_config(config, seed=2)
    # the values the command line asked for, on both sides
    assert (config.actor.optim.lr, trl["learning_rate"]) == (2e-5, 2e-5)
    assert (config.rollout.n, trl["num_generations"]) == (5, 5)
    assert trl["per_device_train_batch_size"] == 3 * 5 and config.data.train_batch_size == 3
    assert (config.rollout.response_length, trl["max_completion_length"]) == (24, 24)
    assert (config.rollout.temperature, trl["temperature"]) == (1.0, 1.0)
    assert (config.rollout.top_p, config.rollout.top_k) == (trl["top_p"], trl["top_k"]) == (1.0, 0)
    assert trl["loss_type"] == loss_type and config.actor.loss_agg_mode == {"grpo": "seq-mean-token-mean",
                                                                            "dapo": "token-mean"}[algo]
    low = config.actor.clip_ratio_low if config.actor.clip_ratio_low is not None else config.actor.clip_ratio
    assert trl["epsilon"] == low == 0.2 and trl["epsilon_high"] == pytest.approx(eps_high)
    assert trl["beta"] == 0.0 and not config.actor.use_kl_loss and not config.algorithm.use_kl_in_reward
    assert (config.actor.optim.warmup_steps, trl["warmup_steps"], trl["lr_scheduler_type"]) == (2, 2, "constant_with_warmup")
    assert trl["steps_per_generation"] == 1 and trl["num_iterations"] == 1 and trl["gradient_accumulation_steps"] == 1
    assert config.actor.ppo_mini_batch_size == config.data.train_batch_size and config.actor.ppo_epochs == 1
    assert trl["max_steps"] == config.trainer.total_steps == 7 and trl["seed"] == 2 and config.rollout.seed == 2
    assert trl["max_grad_norm"] == config.actor.grad_clip and trl["weight_decay"] == config.actor.optim.weight_decay
    assert trl["bf16"] is False and config.model.dtype == "float32"
    # the held-out evaluation: same rows source, n, sampling as training, at the same steps
    assert config.data.val_files == ["arithmetic"] and config.data.val_size == 6
    assert bench.val_settings(config) == {"n": 4, "greedy": False, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                          "response_length": 24}
    assert config.trainer.val_before_train and config.trainer.test_freq == 3
    assert bench.eval_steps(7, 3) == [0, 3, 6, 7] and bench.eval_steps(12, 4) == [0, 4, 8, 12]
    if algo == "dapo":  # what TRL cannot express is off on our side
        assert not config.algorithm.filter_groups.enable and not config.reward_model.overlong_buffer.enable


@pytest.mark.parametrize("override, needle", [
    ("actor.loss_agg_mode=seq-mean-token-sum", "loss_agg_mode"),
    ("actor.ppo_epochs=2", "one optimizer step"),
    ("algorithm.filter_groups.enable=true", "dynamic sampling"),
    ("actor.entropy_coeff=0.01", "entropy_coeff"),
])
def test_a_setting_trl_cannot_express_is_refused(bench, override, needle):
    args = bench.parse_args(["--algo", "grpo", "--steps", "4", "--ours-set", override])
    with pytest.raises(ValueError, match=needle):
        bench.trl_kwargs_from_config(bench.load_our_config(args))


def test_kl_loss_maps_to_beta(bench):
    args = bench.parse_args(["--steps", "4", "--ours-set", "actor.use_kl_loss=true",
                             "--ours-set", "actor.kl_loss_coef=0.04"])
    assert bench.trl_kwargs_from_config(bench.load_our_config(args))["beta"] == 0.04


def test_summary_and_table_over_seeds(bench):
    def seed(s, acc, wall):
        return {"seed": s, "eval_steps": [0, 4], "heldout_acc": acc, "eval_wall_s": wall, "wall_s": wall[-1]}

    ours = bench.summarise_side([seed(0, [0.1, 0.3], [10.0, 50.0]), seed(1, [0.2, 0.5], [12.0, 70.0])])
    trl = bench.summarise_side([seed(0, [0.1, 0.2], [20.0, 90.0]), seed(1, [0.1, 0.4], [20.0, 110.0])])
    assert ours["heldout_acc"] == pytest.approx([0.15, 0.4]) and ours["heldout_acc_std"] == pytest.approx([0.05, 0.1])
    assert ours["eval_wall_s"] == pytest.approx([11.0, 60.0]) and trl["heldout_acc"] == pytest.approx([0.1, 0.3])
    table = bench.format_table({"ours": ours, "trl": trl})
    assert "| 4 | 0.400 ± 0.100 | 0.300 ± 0.100 | 60 (60) | 100 (100) |" in table
    timed = bench.summarise_side([{**seed(0, [0.1, 0.3], [10.0, 50.0]), "eval_s": [2.0, 3.0]}])
    assert timed["train_wall_s"] == pytest.approx([8.0, 45.0]) and timed["eval_wall_s"] == pytest.approx([10.0, 50.0])
    with pytest.raises(ValueError, match="evaluated at"):
        bench.summarise_side([seed(0, [0.1, 0.2], [1.0, 2.0]), {**seed(1, [0.1], [1.0]), "eval_steps": [0]}])


def test_runs_of_other_seeds_merge_into_one_comparison(bench):
    """Seeds run in separate sessions (``--first-seed``) pool into one mean ± std per side (``--merge``); runs of
    other settings, or the same seed twice, are refused."""
    def run(seeds, curves, lr=1e-5):
        def side(offset):
            return bench.summarise_side([{"seed": s, "eval_steps": [0, 4], "heldout_acc": [c + offset, c + 0.1],
                                          "eval_wall_s": [0.0, 10.0], "wall_s": 12.0} for s, c in zip(seeds, curves)])
        return {"settings": {"algo": "grpo", "lr": lr, "seeds": seeds, "date": "x", "ours_overrides": [seeds[0]],
                             "trl_kwargs": {"seed": seeds[0]}, "hf_dir": "d"}, "ours": side(0.0), "trl": side(0.01)}

    merged = bench.merge_results([run([0], [0.1]), run([1, 2], [0.2, 0.3])])
    assert merged["settings"]["seeds"] == [0, 1, 2] and len(merged["ours"]["per_seed"]) == 3
    assert merged["ours"]["heldout_acc"] == pytest.approx([0.2, 0.3])
    assert merged["trl"]["heldout_acc"] == pytest.approx([0.21, 0.3])
    with pytest.raises(ValueError, match=r"differ in \['lr'\]"):
        bench.merge_results([run([0], [0.1]), run([1], [0.2], lr=2e-5)])
    with pytest.raises(ValueError, match="appears twice"):
        bench.merge_results([run([0], [0.1]), run([0], [0.2])])
    assert bench.parse_args(["--seeds", "1", "--first-seed", "2"]).first_seed == 2
