"""The generic ``Registry`` (per-entry metadata) and what the built-in estimators, losses and KL estimators declare."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_hf import algos
from jaxrl_hf.registry import Registry


def test_metadata_defaults_typos_and_reregistration():
    reg = Registry("widget", metadata={"needs": (), "fast": False})

    @reg.register("a", needs=("x",))
    def a():
        return 1

    assert reg.info("a") == {"needs": ("x",), "fast": False}  # defaults filled in
    assert reg.register("a", needs=("x",))(a) is a  # same function, same metadata: a no-op
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a", needs=("y",))(a)  # same function, different declaration
    with pytest.raises(TypeError, match=r"unknown registration keyword\(s\) \['need'\]; valid: \['fast', 'needs'\]"):
        reg.register("b", need=("x",))
    with pytest.raises(ValueError, match=r"unknown widget 'zz'; valid names: \['a'\]"):
        reg.info("zz")
    assert reg.register("a", override=True, fast=True)(a) is a and reg.info("a")["fast"] is True


def test_builtin_estimators_declare_their_inputs():
    for name in ("grpo", "grpo_passk", "rloo", "opo", "reinforce_plus_plus_baseline", "gpg"):
        assert algos.adv_estimator_needs(name) == ("index",), name
    assert algos.adv_estimator_needs("gae") == ("values",)
    assert algos.adv_estimator_needs("remax") == ("reward_baselines",)
    assert algos.adv_estimator_needs("reinforce_plus_plus") == ()
    # config values come from the signature: only what the function names
    scalars = {"gamma": 0.9, "lam": 0.8, "norm_adv_by_std_in_grpo": False, "kl_penalty": "kl"}
    assert algos.adv_estimator_options("gae", scalars) == {"gamma": 0.9, "lam": 0.8}
    assert algos.adv_estimator_options("grpo", scalars) == {"norm_adv_by_std_in_grpo": False}
    assert algos.adv_estimator_options("rloo", scalars) == {}
    assert all(algos.policy_loss_needs(n) == () for n in ("vanilla", "gspo", "cispo", "gpg"))


def test_declarations_are_checked_at_registration():
    with pytest.raises(TypeError, match=r"needs= must be a tuple of input names"):
        algos.register_adv_estimator("test_bare_string_needs", needs="index")
    with pytest.raises(TypeError, match=r"declares needs=\('values',\) but strict\(\) has no parameter\(s\) \['values'\]"):
        @algos.register_adv_estimator("test_strict_signature", needs=("values",))
        def strict(token_level_rewards, response_mask, *, index):
            return token_level_rewards, token_level_rewards
    assert "test_strict_signature" not in algos.ADV_ESTIMATORS


def test_kl_estimators_are_a_registry_with_straight_through_forms():
    names = {n for n in algos.KL_ESTIMATORS.names() if not n.startswith("test_")}
    base = {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"}
    assert names == base | {k + "+" for k in base - {"full"}}

    @algos.register_kl_estimator("test_half_k1")
    def half_k1(log_prob, ref_log_prob):
        return 0.5 * (log_prob - ref_log_prob)

    lp, rp = np.array([[0.0, -1.0]], np.float32), np.array([[-1.0, -1.0]], np.float32)
    np.testing.assert_allclose(algos.kl_penalty(lp, rp, "test_half_k1"), [[0.5, 0.0]])
    np.testing.assert_allclose(algos.kl_penalty(lp, rp, "test_half_k1+"), [[0.5, 0.0]])  # value of the base
    with pytest.raises(ValueError, match=r"unknown KL estimator 'full\+'; valid names: \[.*'test_half_k1\+'"):
        algos.kl_penalty(lp, rp, "full+")


def test_algo_names_are_one_list():
    """``--algo`` names: the schema's ``ALGOS`` is the list; each has a step in the trainer and a configs/ YAML,
    and ``launch/train.py`` (= ``jaxrl-hf-train``, `jaxrl_hf.trainer.cli`) offers exactly those."""
    import importlib.util
    import os

    from jaxrl_hf.config import ALGOS, config_dir
    from jaxrl_hf.trainer import ALGORITHMS

    assert sorted(ALGORITHMS) == sorted(ALGOS)
    assert all(os.path.isfile(os.path.join(config_dir(), f"{algo}.yaml")) for algo in ALGOS)
    launch = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launch", "train.py")
    spec = importlib.util.spec_from_file_location("launch_train", launch)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from jaxrl_hf.trainer import cli

    assert module.main is cli.main and cli.ALGOS is ALGOS
