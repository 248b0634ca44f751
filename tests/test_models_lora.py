"""LoRA (jaxrl_hf.models.lora / lora_peft): merge against a float64 reference, PEFT export loaded by peft on the
transformers model, frozen base under AdamW updates, sharding rules, config validation."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_hf.models import forward, param_logical_axes, params_to_hf_state_dict, save_hf_dir
from jaxrl_hf.models import lora
from jaxrl_hf.models.lora_peft import load_peft_adapter, save_merged_hf_dir, save_peft_adapter
from _models_helpers import random_params, tiny_config

CONFIG = tiny_config()
CFG_ALL = lora.LoraConfig(rank=4, alpha=8.0, target_modules="all-linear")


def _trained_adapters(base, cfg, seed=1):
    """Adapters with a non-zero B (a fresh B is zero, which would hide layout mistakes)."""
    adapters = lora.init_lora(base, cfg, seed)
    rng = np.random.default_rng(seed)
    return {m: {"lora_A": a["lora_A"], "lora_B": jnp.asarray(rng.normal(0, 0.2, a["lora_B"].shape), jnp.float32)}
            for m, a in adapters.items()}


@pytest.fixture(scope="module")
def base():
    return random_params(CONFIG, 0)


def test_target_modules_and_config_errors():
    assert lora.resolve_target_modules("all-linear") == tuple(lora.LORA_TARGETS)
    assert lora.resolve_target_modules(["v_proj", "q_proj"]) == ("q_proj", "v_proj")
    assert lora.resolve_target_modules("[q_proj, v_proj]") == ("q_proj", "v_proj")
    with pytest.raises(ValueError, match="model.target_modules.*qkv"):
        lora.resolve_target_modules(["qkv"])
    with pytest.raises(ValueError, match="model.lora_rank"):
        lora.LoraConfig(rank=0)
    from jaxrl_hf.config.build import ConfigError
    from jaxrl_hf.config.loader import load_config
    cfg = load_config("grpo", overrides=["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=[q_proj,v_proj]"])
    assert lora.lora_config_from_model(cfg.model) == lora.LoraConfig(8, 16.0, ("q_proj", "v_proj"))
    with pytest.raises(ConfigError, match="model.target_modules"):
        load_config("grpo", overrides=["model.lora_rank=8", "model.target_modules=[lm_head]"])


def test_init_is_identity_and_merge_matches_float64_reference(base):
    fresh = lora.init_lora(base, CFG_ALL, 0)
    merged0 = lora.merge_lora(base, fresh, CFG_ALL)
    for x, y in zip(jax.tree.leaves(merged0), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    bound = 1 / np.sqrt(CONFIG.hidden_size)
    assert 0 < float(jnp.max(jnp.abs(fresh["q_proj"]["lora_A"]))) <= bound

    adapters = _trained_adapters(base, CFG_ALL)
    merged = params_to_hf_state_dict(lora.merge_lora(base, adapters, CFG_ALL), CONFIG)
    ref_base = params_to_hf_state_dict(base, CONFIG)
    from jaxrl_hf.models.lora_peft import adapters_to_peft_state_dict, peft_key
    peft = adapters_to_peft_state_dict(adapters)
    for i in range(CONFIG.num_hidden_layers):
        for m in CFG_ALL.target_modules:
            name = f"model.layers.{i}.{lora.HF_MODULE_PREFIX[m]}.{m}.weight"
            a = peft[peft_key(i, m, "lora_A")].astype(np.float64)  # [r, in]
            b = peft[peft_key(i, m, "lora_B")].astype(np.float64)  # [out, r]
            want = ref_base[name].astype(np.float64) + CFG_ALL.scaling * b @ a  # Hu et al. eq. (3)
            np.testing.assert_allclose(merged[name], want, atol=1e-5, rtol=1e-5)


def test_peft_loads_our_adapter_and_logits_match(base, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = lora.LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
    adapters = _trained_adapters(base, cfg, seed=2)
    save_hf_dir(tmp_path / "base", base, CONFIG)
    save_peft_adapter(tmp_path / "adapter", adapters, cfg, str(tmp_path / "base"))
    meta = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert meta["r"] == 4 and meta["target_modules"] == ["q_proj", "v_proj", "o_proj", "down_proj"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids = np.random.default_rng(0).integers(3, CONFIG.vocab_size, (2, 11)).astype(np.int64)
    with torch.no_grad():
        theirs = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    ours = np.asarray(forward(lora.merge_lora(base, adapters, cfg), CONFIG, jnp.asarray(ids, jnp.int32)))
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    plain = np.asarray(forward(base, CONFIG, jnp.asarray(ids, jnp.int32)))
    assert np.max(np.abs(plain - theirs)) > 1e-2  # the adapter really changes the logits

    back, back_cfg = load_peft_adapter(tmp_path / "adapter", base, CONFIG)
    assert back_cfg == cfg
    for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(jax.device_get(adapters))):
        np.testing.assert_array_equal(x, y)
    save_merged_hf_dir(tmp_path / "merged", base, adapters, cfg, CONFIG)
    merged_hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    with torch.no_grad():
        np.testing.assert_allclose(merged_hf(input_ids=torch.from_numpy(ids)).logits.numpy(), theirs, atol=1e-4)
    with pytest.raises(ValueError, match="missing"):
        load_peft_adapter(tmp_path / "base", base, CONFIG)


def test_only_adapters_train_and_base_stays_bit_identical(base):
    cfg = lora.LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"))
    bf16_base = jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), base)
    frozen_copy = jax.tree.map(np.asarray, bf16_base)
    trainable, frozen = lora.trainable_split(bf16_base, cfg, rng=0)
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(trainable)
    n_opt = sum(int(x.size) for x in jax.tree.leaves(opt_state) if getattr(x, "ndim", 0) > 0)
    assert n_opt == 2 * lora.adapter_param_count(trainable)  # Adam mu + nu of the adapters only
    ids = jnp.asarray(np.random.default_rng(1).integers(3, CONFIG.vocab_size, (2, 9)), jnp.int32)

    def loss_fn(adapters, frozen):
        logits = forward(lora.combine(adapters, frozen, cfg), CONFIG, ids[:, :-1]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1))

    @jax.jit
    def step(adapters, opt_state, frozen):
        loss, grads = jax.value_and_grad(loss_fn)(adapters, frozen)
        updates, opt_state = optimizer.update(grads, opt_state, adapters)
        return optax.apply_updates(adapters, updates), opt_state, loss

    losses = []
    for _ in range(4):
        trainable, opt_state, loss = step(trainable, opt_state, frozen)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert float(jnp.max(jnp.abs(trainable["q_proj"]["lora_B"]))) > 0
    for x, y in zip(jax.tree.leaves(frozen), jax.tree.leaves(frozen_copy)):
        assert x.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(x), y)
    merged = lora.merge_lora(frozen, trainable, cfg)
    assert merged["model"]["layers"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    assert merged["model"]["layers"]["self_attn"]["k_proj"] is frozen["model"]["layers"]["self_attn"]["k_proj"]


def test_adapter_sharding_rules_follow_base(base):
    from jaxrl_hf.mesh.rule_sets import get_rule_set
    from jaxrl_hf.mesh.rules import logical_to_specs
    rules = get_rule_set("fsdp").params
    axes = lora.adapter_logical_axes(param_logical_axes(CONFIG), CFG_ALL)
    specs = logical_to_specs(axes, lora.adapter_rules(rules))
    base_specs = logical_to_specs(param_logical_axes(CONFIG), rules)
    q = base_specs["model"]["layers"]["self_attn"]["q_proj"]["kernel"]
    assert tuple(specs["q_proj"]["lora_A"]) == (q[0], q[1], None)  # layers, embed (over dp), rank
    assert tuple(specs["q_proj"]["lora_B"]) == (q[0], None, *q[2:])
    down = base_specs["model"]["layers"]["mlp"]["down_proj"]["kernel"]
    assert tuple(specs["down_proj"]["lora_B"]) == (down[0], None, down[2])
    devices = np.array(jax.devices()[:8]).reshape(1, 1, 8) if len(jax.devices()) >= 8 else None
    if devices is None:
        return
    mesh = jax.sharding.Mesh(devices, ("pp", "tp", "dp"))
    shard = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                         is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    adapters = jax.device_put(_trained_adapters(base, CFG_ALL), shard)
    base_shard = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), base_specs,
                              is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    sharded_base = jax.device_put(base, base_shard)
    merged = jax.jit(lora.merge_lora, static_argnums=2, out_shardings=base_shard)(sharded_base, adapters, CFG_ALL)
    ref = lora.merge_lora(base, jax.device_get(adapters), CFG_ALL)
    for x, y in zip(jax.tree.leaves(merged), jax.tree.leaves(ref)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)
