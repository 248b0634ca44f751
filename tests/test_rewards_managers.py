"""Reward managers (naive, dapo) on plain arrays; process pool = serial; Bradley-Terry loss vs numpy."""

from __future__ import annotations

import numpy as np
import pytest

from jaxrl_hf.rewards import DAPORewardManager, NaiveRewardManager, ScoreFnSpec, make_reward_manager


class CharTokenizer:
    """A real (if tiny) tokenizer: one id per character, id 0 = eos ``</s>``, dropped when skipping specials."""

    eos_token = "</s>"

    def decode(self, ids, skip_special_tokens=False):
        text = "".join("</s>" if i == 0 else chr(i) for i in ids)
        return text.replace("</s>", "") if skip_special_tokens else text


def _encode_right_padded(texts, width, eos=True):
    ids = np.zeros((len(texts), width), np.int64)
    mask = np.zeros((len(texts), width), np.int64)
    for i, t in enumerate(texts):
        toks = [ord(c) for c in t] + ([0] if eos else [])
        ids[i, : len(toks)] = toks
        mask[i, : len(toks)] = 1
    return ids, mask


def test_naive_places_score_on_last_valid_token_via_tokenizer():
    texts = ["#### 12", "x #### 3", "nothing", ""]
    ids, mask = _encode_right_padded(texts, 12)
    mask[3] = 0  # an empty response (no tokens at all)
    manager = NaiveRewardManager(tokenizer=CharTokenizer())
    out = manager(ids, mask, ["openai/gsm8k"] * 4, ["12", "4", "1", "1"])
    expected = np.zeros((4, 12), np.float32)
    expected[0, len(texts[0])] = 1.0  # the eos token is the last valid token
    assert out.token_level_scores.dtype == np.float32
    np.testing.assert_array_equal(out.token_level_scores, expected)
    assert out.extras["acc"] == [True, False, False, False]
    assert out.extras["pred"] == ["12", "3", "", ""]
    assert out.metrics["reward/empty_responses"] == 1.0
    assert out.metrics["reward/acc_mean"] == 0.25


def test_last_valid_token_with_holes_in_the_mask():
    ids = np.zeros((1, 6), np.int64)
    mask = np.array([[1, 1, 0, 1, 0, 0]])  # e.g. a tool-output span masked inside the response
    out = NaiveRewardManager()(ids, mask, ["arithmetic"], ["5"], responses=["Answer: 5"])
    assert out.token_level_scores[0].tolist() == [0, 0, 0, 1.0, 0, 0]


def test_dapo_overlong_penalty_matches_eq13_in_float64():
    l_max, l_cache, factor = 20, 8, 0.5
    lengths = np.array([1, 12, 13, 16, 19, 20])
    texts = ["Answer: 7"] * len(lengths)
    mask = (np.arange(l_max)[None, :] < lengths[:, None]).astype(np.int64)
    ids = np.zeros_like(mask)
    manager = DAPORewardManager(
        max_response_length=l_max, overlong_buffer={"enable": True, "len": l_cache, "penalty_factor": factor, "log": True}
    )
    out = manager(ids, mask, ["math_dapo"] * len(lengths), ["7", "7", "8", "7", "8", "7"], responses=texts)

    def r_len(y):  # DAPO eq. 13
        if y <= l_max - l_cache:
            return 0.0
        if y <= l_max:
            return ((l_max - l_cache) - y) / l_cache
        return -1.0

    rule = np.array([1.0, 1.0, -1.0, 1.0, -1.0, 1.0])
    expected = rule + factor * np.array([r_len(float(y)) for y in lengths], np.float64)
    got = out.token_level_scores[np.arange(len(lengths)), lengths - 1]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert out.extras["overlong"] == [False, False, True, True, True, True]
    assert out.metrics["reward/overlong_count"] == 4.0
    assert out.metrics["reward/overlong_ratio"] == pytest.approx(4 / 6)


def test_dapo_config_errors():
    with pytest.raises(ValueError, match="needs max_response_length"):
        DAPORewardManager(overlong_buffer={"enable": True, "len": 4})
    with pytest.raises(ValueError, match="exceeds max_response_length"):
        DAPORewardManager(max_response_length=4, overlong_buffer={"enable": True, "len": 8})
    with pytest.raises(ValueError, match="unknown keys \\['lenght'\\]; valid keys"):
        DAPORewardManager(max_response_length=4, overlong_buffer={"enable": True, "lenght": 8})
    with pytest.raises(ValueError, match="unknown reward manager 'prime'; valid names"):
        make_reward_manager("prime")


def test_input_validation_names_the_problem():
    manager = NaiveRewardManager()
    ids, mask = np.zeros((2, 3)), np.ones((2, 3))
    with pytest.raises(ValueError, match="ground_truths has 1 entries for a batch of 2"):
        manager(ids, mask, ["arithmetic"] * 2, ["1"], responses=["1", "2"])
    with pytest.raises(ValueError, match="pass the decoded responses or construct the manager with a tokenizer"):
        manager(ids, mask, ["arithmetic"] * 2, ["1", "2"])
    with pytest.raises(ValueError, match="differ in shape"):
        manager(np.zeros((2, 4)), mask, ["arithmetic"] * 2, ["1", "2"], responses=["1", "2"])


def test_process_pool_scores_equal_serial_scores():
    rng = np.random.default_rng(0)
    n = 64
    truths = [str(int(x)) for x in rng.integers(0, 50, n)]
    texts = [f"... so the total is {int(t) + int(rng.integers(0, 2))}.\n#### {int(t) + int(rng.integers(0, 2))}" for t in truths]
    sources = ["openai/gsm8k"] * (n // 2) + ["arithmetic"] * (n // 2)
    ids, mask = _encode_right_padded(texts, max(len(t) for t in texts) + 1)
    serial = NaiveRewardManager(tokenizer=CharTokenizer())(ids, mask, sources, truths)
    with NaiveRewardManager(tokenizer=CharTokenizer(), num_workers=2) as pooled_manager:
        pooled = pooled_manager(ids, mask, sources, truths)
    np.testing.assert_array_equal(serial.token_level_scores, pooled.token_level_scores)
    assert serial.extras == pooled.extras
    assert 0 < sum(serial.extras["acc"]) < n  # a mix of right and wrong answers


def test_bt_loss_matches_numpy():
    from jaxrl_hf.rewards import bt_loss

    rng = np.random.default_rng(1)
    chosen = rng.normal(size=32) * 5
    rejected = rng.normal(size=32) * 5
    chosen[0], rejected[0] = 80.0, -80.0  # large gaps stay finite
    chosen[1], rejected[1] = -80.0, 80.0
    reference = np.mean(-np.log(1.0 / (1.0 + np.exp(-(chosen.astype(np.float64) - rejected)))))
    reference_stable = np.mean(np.logaddexp(0.0, rejected - chosen))
    assert np.isfinite(float(bt_loss(chosen, rejected)))
    np.testing.assert_allclose(float(bt_loss(chosen, rejected)), reference_stable, rtol=1e-5)
    np.testing.assert_allclose(reference, reference_stable, rtol=1e-12)
    mask = (np.arange(32) % 2).astype(np.float32)
    np.testing.assert_allclose(
        float(bt_loss(chosen, rejected, mask)), np.logaddexp(0.0, rejected - chosen)[1::2].mean(), rtol=1e-5
    )
    with pytest.raises(ValueError, match="differ in shape"):
        bt_loss(chosen, rejected[:3])
