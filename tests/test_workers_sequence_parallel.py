"""Ulysses sequence parallelism (verl's ``ulysses_sequence_parallel_size``) through the one model code path.

* The compiled actor and critic training steps on ``dp2 × sp2`` (``fsdp_sp``: params ZeRO-3 over all 4 devices)
  give the loss, gradient norm and metrics of megatron ``dp4`` on the same rows; their HLO holds all-to-alls inside
  the sp groups (none without sp), and the hidden states come out sequence-sharded. The model has one kv head,
  so attention repeats it to split over sp, and the sequence (9 tokens) is left-padded to a multiple of sp.
* The critic worker with ``critic.ulysses_sequence_parallel_size=2`` computes the values and takes the update of
  the critic without it.
* Bad sizes are errors naming the config key (config validation and workers).
"""

from __future__ import annotations

import copy
import functools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from _models_helpers import TINY_WORKER_MODEL, random_params, random_prompts, tiny_config, tiny_worker_config
from jaxrl_hf.config import ConfigError, load_config
from jaxrl_hf.trainer.metrics import is_wall_clock_metric
from jaxrl_hf.config.schema import ActorConfig, CriticConfig, OptimConfig
from jaxrl_hf.controller import Batch
from jaxrl_hf.controller.worker import WorkerContext
from jaxrl_hf.mesh.device_mesh import build_train_mesh, flat_device_ids
from jaxrl_hf.mesh.hlo_collectives import summarize
from jaxrl_hf.mesh.rule_sets import FSDP_SP, MEGATRON, RuleSet
from jaxrl_hf.mesh.topology import TrainParallel, training_sp_groups
from jaxrl_hf.models import value_param_logical_axes, value_params_from_lm
from jaxrl_hf.models.forward import hidden_states
from jaxrl_hf.workers import ActorRolloutRefWorker, CriticWorker
from jaxrl_hf.workers.common import WorkerConfigError, lm_param_shardings, pad_sequences_to, param_shardings
from jaxrl_hf.workers.losses import (ACTOR_SUMMED_METRICS, CRITIC_SUMMED_METRICS, actor_loss, actor_loss_config,
                                     critic_loss, critic_loss_config, lm_log_prob_fn, response_denominator,
                                     value_head_fn)
from jaxrl_hf.workers.optim import make_optimizer
from jaxrl_hf.workers.train_step import init_train_state, make_train_step, train_state_shardings

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")

CONFIG = tiny_config(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=1, head_dim=16, num_hidden_layers=2)
PROMPT, RESPONSE = 5, 4  # width 9: padded to 10 for sp = 2


