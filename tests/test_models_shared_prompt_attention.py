"""Attention over rows holding one prompt and its samples' responses (`jaxrl_hf.models.shared_prompt_attention`)
against eager attention over the padded ``[prompt | response]`` rows, key for key."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import tiny_config
from jaxrl_hf.models.attention import eager_attention
from jaxrl_hf.models.row_layout import RowLayout
from jaxrl_hf.models.shared_prompt_attention import (join_group_rows, repeat_per_sample, shared_prompt_attention,
                                                     split_group_rows)


def group_rows_of(groups: int, samples: int, prompt: int, response: int, seed: int):
    """Random q, k, v ``[G, P + n·R, ...]`` and segments: left-padded prompts, right-padded responses."""
    rng = np.random.default_rng(seed)
    length, kv, per_kv, dim = prompt + samples * response, 2, 3, 8
    q = rng.normal(size=(groups, length, kv, per_kv, dim)).astype(np.float32)
    k, v = (rng.normal(size=(groups, length, kv, dim)).astype(np.float32) for _ in range(2))
    seg = np.zeros((groups, length), np.int32)
    for g in range(groups):
        seg[g, prompt - rng.integers(1, prompt + 1):prompt] = 1
        for s in range(samples):
            start = prompt + s * response
            seg[g, start:start + rng.integers(1, response + 1)] = 1
    return q, k, v, seg


def padded_rows(x: np.ndarray, prompt: int, samples: int, response: int) -> np.ndarray:
    """``[G, P + n·R, ...]`` -> the rollout's padded rows ``[G·n, P + R, ...]``."""
    p, r = x[:, :prompt], x[:, prompt:].reshape(x.shape[0], samples, response, *x.shape[2:])
    p = np.broadcast_to(p[:, None], (x.shape[0], samples, *p.shape[1:]))
    return np.concatenate([p, r], axis=2).reshape(x.shape[0] * samples, prompt + response, *x.shape[2:])


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 2.0)])
def test_each_response_sees_its_prompt_and_itself_as_the_padded_row_does(window, softcap):
    groups, samples, prompt, response = 2, 3, 5, 4
    q, k, v, seg = group_rows_of(groups, samples, prompt, response, seed=1)
    attend = functools.partial(eager_attention, scale=0.35, window=window, softcap=softcap)
    out = np.asarray(shared_prompt_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(seg),
                                             (prompt, samples, response), attend, 0.35, window, softcap))
    ref = np.asarray(attend(*(jnp.asarray(padded_rows(x, prompt, samples, response)) for x in (q, k, v, seg))))
    valid = padded_rows(seg, prompt, samples, response) != 0
    got = padded_rows(out, prompt, samples, response)
    np.testing.assert_allclose(got[valid], ref[valid], atol=2e-6, rtol=2e-6)


def test_group_rows_split_and_join_back():
    x = jnp.arange(2 * (3 + 2 * 4) * 5).reshape(2, 11, 5)
    prompts, responses = split_group_rows(x, (3, 2, 4))
    assert prompts.shape == (2, 3, 5) and responses.shape == (4, 4, 5)
    np.testing.assert_array_equal(responses[1], x[0, 7:])
    np.testing.assert_array_equal(join_group_rows(prompts, responses), x)
    np.testing.assert_array_equal(repeat_per_sample(jnp.array([[1], [2]]), 3)[:, 0], [1, 1, 1, 2, 2, 2])


def test_a_layout_that_does_not_fit_the_row_is_refused():
    with pytest.raises(ValueError, match="do not hold a prompt of 3 and 2 responses of 4 tokens"):
        split_group_rows(jnp.zeros((2, 10)), (3, 2, 4))
    with pytest.raises(ValueError, match="shape=.3, 2. must be .prompt length, samples, response length."):
        RowLayout("shared_prompt", (3, 2))
    with pytest.raises(ValueError, match="unknown row layout 'shared'; valid names: .'packed', 'padded'"):
        RowLayout("shared", (3, 2, 4))
    with pytest.raises(ValueError, match="row_layout=.*must be a jaxrl_hf.models.row_layout.RowLayout"):
        tiny_config(row_layout=("shared_prompt", (3, 2, 4)))
