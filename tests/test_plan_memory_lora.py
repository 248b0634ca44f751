"""launch/plan_memory.py with LoRA (``model.lora_rank``): the planned ``update_actor`` trains only the adapters over
the frozen base, so its optimizer state is 2x the adapter bytes (closed form from the config and the fsdp layout)
and it needs less memory than full fine-tuning of the same model."""
from __future__ import annotations

import json

import jax
import pytest

from jaxrl_hf.memory_plan import programs as P
from jaxrl_hf.memory_plan.plan import load_plan_config, plan_devices
from jaxrl_hf.models.known_configs import known_decoder_config
from test_plan_memory import BATCH, SMALL

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS host device count)")
RANK = 8


def _update(tmp_path, *extra):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL))
    config, _ = load_plan_config(["actor_rollout_ref.actor.strategy=fsdp", *BATCH, *extra], 8)
    decoder = known_decoder_config(str(path), dtype=config.model.dtype, remat=config.model.remat)
    return P.update_actor_program(P.ActorLayout.build(config, decoder, plan_devices(8)))


def test_lora_update_plan_holds_adapter_optimizer_state_only(tmp_path):
    full = _update(tmp_path)
    lora = _update(tmp_path, f"actor_rollout_ref.model.lora_rank={RANK}", "actor_rollout_ref.model.lora_alpha=16",
                   "actor_rollout_ref.model.target_modules=all-linear")
    e, m, layers = SMALL["hidden_size"], SMALL["intermediate_size"], SMALL["num_hidden_layers"]
    q = SMALL["num_attention_heads"] * e // SMALL["num_attention_heads"]
    kv = SMALL["num_key_value_heads"] * e // SMALL["num_attention_heads"]
    # fsdp splits every 'embed' dim 8 ways; other dims (heads, mlp, rank) stay whole
    sharded = {"q_proj": e / 8 + q, "k_proj": e / 8 + kv, "v_proj": e / 8 + kv, "o_proj": q + e / 8,
               "gate_proj": e / 8 + m, "up_proj": e / 8 + m, "down_proj": m + e / 8}
    adapter_bytes = int(layers * RANK * sum(sharded.values()) * 4)
    assert lora.shapes["lora"]["adapter_bytes_per_device"] == adapter_bytes
    assert 0 <= lora.optimizer_bytes - 2 * adapter_bytes <= 16  # Adam mu, nu (+ step counters)
    assert lora.param_bytes == full.param_bytes + adapter_bytes  # the frozen base + the adapters
    assert lora.optimizer_bytes < full.optimizer_bytes / 2  # r=8 is large beside hidden=128 in this tiny model
    peak = lambda c: c.compiled.memory_analysis().argument_size_in_bytes + c.compiled.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert peak(lora) < peak(full)
