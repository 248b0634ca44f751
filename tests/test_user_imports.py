"""User code registered by name: ``launch/train.py --import FILE_OR_MODULE`` / the config key ``imports``.

The proof: a file of the user's own (written here, outside the package) registers a new advantage estimator
and a new policy loss with one decorator each; a 1-step run selects them by name, and the logged metrics are
what those functions compute (the estimator runs in the driver, the loss in a worker process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ray

from jaxrl_hf import algos
from jaxrl_hf.config import ConfigError, load_config
from jaxrl_hf.config.schema import ActorConfig, AlgorithmConfig, PolicyLossConfig
from jaxrl_hf.controller import Batch, ResourcePool, Worker, WorkerGroup, WorkerMethodError, register
from jaxrl_hf.trainer.advantage import compute_advantage
from jaxrl_hf.user_modules import UserModuleError, file_module_name, import_user_module, import_user_modules
from jaxrl_hf.workers.losses import actor_loss, actor_loss_config

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the probe worker below travels by value

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ESTIMATOR, LOSS, NEEDS_LOSS = "test_gamma_times_group_size", "test_marked_vanilla", "test_score_weighted"
VERL_ESTIMATOR, RAISING_ESTIMATOR = "test_verl_style", "test_raises_inside"
LOOP, RULE_SET = "test_user_single_turn", "test_user_zero3"

USER_FILE = '''
"""A user's own estimator and policy losses, registered at import time."""
import jax.numpy as jnp

from jaxrl_hf.algos import compute_policy_loss_vanilla, register_adv_estimator, register_policy_loss
from jaxrl_hf.algos.masked import group_count, group_ids


@register_adv_estimator("test_gamma_times_group_size", needs=("index",))
def gamma_times_group_size(token_level_rewards, response_mask, *, index, gamma):
    """A_i = algorithm.gamma x (samples of prompt i) on every valid token. No **kwargs: it is called with exactly
    what it declared (index) and the config values it names (gamma)."""
    adv = gamma * group_count(group_ids(index))[:, None] * response_mask
    return adv, adv


@register_adv_estimator("test_verl_style")
def verl_style(token_level_rewards, response_mask, index, epsilon=1e-6, config=None):
    """Written as for verl: no needs= declaration, the group index as a plain parameter, the algorithm settings
    read from ``config``. A_i = gamma x (samples of prompt i) on every valid token."""
    adv = config.get("gamma", 1.0) * group_count(group_ids(index))[:, None] * response_mask
    return adv, adv


@register_adv_estimator("test_raises_inside")
def raises_inside(token_level_rewards, response_mask, index):
    """A user's bug: fails on every call."""
    return {}["no_such_key"]


def helper_that_raises():
    raise ValueError("a bug in the user's helper")


@register_policy_loss("test_marked_vanilla")
def marked_vanilla(old_log_prob, log_prob, advantages, response_mask, **kwargs):
    """PPO's clipped loss, reporting pg_clipfrac = 0.25 (a marker in the logs)."""
    loss, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, **kwargs)
    return loss, {**metrics, "pg_clipfrac": jnp.asarray(0.25, jnp.float32)}


@register_policy_loss("test_score_weighted")
def score_weighted(old_log_prob, log_prob, advantages, response_mask, *, token_level_scores, **_):
    """-sum(scores * log_prob) / sum(mask): uses a batch column the standard losses do not get (named by the
    signature, without a default: no needs= declaration)."""
    loss = -jnp.sum(token_level_scores * log_prob * response_mask) / jnp.sum(response_mask)
    zero = jnp.zeros((), jnp.float32)
    return loss, {"pg_clipfrac": zero, "pg_clipfrac_lower": zero, "ppo_kl": zero}
'''

# imported only by the end-to-end run's own processes (its names stay out of this process's registries)
USER_SEAMS_FILE = '''
"""A user's own rollout loop and sharding rule set, registered at import time."""
from jaxrl_hf.mesh.rule_sets import FSDP, RuleSet, register_rule_set
from jaxrl_hf.rollout.loops import SingleTurnLoop, register_rollout_loop


@register_rollout_loop("test_user_single_turn")
class UserSingleTurn(SingleTurnLoop):
    """The single-turn loop under the user's own name (resolved by name inside the actor's worker process)."""


register_rule_set(RuleSet("test_user_zero3", FSDP.params, FSDP.activations, "the user's copy of ZeRO-3"))
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    """The user's file, written once: every test of this process imports the same path (so registers once)."""
    path = tmp_path_factory.mktemp("user_code") / "my_algos.py"
    path.write_text(USER_FILE)
    return str(path)


