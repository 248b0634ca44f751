"""Config system: YAML layers, dotted overrides with type coercion, errors naming the key, batch arithmetic."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from jaxrl_hf.config import ALGOS, ConfigError, config_from_dict, load_config, load_config_with_report, valid_keys
from jaxrl_hf.config.dry_run import dry_run
from jaxrl_hf.config.schema import ActorConfig, RunConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("algo", ALGOS)
def test_every_algorithm_config_loads_with_and_without_smoke(algo):
    plain = load_config(algo) if algo != "safe_rlhf" else None
    smoke = load_config(algo, preset="smoke")
    assert smoke.model.path == "tiny-random" and smoke.trainer.total_steps == 2
    assert smoke.rollout.response_length == smoke.data.max_response_length
    if plain is not None:
        assert plain.model.path == "smollm2-135m-instruct"
        assert plain.trainer.run_dir == f"runs/{algo}"


def test_algorithm_yaml_values_reach_the_config():
    dapo = load_config("dapo")
    assert dapo.actor.clip_ratio_high == 0.28 and dapo.actor.clip_ratio_low == 0.2
    assert dapo.algorithm.filter_groups.enable and dapo.reward_model.overlong_buffer.enable
    assert dapo.actor.loss_agg_mode == "token-mean" and not dapo.actor.use_kl_loss
    ppo = load_config("ppo")
    assert ppo.critic.enable and ppo.algorithm.adv_estimator == "gae" and ppo.algorithm.use_kl_in_reward
    assert load_config("gspo").actor.policy_loss.loss_mode == "gspo"


def test_dapo_is_verl_recipe_and_the_laptop_layer_sizes_only_the_laptop_models():
    """configs/dapo.yaml holds verl's DAPO recipe; configs/laptop/dapo.yaml resizes it for the default model and
    the smoke model only; the dry run names the file each value came from."""
    cluster = load_config_with_report("dapo", overrides=["model.path=Qwen/Qwen2.5-32B"], check_paths=False)[0]
    assert (cluster.data.train_batch_size, cluster.data.gen_batch_size, cluster.rollout.n) == (512, 1536, 16)
    assert (cluster.data.max_response_length, cluster.reward_model.overlong_buffer.len) == (20480, 4096)
    assert cluster.actor.optim.lr == pytest.approx(1e-6) and cluster.actor.optim.weight_decay == pytest.approx(0.1)
    assert cluster.actor.ppo_mini_batch_size == 32 and cluster.actor.use_dynamic_bsz and cluster.model.scan_layers
    laptop = load_config("dapo")
    assert (laptop.data.train_batch_size, laptop.rollout.n, laptop.data.max_response_length) == (4, 4, 32)
    assert laptop.reward_model.overlong_buffer.len == 8 and not laptop.model.scan_layers
    assert not laptop.actor.use_dynamic_bsz and laptop.actor.clip_ratio_high == 0.28  # the recipe's own choices
    forced = load_config_with_report("dapo", overrides=["model.path=Qwen/Qwen2.5-32B"], check_paths=False,
                                     laptop=True)[0]
    assert forced.data.train_batch_size == 4 and load_config("dapo", laptop=False).data.train_batch_size == 512
    out = io.StringIO()
    assert dry_run("dapo", overrides=["rollout.n=8"], out=out) == 0
    text = out.getvalue()
    assert "#   data.train_batch_size: configs/dapo.yaml <- configs/laptop/dapo.yaml" in text
    assert "#   rollout.n: configs/dapo.yaml <- configs/laptop/dapo.yaml <- override 'rollout.n=8'" in text
    out = io.StringIO()
    assert dry_run("dapo", overrides=["model.path=Qwen/Qwen2.5-32B"], out=out) == 0
    assert "#   data.train_batch_size: configs/dapo.yaml\n" in out.getvalue() and "laptop" not in out.getvalue()


def test_overrides_are_coerced_to_field_types():
    cfg = load_config("grpo", overrides=[
        "actor.optim.lr=1e-6", "rollout.n=8", "trainer.logger=[console]", "actor.use_kl_loss=false",
        "actor.optim.betas=[0.9, 0.95]", "trainer.max_ckpt_to_keep=null", "data.train_batch_size=16",
        "custom_reward_function.reward_kwargs.scale=2",
    ])
    assert cfg.actor.optim.lr == pytest.approx(1e-6) and isinstance(cfg.actor.optim.lr, float)
    assert cfg.rollout.n == 8 and cfg.trainer.logger == ["console"] and cfg.actor.use_kl_loss is False
    assert cfg.actor.optim.betas == [0.9, 0.95] and cfg.trainer.max_ckpt_to_keep is None
    assert cfg.custom_reward_function.reward_kwargs == {"scale": 2}


def test_verl_aliases_map_to_sections():
    cfg = load_config("dapo", overrides=["actor_rollout_ref.actor.clip_ratio_high=0.3",
                                         "actor_rollout_ref.rollout.n=2", "trainer.total_training_steps=7",
                                         "actor_rollout_ref.actor.ppo_micro_batch_size_per_device=2"])
    assert cfg.actor.clip_ratio_high == 0.3 and cfg.rollout.n == 2 and cfg.trainer.total_steps == 7
    assert cfg.actor.optim.total_steps == 7  # derived default follows


def test_packing_and_dynamic_batch_keys_follow_verl():
    """verl's spellings load; the log-prob and critic passes inherit the actor's switch and budget unless set; a
    partial ``critic.model`` takes the rest (path included) from ``model``."""
    cfg = load_config("ppo", preset="smoke", overrides=[
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=96",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=200",
        "critic.forward_max_token_len_per_gpu=300", "critic.model.use_remove_padding=False"])
    assert cfg.model.use_remove_padding and cfg.actor.use_dynamic_bsz
    assert (cfg.rollout.log_prob_use_dynamic_bsz, cfg.rollout.log_prob_max_token_len_per_gpu) == (True, 96)
    assert (cfg.ref.log_prob_use_dynamic_bsz, cfg.ref.log_prob_max_token_len_per_gpu) == (True, 200)
    critic = cfg.critic
    budgets = (critic.ppo_max_token_len_per_gpu, critic.forward_max_token_len_per_gpu)
    assert critic.use_dynamic_bsz and budgets == (96, 300)
    assert cfg.critic.model.path == "tiny-random" and cfg.critic.model.tiny == cfg.model.tiny
    assert not cfg.critic.model.use_remove_padding
    plain = load_config("grpo", preset="smoke")
    assert not (plain.model.use_remove_padding or plain.actor.use_dynamic_bsz or plain.rollout.log_prob_use_dynamic_bsz)
    # by tokens, the row count per micro-batch is unused: no divisibility error for it
    load_config("grpo", preset="smoke", overrides=["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=80",
                                                   "actor.ppo_micro_batch_size_per_device=3"])


@pytest.mark.parametrize("overrides, fragments", [
    (["actor.use_dynamic_bsz=true"], ["'actor.ppo_max_token_len_per_gpu'=None", "actor.use_dynamic_bsz=True", "80"]),
    (["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=79"],
     ["'actor.ppo_max_token_len_per_gpu'=79", "smaller than one row", "= 80 tokens"]),
    (["rollout.log_prob_use_dynamic_bsz=true", "rollout.log_prob_max_token_len_per_gpu=64"],
     ["'rollout.log_prob_max_token_len_per_gpu'=64", "smaller than one row"]),
    (["algorithm.adv_estimator=gae", "critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=512",
      "critic.forward_max_token_len_per_gpu=8"], ["'critic.forward_max_token_len_per_gpu'=8", "smaller than one row"]),
])
def test_token_budgets_are_checked(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        load_config("ppo" if "algorithm.adv_estimator=gae" in overrides else "grpo", preset="smoke",
                    overrides=overrides)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("override, fragments", [
    ("actor.clip_ratio_hgih=0.3", ["actor.clip_ratio_hgih", "valid keys under 'actor'", "clip_ratio_high"]),
    ("trainr.total_steps=3", ["trainr", "valid keys at the top level", "trainer"]),
    ("rollout.n=abc", ["rollout.n", "expected an int", "abc"]),
    ("actor.loss_agg_mode=mean", ["actor.loss_agg_mode", "token-mean", "seq-mean-token-sum"]),
    ("actor.optim.lr.x=1", ["actor.optim.lr", "is a value, not a section"]),
    ("trainer.save_freq", ["not of the form key.path=value"]),
    ("trainer.val_before_train=maybe", ["trainer.val_before_train", "bool"]),
])
def test_bad_overrides_name_the_key(override, fragments):
    with pytest.raises(ConfigError) as err:
        load_config("dapo", overrides=[override])
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("overrides, fragments", [
    (["data.train_batch_size=8", "actor.ppo_mini_batch_size=3"],
     ["actor.ppo_mini_batch_size'=3", "train_batch_size=8", "multiple"]),
    (["actor.ppo_mini_batch_size=2", "rollout.n=3", "actor.ppo_micro_batch_size_per_device=4"],
     ["ppo_micro_batch_size_per_device'=4", "6 sequences per dp rank"]),
    (["placement.devices_per_process=2", "placement.train.dp=2", "actor.ppo_mini_batch_size=1", "rollout.n=3"],
     ["3 sequences must split evenly over placement.train.dp=2"]),
    (["placement.devices_per_process=4", "placement.train.dp=2"], ["pp*tp*dp=2", "devices_per_process=4"]),
    (["rollout.n=1", "actor.ppo_micro_batch_size_per_device=1"], ["rollout.n'=1", "grpo", "n >= 2"]),
    (["reward_model.overlong_buffer.len=500"], ["overlong_buffer.len'=500", "max_response_length=32"]),
    (["trainer.resume_mode=resume_path"], ["trainer.resume_from_path", "resume_path"]),
    (["data.train_files=[/nope/x.parquet]"], ["data.train_files", "/nope/x.parquet", "no such file"]),
    (["model.path=/nope/model"], ["model.path", "/nope/model"]),
    (["trainer.logger=[console, mlflow]"], ["trainer.logger", "mlflow", "tensorboard"]),
    (["trainer.export_hf_max_shard_size=5 gigs"], ["trainer.export_hf_max_shard_size='5 gigs'", "5GB"]),
    (["trainer.export_hf_dtype=int8"], ["trainer.export_hf_dtype", "bfloat16"]),
])
def test_semantic_checks_name_the_keys(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        load_config("dapo", overrides=overrides)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_algorithm_requirements():
    with pytest.raises(ConfigError, match="needs a critic"):
        load_config("ppo", overrides=["critic.enable=false"])
    with pytest.raises(ConfigError, match="cost_model.path"):
        load_config("safe_rlhf")  # a cost model directory must be given
    with pytest.raises(ConfigError, match="--algo ppo uses GAE"):
        load_config("ppo", overrides=["algorithm.adv_estimator=grpo", "rollout.n=2"])


def test_presets_and_yaml_files_are_checked(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"unknown preset 'smok'; available presets: \[.*'smoke'"):
        load_config("dapo", preset="smok")
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  clip_ratio_hihg: 0.3\n")
    with pytest.raises(ConfigError) as err:
        load_config("dapo", preset=str(bad))
    assert str(bad) in str(err.value) and "actor.clip_ratio_hihg" in str(err.value)
    # presets stack left to right; overrides win over presets
    cfg = load_config("dapo", preset="smoke,dp2", overrides=["rollout.n=4"])
    assert cfg.placement.train.dp == 2 and cfg.rollout.n == 4 and cfg.model.path == "tiny-random"


def test_round_trip_through_a_dict():
    cfg = load_config("ppo", preset="smoke")
    again = config_from_dict(cfg.to_dict())
    assert again == cfg
    assert valid_keys(ActorConfig)[:2] == ["ppo_mini_batch_size", "ppo_micro_batch_size_per_device"]
    assert set(valid_keys(RunConfig)) >= {"data", "actor", "rollout", "critic", "algorithm", "trainer", "placement"}


def test_cli_reports_bad_key_and_exits_2():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "launch", "train.py"), "--algo", "grpo",
                           "--preset", "smoke", "actor.clip_ratio_hgih=0.3"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert "actor.clip_ratio_hgih" in proc.stderr and "clip_ratio_high" in proc.stderr


def test_tensor_parallel_size_must_split_the_heads_at_config_time():
    """The tiny model's 4 attention heads and 2 key/value heads cannot go over 4 tensor-parallel devices: refused
    when the config is loaded (naming the key, the head counts and the valid sizes), before any process starts."""
    with pytest.raises(ConfigError) as err:
        load_config("grpo", preset="smoke", overrides=["placement.devices_per_process=4", "placement.train.tp=4",
                                                       "placement.train.dp=1"])
    message = str(err.value)
    assert "config key 'placement.train.tp'=4" in message and "4 attention heads and 2 key/value heads" in message
    assert "valid: [1, 2]" in message
    config = load_config("grpo", preset="smoke", overrides=["placement.devices_per_process=4", "placement.train.tp=2",
                                                            "placement.train.dp=2"])
    assert config.placement.train.tp == 2


VLLM_TP2 = ["rollout.name=vllm", "placement.num_processes=2", "placement.devices_per_process=1",
            "placement.train.dp=2", "actor.strategy=fsdp"]


def test_vllm_tensor_parallel_layouts_at_config_time():
    """vLLM's TP size (verl's rollout.tensor_model_parallel_size = placement.generate.tp) may exceed the training
    tp: one TP group over the pool's processes, one device each; other layouts are refused naming the key."""
    config = load_config("grpo", preset="smoke", overrides=[*VLLM_TP2, "rollout.tensor_model_parallel_size=2"])
    assert config.placement.generate.tp == 2 and config.placement.train.tp == 1
    two_groups = ["rollout.name=vllm", "placement.num_processes=4", "placement.devices_per_process=1",
                  "placement.train.dp=4", "placement.generate.tp=2", "actor.ppo_micro_batch_size_per_device=1"]
    assert load_config("grpo", preset="smoke", overrides=two_groups).placement.generate.tp == 2
    cases = {
        "one process with 2 devices": (["rollout.name=vllm", "placement.devices_per_process=2", "placement.train.dp=2",
                                        "placement.generate.tp=2"], "needs placement.devices_per_process=1"),
        "a group across nodes": ([*VLLM_TP2, "placement.generate.tp=2", "trainer.nnodes=2"],
                                 "a multiple of 2 on each of the trainer.nnodes=2"),
        "the native engine": ([*VLLM_TP2[1:], "placement.generate.tp=2"], "must divide placement.train.tp=1"),
        "two spellings": ([*VLLM_TP2, "placement.generate.tp=2", "rollout.tensor_parallel_size=1"],
                          "disagrees with placement.generate.tp=2"),
        "kv heads": ([*VLLM_TP2[:1], "placement.num_processes=4", "placement.devices_per_process=1",
                      "placement.train.dp=4", "placement.generate.tp=4"], "config key 'placement.generate.tp'=4"),
    }
    for name, (overrides, fragment) in cases.items():
        with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            load_config("grpo", preset="smoke", overrides=overrides)