def step_inputs(rows=8, micro=2, seed=0):
    """``[micro, rows/micro, ...]`` arrays of one mini-batch (left padding on some rows, one short response)."""
    rng = np.random.default_rng(seed)
    width = PROMPT + RESPONSE
    ids = rng.integers(3, CONFIG.vocab_size, (rows, width)).astype(np.int32)
    attn = np.ones((rows, width), np.int32)
    attn[::3, :2] = 0
    mask = np.ones((rows, RESPONSE), np.int32)
    mask[1, 2:] = 0
    data = dict(input_ids=ids, attention_mask=attn,
                position_ids=np.maximum(np.cumsum(attn, axis=1) - 1, 0).astype(np.int32),
                responses=ids[:, PROMPT:], response_mask=mask,
                advantages=rng.normal(size=(rows, RESPONSE)).astype(np.float32),
                old_log_probs=(-np.log(CONFIG.vocab_size) + rng.normal(0, 0.2, (rows, RESPONSE))).astype(np.float32),
                values=rng.normal(0, 0.1, (rows, RESPONSE)).astype(np.float32),
                returns=rng.normal(0, 1.0, (rows, RESPONSE)).astype(np.float32))
    return {k: v.reshape(micro, rows // micro, *v.shape[1:]) for k, v in data.items()}


def train_step(role: str, rule_set: RuleSet, train: TrainParallel):
    """(mesh, state, placed micro-batches, jitted step) of the actor's or critic's loss on the first 4 devices."""
    mesh = build_train_mesh(train, jax.devices()[:train.num_devices])
    rules = rule_set.activations
    optim = OptimConfig(lr=1e-3)
    optimizer = make_optimizer(optim, grad_clip=1.0)
    if role == "actor":
        params = random_params(CONFIG, 3)
        shardings = lm_param_shardings(CONFIG, params, mesh, rule_set=rule_set)
        cfg = actor_loss_config(ActorConfig(), temperature=1.0)
        loss_fn = functools.partial(actor_loss, log_prob_fn=lm_log_prob_fn(CONFIG, mesh, rules), cfg=cfg)
        summed = ACTOR_SUMMED_METRICS
    else:
        params = value_params_from_lm(random_params(CONFIG, 3), CONFIG, 4, head_std=0.1)
        shardings = param_shardings(params, value_param_logical_axes(CONFIG), mesh, rule_set=rule_set)
        cfg = critic_loss_config(CriticConfig())
        loss_fn = functools.partial(critic_loss, value_fn=value_head_fn(CONFIG, mesh, rules), cfg=cfg)
        summed = CRITIC_SUMMED_METRICS
    state_sh = train_state_shardings(params, shardings, optimizer, mesh)
    state = jax.jit(lambda p: init_train_state(p, optimizer), out_shardings=state_sh)(jax.device_put(params, shardings))
    step = make_train_step(loss_fn, optim, optimizer=optimizer, denominator_fn=response_denominator(cfg.loss_agg_mode),
                           summed_aux=summed, state_shardings=state_sh, donate=False)
    arrays = pad_sequences_to(step_inputs(), train.sp)  # the workers' padding (a no-op for sp = 1)
    micro = {k: jax.device_put(v, NamedSharding(mesh, P(None, "dp"))) for k, v in arrays.items()}
    return mesh, state, micro, step


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_sp_step_matches_dp4_and_switches_layout_by_all_to_all(role):
    results, hlo = {}, {}
    for label, rule_set, train in (("megatron dp4", MEGATRON, TrainParallel(1, 1, 4)),
                                   ("fsdp dp2 x sp2", FSDP_SP, TrainParallel(1, 1, 4, sp=2))):
        mesh, state, micro, step = train_step(role, rule_set, train)
        compiled = step.lower(state, micro).compile()
        hlo[label] = summarize(compiled.as_text(), flat_device_ids(mesh))
        _, metrics = compiled(state, micro)
        results[label] = {k: float(v) for k, v in metrics.items()}
    reference = results["megatron dp4"]
    assert reference["grad_norm"] > 0 and reference["loss"] != 0
    for key, value in results["fsdp dp2 x sp2"].items():
        np.testing.assert_allclose(value, reference[key], rtol=1e-5, atol=1e-7, err_msg=key)
    # Ulysses: sequence-sharded -> head-sharded and back is an all-to-all within each sp group, in every layer's
    # forward and backward; nothing of the kind without sp
    assert "all-to-all" not in hlo["megatron dp4"].kinds
    sp_groups = set(training_sp_groups(TrainParallel(1, 1, 4, sp=2)))
    assert sp_groups == {(0, 1), (2, 3)}
    assert hlo["fsdp dp2 x sp2"].device_groups("all-to-all") == sp_groups
    assert sum(op.kind == "all-to-all" for op in hlo["fsdp dp2 x sp2"].ops) >= 4


def test_activations_are_sequence_sharded():
    """The hidden states of the sp forward: rows over dp, the (padded) sequence over sp; each device holds
    ``rows/2 × width/2`` positions; the values are those of the unsharded model."""
    train = TrainParallel(1, 1, 4, sp=2)
    mesh = build_train_mesh(train, jax.devices()[:4])
    params = random_params(CONFIG, 3)
    placed = jax.device_put(params, lm_param_shardings(CONFIG, params, mesh, rule_set=FSDP_SP))
    inputs = pad_sequences_to({k: v[0] for k, v in step_inputs().items()}, train.sp)
    rows = NamedSharding(mesh, P("dp"))
    ids, attn, pos = (jax.device_put(inputs[k], rows) for k in ("input_ids", "attention_mask", "position_ids"))
    hidden = jax.jit(lambda p, i, a, q: hidden_states(p, CONFIG, i, a, q, mesh, FSDP_SP.activations))(
        placed, ids, attn, pos)
    assert hidden.sharding.spec == P("dp", "sp") and hidden.shape == (4, 10, 64)
    assert {s.data.shape for s in hidden.addressable_shards} == {(2, 5, 64)}
    reference = jax.jit(lambda p, i, a, q: hidden_states(p, CONFIG, i, a, q))(params, inputs["input_ids"],
                                                                               inputs["attention_mask"],
                                                                               inputs["position_ids"])
    valid = inputs["attention_mask"] != 0
    np.testing.assert_allclose(np.asarray(hidden)[valid], np.asarray(reference)[valid], atol=1e-5)


# ------------------------------------------------------------------------------------------ workers
P_LEN, R_LEN, PROMPTS, N = 5, 6, 4, 2
CRITIC = tiny_worker_config(
    lr=5e-3, n=N, response_length=R_LEN, seed=7, actor={"strategy": "fsdp"},
    critic={"enable": True, "strategy": "fsdp", "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_device": 1,
            "value_head_init_std": 0.1},
    placement={"num_processes": 1, "devices_per_process": 8, "train": {"pp": 1, "tp": 1, "dp": 8}})


def make(cls, config, *args):
    return cls._instantiate(WorkerContext("w", "local", 0, 1), (config, *args), {})


def test_critic_worker_with_sp_matches_without():
    rng = np.random.default_rng(0)
    prompts, prompt_mask = random_prompts(0, PROMPTS * N, P_LEN, TINY_WORKER_MODEL["vocab_size"])
    responses = rng.integers(3, TINY_WORKER_MODEL["vocab_size"], (PROMPTS * N, R_LEN)).astype(np.int32)
    response_mask = np.ones_like(responses)
    response_mask[0, 3:] = 0
    attention_mask = np.concatenate([prompt_mask, response_mask], axis=1)
    batch = Batch.from_dict({"input_ids": np.concatenate([prompts, responses], axis=1), "responses": responses,
                             "attention_mask": attention_mask, "response_mask": response_mask,
                             "position_ids": np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0).astype(np.int32)})
    critics, values = {}, {}
    for sp in (1, 2):
        config = copy.deepcopy(CRITIC)
        config["critic"]["ulysses_sequence_parallel_size"] = sp
        # rows per micro-batch = micro_per_device · dp/sp (verl's meaning): 8 both times, so the averaged metrics
        # (vpred_mean, vf_clipfrac: means over micro-batches) compare too
        config["critic"]["ppo_micro_batch_size_per_device"] = sp
        critics[sp] = make(CriticWorker, config)
        critics[sp].init_model()
        values[sp] = critics[sp].compute_values(batch)["values"]
    assert dict(critics[2].mesh.shape) == {"pp": 1, "tp": 1, "dp": 4, "sp": 2} and critics[2].rule_set.name == "fsdp_sp"
    assert np.abs(values[1]).max() > 0
    np.testing.assert_allclose(values[2], values[1], atol=1e-6)
    returns = (values[1] + rng.normal(0, 1, values[1].shape) * response_mask).astype(np.float32)
    update = batch.union(Batch.from_dict({"values": values[1], "returns": returns}))
    metrics = {sp: critics[sp].update_critic(update).meta_info["metrics"] for sp in (1, 2)}
    assert metrics[1]["critic/grad_norm"] > 0
    for key in metrics[1]:
        if not is_wall_clock_metric(key):  # not the host's memory counters (critic/perf/*)
            np.testing.assert_allclose(metrics[2][key], metrics[1][key], rtol=1e-5, atol=1e-7, err_msg=key)


# ------------------------------------------------------------------------------------------ errors
def test_bad_sizes_are_errors_naming_the_key():
    base = ["placement.devices_per_process=4", "placement.train.dp=4"]
    sp_key = "actor_rollout_ref.actor.ulysses_sequence_parallel_size"  # verl's spelling
    with pytest.raises(ConfigError, match=r"'actor.ulysses_sequence_parallel_size'=3: must divide placement.train.dp"):
        load_config("grpo", preset="smoke", overrides=[*base, f"{sp_key}=3"])
    with pytest.raises(ConfigError, match=r"'critic.ulysses_sequence_parallel_size'=8: must divide placement.train"):
        load_config("ppo", preset="smoke", overrides=[*base, "critic.ulysses_sequence_parallel_size=8"])
    with pytest.raises(ConfigError, match=r"'ref.ulysses_sequence_parallel_size'=1: the reference runs on the actor's"):
        load_config("grpo", preset="smoke", overrides=[*base, f"{sp_key}=2",
                                                       "actor_rollout_ref.ref.ulysses_sequence_parallel_size=1"])
    with pytest.raises(ConfigError, match=r"'actor.ppo_mini_batch_size'=1: a mini-batch of 1 prompts x rollout.n=2 = 2 "
                                          r"sequences must split evenly over placement.train.dp/actor.ulysses_seq"):
        load_config("grpo", preset="smoke", overrides=["placement.devices_per_process=8", "placement.train.dp=8",
                                                       f"{sp_key}=2", "actor.ppo_mini_batch_size=1"])
    config = load_config("ppo", preset="smoke", overrides=[*base, f"{sp_key}=2"])
    assert (config.actor.ulysses_sequence_parallel_size, config.critic.ulysses_sequence_parallel_size,
            config.ref.ulysses_sequence_parallel_size) == (2, 2, 2)  # the critic and the ref follow the actor

    def worker_config(**sections):
        config = copy.deepcopy(CRITIC)
        for name, values in sections.items():
            config[name] = {**config.get(name, {}), **values}
        return config

    with pytest.raises(WorkerConfigError, match=r"actor.ulysses_sequence_parallel_size=3: must be an integer >= 1 "
                                                r"dividing placement.train.dp=8"):
        make(ActorRolloutRefWorker, worker_config(actor={"ulysses_sequence_parallel_size": 3}), "actor_rollout")
    with pytest.raises(WorkerConfigError, match=r"critic.ulysses_sequence_parallel_size=16: must be an integer"):
        make(CriticWorker, worker_config(critic={"ulysses_sequence_parallel_size": 16}))
    with pytest.raises(WorkerConfigError, match=r"actor.strategy='sp': rule set 'sp' shards over mesh axes \['sp'\] "
                                                r"that the training mesh \('pp', 'tp', 'dp'\) does not have"):
        make(ActorRolloutRefWorker, worker_config(actor={"strategy": "sp"}), "ref")
    heads = worker_config(actor={"ulysses_sequence_parallel_size": 8})  # 4 query heads cannot split over 8
    with pytest.raises(WorkerConfigError, match=r"actor.ulysses_sequence_parallel_size=8: the model's 4 attention "
                                                r"heads do not split over placement.train.tp·sp = 1·8 devices"):
        make(ActorRolloutRefWorker, heads, "ref").init_model()
