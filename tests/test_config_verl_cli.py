"""verl command lines: every key of verl's example scripts accepted or explained, --dry-run, all problems at once."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from jaxrl_hf.config import ConfigError, load_config
from jaxrl_hf.config.dry_run import dry_run
from jaxrl_hf.config.schema_paths import is_schema_key
from jaxrl_hf.config.verl_key_tables import CONVERTED, IGNORED, RENAMED, UNSUPPORTED, VALUE_ALTERNATIVES
from jaxrl_hf.config.verl_keys import classify_key, key_kind

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "verl_example_keys.txt"
SMOKE = ["model.path=tiny-random", "data.val_files=[arithmetic]"]


def fixture_keys() -> list[str]:
    return [line.strip() for line in FIXTURE.read_text().splitlines() if line.strip() and not line.startswith("#")]


def coverage() -> Counter:
    return Counter(key_kind(key) for key in fixture_keys())


def test_every_verl_example_key_is_accepted_or_explained():
    keys, counts = fixture_keys(), coverage()
    assert len(keys) == len(set(keys)) == 289 and keys == sorted(keys)
    assert counts["unknown"] == 0, [k for k in keys if key_kind(k) == "unknown"]
    accepted = counts["schema"] + counts["ignored"] + counts["conditional"]
    print(f"verl example keys: {dict(counts)}; accepted {accepted}/{len(keys)} = {accepted / len(keys):.1%}")
    assert accepted / len(keys) >= 0.90
    assert (counts["schema"] + counts["ignored"]) / len(keys) >= 0.84  # accepted whatever their value
    for key in keys:  # each verdict is what key_kind says, with its reason
        kind = key_kind(key)
        if kind == "schema":
            verdict = classify_key(key, "1")
            assert verdict.kind in ("set", "ignored") and (verdict.kind == "ignored" or is_schema_key(verdict.target))
        elif kind == "ignored":
            verdict = classify_key(key, "1")
            assert verdict.kind == "ignored" and verdict.note, key
        else:  # unsupported, or conditional at a value that is not this framework's behaviour
            verdict = classify_key(key, "some-other-value")
            assert verdict.kind == "error" and "is not supported: " in verdict.note and len(verdict.note) > 60, key


def test_readme_records_the_coverage():
    counts, total = coverage(), len(fixture_keys())
    accepted = counts["schema"] + counts["ignored"] + counts["conditional"]
    readme = (ROOT / "README.md").read_text()
    expected = (f"{accepted} of {total} keys are accepted: {counts['schema']} set a key of this schema, "
                f"{counts['ignored']} are accepted with no effect, {counts['conditional']} only at the value that is "
                f"this framework's behaviour; {counts['unsupported']} are refused")
    assert expected in re.sub(r"\s+", " ", readme), expected


def test_tables_are_consistent():
    for key in (*RENAMED, *CONVERTED, *IGNORED, *UNSUPPORTED):
        assert not is_schema_key(key.rstrip("._")), f"{key} is a schema key: its table entry is never read"
    for key, target in RENAMED.items():
        assert is_schema_key(target.rstrip(".")) or target.endswith("."), (key, target)
    assert all(is_schema_key(target) for target, _ in CONVERTED.values())


def test_verl_renames_take_effect():
    config = load_config("grpo", overrides=SMOKE + [
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=False", "actor_rollout_ref.rollout.val_kwargs.n=2",
        "actor_rollout_ref.actor.optim.lr_warmup_steps=-1", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",
        "trainer.total_training_steps=20", "actor_rollout_ref.actor.use_token_level_loss=False",
        "algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold=3.0",
        "actor_rollout_ref.actor.optim.clip_grad=0.5", "critic.optim.lr_warmup_steps=4",
        "actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.001",
        "actor_rollout_ref.actor.megatron.override_transformer_config.moe_z_loss_coeff=0.0001",
    ])
    a = config.actor
    assert (a.ppo_micro_batch_size_per_device, a.log_prob_micro_batch_size_per_device) == (2, 1)
    assert config.rollout.val.greedy is True and config.rollout.val.n == 2
    assert (a.optim.warmup_steps, a.optim.total_steps, config.critic.optim.warmup_steps) == (2, 20, 4)
    assert a.loss_agg_mode == "seq-mean-token-mean" and a.grad_clip == 0.5
    assert (a.rollout_correction.level, a.rollout_correction.threshold) == ("sequence", 3.0)
    assert (a.router_aux_loss_coef, a.router_z_loss_coef) == (0.001, 0.0001)  # Megatron's MoE router loss weights


def test_verl_keys_in_a_yaml_preset(tmp_path):
    preset = tmp_path / "verl.yaml"
    preset.write_text(yaml.safe_dump({"actor_rollout_ref": {"actor": {"ppo_micro_batch_size_per_gpu": 2,
                                                                      "fsdp_config": {"param_offload": True}},
                                                            "rollout": {"val_kwargs": {"top_p": 0.5}}},
                                      "custom_reward_function": {"reward_kwargs": {"a": {"b": 1}}}}))
    config = load_config("grpo", preset=str(preset), overrides=SMOKE)
    assert (config.actor.ppo_micro_batch_size_per_device, config.rollout.val.top_p) == (2, 0.5)
    assert config.custom_reward_function.reward_kwargs == {"a": {"b": 1}}  # a free-form mapping stays one value
    preset.write_text(yaml.safe_dump({"actor": {"clip_ratio_hihg": 0.3}, "algorithm": {"use_pf_ppo": True}}))
    with pytest.raises(ConfigError) as err:
        load_config("grpo", preset=str(preset), overrides=SMOKE)
    assert str(err.value).count(str(preset)) == 2 and "2 config key problems" in str(err.value)


def test_several_bad_keys_are_reported_together():
    bad = ["actor_rollout_ref.actor.clip_ratio_hihg=0.3", "algorithm.use_pf_ppo=True", "data.truncation=left",
           "actor_rollout_ref.actor.ppo_micro_batch_size=64", "nonsense.key=1"]
    with pytest.raises(ConfigError) as err:
        load_config("grpo", overrides=SMOKE + ["trainer.total_epochs=2"] + bad)
    message = str(err.value)
    assert message.startswith("5 config key problems:")
    for text in bad:
        assert f"override {text!r}" in message, text
    assert "did you mean 'actor.clip_ratio_high'?" in message
    assert "PF-PPO" in message and "never truncated" in message
    assert "use actor.ppo_micro_batch_size_per_device" in message
    assert "valid keys at the top level" in message and "trainer.total_epochs" not in message


@pytest.mark.parametrize("key, suggestion", [
    ("actor_rollout_ref.actor.clip_ratio_hihg", "actor.clip_ratio_high"),
    ("actor_rollout_ref.rollout.val_kwargs.temprature", "rollout.val_kwargs.temperature"),
    ("actor_rollout_ref.actor.fsdp_config.param_ofload", "actor.fsdp_config.param_offload"),
    ("trainer.n_gpu_per_node", "trainer.n_gpus_per_node"),
])
def test_a_typo_gets_its_suggestion(key, suggestion):
    verdict = classify_key(key, "1")
    assert verdict.kind == "unknown" and f"did you mean '{suggestion}'?" in verdict.note, verdict.note


def test_ignored_keys_are_logged_in_a_run(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxrl_hf.config"):
        load_config("grpo", overrides=SMOKE + ["trainer.total_epochs=3", "ray_init.num_cpus=4"])
    messages = [r.getMessage() for r in caplog.records]
    assert not any("'trainer.total_epochs'" in m for m in messages), messages  # converted: tests/test_config_run_length.py
    assert any("'ray_init.num_cpus'" in m and "Ray is started by jaxrl_hf" in m for m in messages), messages


def test_a_run_with_unsupported_keys_exits_2_listing_all(capsys):
    from jaxrl_hf.trainer import run

    code = run("grpo", overrides=SMOKE + ["algorithm.use_pf_ppo=true", "rollout.quantization=fp8"])
    err = capsys.readouterr().err
    assert code == 2 and "2 config key problems" in err and "use_pf_ppo" in err and "quantization" in err


def test_dry_run_of_an_invalid_config_exits_2(capsys):
    assert dry_run("grpo", overrides=["algorithm.use_pf_ppo=true", "actor.ppo_mini_batch_size=3"]) == 2
    assert "use_pf_ppo" in capsys.readouterr().err
    assert dry_run("grpo", overrides=["data.train_batch_size=8", "actor.ppo_mini_batch_size=3"]) == 2
    assert "multiple" in capsys.readouterr().err


def test_dry_run_touches_nothing(tmp_path):
    """A verl-style command line for files that do not exist here: exit 0, the resolved config printed as YAML,
    no run directory written, neither Ray imported nor a JAX backend started."""
    run_dir = tmp_path / "run"
    argv = ["--dry-run", "--algo", "grpo", "actor_rollout_ref.model.path=/nonexistent/model",
            "data.train_files=/nonexistent/train.parquet", "data.val_files=/nonexistent/test.parquet",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.total_epochs=15",
            f"trainer.default_local_dir={run_dir}", "trainer.logger=['console']"]
    probe = ("import json, runpy, sys\n"
             "code = runpy.run_path('launch/train.py', run_name='dry')['main'](sys.argv[1:])\n"
             "from jax._src import xla_bridge\n"
             "ray = sys.modules.get('ray')\n"
             "print(json.dumps({'code': code, 'ray': bool(ray and ray.is_initialized()), "
             "'backends': xla_bridge.backends_are_initialized()}))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", probe, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    *printed, probe_line = proc.stdout.rstrip("\n").split("\n")
    assert json.loads(probe_line) == {"code": 0, "ray": False, "backends": False}
    config = yaml.safe_load("\n".join(printed))
    assert config["model"]["path"] == "/nonexistent/model" and config["actor"]["ppo_micro_batch_size_per_device"] == 2
    assert config["data"]["train_files"] == ["/nonexistent/train.parquet"]
    assert config["trainer"]["run_dir"] == str(run_dir)
    report = "\n".join(line for line in printed if line.startswith("#"))
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu -> actor.ppo_micro_batch_size_per_device" in report
    assert "# run length: total_steps = total_epochs × steps per epoch, computed at start (15 × " in report
    assert "model.path=/nonexistent/model" in report and "3 path(s) not found" in report
    assert not run_dir.exists()


@pytest.mark.parametrize("engine, instead", [("sglang", "use rollout.name=vllm instead"),
                                             ("hf", "use rollout.name=jax instead")])
def test_a_verl_engine_we_do_not_have_says_what_to_use_instead(engine, instead):
    with pytest.raises(ConfigError) as err:
        load_config("grpo", overrides=[f"actor_rollout_ref.rollout.name={engine}"])
    message = str(err.value)
    assert f"config key 'rollout.name': {engine!r} is not one of ['jax', 'vllm']; {instead}" in message
    assert "the same sampling keys" in message
    for key in VALUE_ALTERNATIVES:  # every table entry names a schema key whose value it refuses
        assert is_schema_key(key), key