# ------------------------------------------------------------------------------- importing
def test_import_file_is_idempotent_and_module_names_work(user_file, tmp_path, monkeypatch):
    module = import_user_module(user_file)
    assert module.__name__ == file_module_name(user_file) and sys.modules[module.__name__] is module
    assert import_user_module(user_file) is module  # again: no re-execution, no "already registered"
    assert algos.get_adv_estimator(ESTIMATOR) is module.gamma_times_group_size
    (tmp_path / "my_plugin_pkg.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_user_modules(["my_plugin_pkg", user_file, "my_plugin_pkg"]) == ["my_plugin_pkg", user_file]
    assert sys.modules["my_plugin_pkg"].VALUE == 7


def test_bad_imports_name_the_file_or_module(tmp_path):
    with pytest.raises(UserModuleError, match=r"import '.*/nope\.py': no such file"):
        import_user_module(str(tmp_path / "nope.py"))
    with pytest.raises(UserModuleError, match=r"import 'no_such_mod\.sub': no module named 'no_such_mod' on sys.path"):
        import_user_module("no_such_mod.sub")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('boom in user code')\n")
    with pytest.raises(UserModuleError, match=r"import '.*broken\.py' failed: RuntimeError: boom in user code"):
        import_user_module(str(broken))
    assert file_module_name(str(broken)) not in sys.modules  # a failed import leaves nothing half-registered
    with pytest.raises(ConfigError, match=r"nope\.py': no such file \(from --import or the config key 'imports'\)"):
        load_config("grpo", imports=[str(tmp_path / "nope.py")])


# ------------------------------------------------------------------------------- config validity
def test_unknown_names_list_the_registry(user_file):
    for override, kind, builtin in (("algorithm.adv_estimator=grpoo", "advantage estimator", "'rloo'"),
                                    ("actor.policy_loss.loss_mode=ppo", "policy loss", "'cispo'"),
                                    ("algorithm.kl_penalty=k4", "KL estimator", "'low_var_kl+'"),
                                    ("actor.kl_loss_type=k5", "KL estimator", "'k3'")):
        key, value = override.split("=")
        with pytest.raises(ConfigError) as err:
            load_config("grpo", overrides=[override], imports=[user_file])
        message = str(err.value)
        assert f"config key '{key}'={value!r}: not a registered {kind}; valid names: [" in message, message
        assert builtin in message and "--import" in message
    with pytest.raises(ConfigError) as err:
        load_config("grpo", overrides=["algorithm.adv_estimator=grpoo"], imports=[user_file])
    assert repr(ESTIMATOR) in str(err.value)  # the user's name is listed once imported


def test_config_uses_user_names_and_their_declarations(user_file):
    config = load_config("grpo", overrides=[f"algorithm.adv_estimator={ESTIMATOR}", f"actor.policy_loss.loss_mode={LOSS}"],
                         imports=[os.path.relpath(user_file)])
    assert config.imports == [user_file]  # canonical: absolute, as the worker processes import it
    assert not config.critic.enable
    with pytest.raises(ConfigError, match=rf"rollout.n'=1: algorithm.adv_estimator='{ESTIMATOR}' compares samples"):
        load_config("grpo", overrides=[f"algorithm.adv_estimator={ESTIMATOR}", "rollout.n=1"], imports=[user_file])

    @algos.register_adv_estimator("test_needs_values", needs=("values",))
    def with_values(token_level_rewards, response_mask, *, values):
        return values, values

    assert load_config("grpo", overrides=["algorithm.adv_estimator=test_needs_values"]).critic.enable  # on by need
    assert load_config("ppo", overrides=["algorithm.adv_estimator=test_needs_values"]).critic.enable  # a critic estimator
    with pytest.raises(ConfigError, match="needs a critic"):
        load_config("grpo", overrides=["algorithm.adv_estimator=test_needs_values", "critic.enable=false"])
    with pytest.raises(ConfigError, match="only --algo remax computes"):
        load_config("grpo", overrides=["algorithm.adv_estimator=remax"])


# ------------------------------------------------------------------------------- the driver's call
def test_compute_advantage_passes_what_the_estimator_declared(user_file):
    import_user_module(user_file)
    uid = np.array([5, 5, 5, 9, 9, 2], np.int64)  # groups of 3, 2 and 1
    mask = np.ones((6, 3), np.float32)
    mask[0, 2] = 0.0
    batch = Batch.from_dict({"uid": uid, "response_mask": mask, "token_level_rewards": np.zeros((6, 3), np.float32)})
    adv = compute_advantage(batch, AlgorithmConfig(adv_estimator=ESTIMATOR, gamma=0.5))["advantages"]
    np.testing.assert_allclose(adv, 0.5 * np.array([3, 3, 3, 2, 2, 1], np.float32)[:, None] * mask)
    with pytest.raises(ValueError, match=rf"estimator '{ESTIMATOR}' needs batch column 'uid' \(its `index` input\)"):
        compute_advantage(Batch.from_dict({"response_mask": mask, "token_level_rewards": mask}),
                          AlgorithmConfig(adv_estimator=ESTIMATOR))
    with pytest.raises(ValueError, match=r"estimator 'remax' needs batch column 'reward_baselines'"):
        compute_advantage(batch, AlgorithmConfig(adv_estimator="remax"))


def test_a_verl_style_estimator_gets_what_its_signature_names(user_file):
    """No ``needs=``: the ``index`` parameter makes the group ids needed (also for the config's rollout.n check),
    ``config`` gets the algorithm section (``config.get``), as verl calls its registered estimators."""
    import_user_module(user_file)
    assert algos.adv_estimator_needs(VERL_ESTIMATOR) == ("index",)
    uid = np.array([5, 5, 5, 9, 9, 2], np.int64)
    mask = np.ones((6, 3), np.float32)
    batch = Batch.from_dict({"uid": uid, "response_mask": mask, "token_level_rewards": np.zeros((6, 3), np.float32)})
    adv = compute_advantage(batch, AlgorithmConfig(adv_estimator=VERL_ESTIMATOR, gamma=0.5))["advantages"]
    np.testing.assert_allclose(adv, 0.5 * np.array([3, 3, 3, 2, 2, 1], np.float32)[:, None] * mask)
    with pytest.raises(ConfigError, match=rf"rollout.n'=1: algorithm.adv_estimator='{VERL_ESTIMATOR}' compares"):
        load_config("grpo", overrides=[f"algorithm.adv_estimator={VERL_ESTIMATOR}", "rollout.n=1"], imports=[user_file])


def test_an_error_inside_the_users_code_names_it_and_is_not_reported_as_a_bug(user_file, tmp_path):
    import io

    from jaxrl_hf.errors import ExitCode
    from jaxrl_hf.trainer.exit_path import report
    from jaxrl_hf.user_modules import UserCodeError

    module = import_user_module(user_file)
    batch = Batch.from_dict({"uid": np.array([1, 1]), "response_mask": np.ones((2, 2), np.float32),
                             "token_level_rewards": np.zeros((2, 2), np.float32)})
    with pytest.raises(UserCodeError) as err:
        compute_advantage(batch, AlgorithmConfig(adv_estimator=RAISING_ESTIMATOR))
    message = str(err.value)
    assert f"advantage estimator {RAISING_ESTIMATOR!r} ({module.__name__}.raises_inside in {user_file})" in message
    assert "raised KeyError: 'no_such_key'" in message and isinstance(err.value.__cause__, KeyError)
    screen = io.StringIO()
    assert report(err.value, str(tmp_path), screen) == ExitCode.USER_CODE
    assert "this is a bug" not in screen.getvalue() and RAISING_ESTIMATOR in screen.getvalue()
    # not through a registry: the innermost frame of the user's module is named, file and line
    with pytest.raises(ValueError) as plain:
        module.helper_that_raises()
    screen = io.StringIO()
    assert report(plain.value, str(tmp_path), screen) == ExitCode.USER_CODE
    assert f"your code raised ValueError at {user_file}:" in screen.getvalue()
    assert "in helper_that_raises: a bug in the user's helper" in screen.getvalue()
    assert "this is a bug" not in screen.getvalue()
    # raised in a worker process: the remote exception's class tells it
    remote = WorkerMethodError("actor", 0, "update_actor", "UserCodeError", "Traceback ...\nUserCodeError: x\n")
    assert report(remote, str(tmp_path), io.StringIO()) == ExitCode.USER_CODE


def _loss_config(loss_mode: str):
    """The actor's loss view with the schema's defaults and ``actor.policy_loss.loss_mode=loss_mode``."""
    return actor_loss_config(ActorConfig(policy_loss=PolicyLossConfig(loss_mode=loss_mode)), temperature=1.0)


def test_user_policy_loss_by_name_gets_its_declared_columns(user_file):
    import_user_module(user_file)
    cfg = _loss_config(NEEDS_LOSS)
    assert cfg.required_keys()[-1] == "token_level_scores"
    assert "token_level_scores" not in _loss_config(LOSS).required_keys()
    rng = np.random.default_rng(0)
    micro = {"response_mask": np.array([[1, 1, 0], [1, 0, 0]], np.float32),
             "old_log_probs": np.zeros((2, 3), np.float32), "advantages": np.zeros((2, 3), np.float32),
             "token_level_scores": rng.normal(size=(2, 3)).astype(np.float32)}
    log_prob = jnp.asarray(rng.normal(size=(2, 3)).astype(np.float32))
    policy = lambda params, micro, temperature: (params, jnp.zeros_like(params))  # noqa: E731 - log-probs = params
    loss, metrics = actor_loss(log_prob, micro, jnp.float32(3.0), log_prob_fn=policy, cfg=cfg)
    expected = -np.sum(micro["token_level_scores"] * np.asarray(log_prob) * micro["response_mask"]) / 3.0
    np.testing.assert_allclose(float(metrics["pg_loss"]), expected, rtol=1e-6)
    grad = jax.grad(lambda p: actor_loss(p, micro, jnp.float32(3.0), log_prob_fn=policy, cfg=cfg)[0])(log_prob)
    np.testing.assert_allclose(grad, -micro["token_level_scores"] * micro["response_mask"] / 3.0, rtol=1e-6)


# ------------------------------------------------------------------------------- worker processes
class RegistryProbe(Worker):
    @register
    def has(self, name: str) -> bool:
        return name in algos.ADV_ESTIMATORS


@pytest.mark.slow
def test_every_process_of_a_pool_imports_before_workers_exist(ray_cluster, user_file, tmp_path):
    with ResourcePool("user_imports", num_processes=2, devices_per_process=1, imports=[user_file]) as pool:
        first, second = WorkerGroup(pool, RegistryProbe), WorkerGroup(pool, RegistryProbe)  # colocated roles
        assert first.has(ESTIMATOR) == [True, True] and second.has(ESTIMATOR) == [True, True]
    broken = tmp_path / "broken_in_workers.py"
    broken.write_text("raise ImportError('missing dependency xyz')\n")
    with ResourcePool("user_imports_bad", num_processes=1, imports=[str(broken)]) as pool:
        with pytest.raises(WorkerMethodError, match=r"(?s)import_user_modules.*broken_in_workers\.py' failed: "
                                                    r"ImportError: missing dependency xyz"):
            pool.start()


# ------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_train_with_a_user_estimator_and_loss(user_file, tmp_path):
    """``launch/train.py --import FILE``: the verl-style estimator's A = gamma x n on every token (0.75 x rollout.n=2:
    the group index and the config reached it without a needs= declaration) and the
    worker-side loss's marker pg_clipfrac = 0.25 are what the run logs; the user's rollout loop and sharding rule
    set are selected by name (the actor worker resolves both in its own process, or the run fails)."""
    run_dir = tmp_path / "run"
    seams_file = tmp_path / "my_seams.py"
    seams_file.write_text(USER_SEAMS_FILE)
    cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "--algo", "grpo", "--preset", "smoke",
           "--import", user_file, "--import", str(seams_file), f"algorithm.adv_estimator={VERL_ESTIMATOR}", "algorithm.gamma=0.75",
           f"actor.policy_loss.loss_mode={LOSS}", f"rollout.loop={LOOP}", f"actor.strategy={RULE_SET}",
           "trainer.total_steps=1", "trainer.val_before_train=false",
           "trainer.save_freq=0", f"trainer.run_dir={run_dir}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    with open(run_dir / "metrics.jsonl") as fh:
        (record,) = [json.loads(line) for line in fh if line.strip()]
    assert record["step"] == 1
    for stat in ("mean", "max", "min"):
        assert record[f"critic/advantages/{stat}"] == pytest.approx(1.5)
    assert record["actor/pg_clipfrac"] == pytest.approx(0.25)
    written = (run_dir / "config.yaml").read_text()
    assert f"imports:\n- {user_file}\n- {seams_file}" in written
    assert f"loop: {LOOP}" in written and f"strategy: {RULE_SET}" in written


def test_bad_import_on_the_command_line_exits_2_naming_it(tmp_path):
    cmd = [sys.executable, os.path.join(REPO, "launch", "train.py"), "--algo", "grpo", "--preset", "smoke",
           "--import", "no_such_user_module_xyz", f"trainer.run_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "config error: import 'no_such_user_module_xyz': no module named 'no_such_user_module_xyz'" in proc.stderr
