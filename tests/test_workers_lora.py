"""LoRA in the real actor worker (8 fake CPU devices, tiny random Llama, a hybrid generation layout):
only adapters are trained and checkpointed, the frozen base stays bit-identical, and the rollout engine serves
base + adapters merged (its log-probs equal an independent forward of the merged weights)."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _models_helpers import TINY_WORKER_MODEL, random_prompts, tiny_worker_config
from jaxrl_hf.controller import Batch
from jaxrl_hf.controller.worker import WorkerContext
from jaxrl_hf.models import forward
from jaxrl_hf.models.lora import adapter_param_count, merge_lora
from jaxrl_hf.workers import ActorRolloutRefWorker

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")

CONFIG = tiny_worker_config(
    lr=5e-2, n=2, response_length=6, seed=3,
    model={"lora_rank": 4, "lora_alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    placement={"num_processes": 1, "devices_per_process": 8, "train": {"pp": 1, "tp": 2, "dp": 4},
               "generate": {"pp": 1, "tp": 1}})


def host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


@pytest.fixture(scope="module")
def worker():
    w = ActorRolloutRefWorker._instantiate(WorkerContext("actor", "local", 0, 1), (copy.deepcopy(CONFIG),
                                                                                   "actor_rollout_ref"), {})
    w.init_model()
    return w


def _update_batch(worker, seed):
    prompts, mask = random_prompts(seed, 4, 5, TINY_WORKER_MODEL["vocab_size"])
    gen = worker.generate_sequences(Batch.from_dict({"prompts": prompts, "prompt_mask": mask}))
    batch = gen.union(worker.compute_log_prob(gen))
    adv = np.where(np.arange(len(batch))[:, None] % 2 == 0, 1.0, -1.0) * gen["response_mask"]
    return batch.union(Batch.from_dict({"advantages": adv.astype(np.float32)}))


def test_lora_trains_only_adapters_and_rollout_serves_merged_weights(worker, tmp_path):
    assert worker.layout is not None  # the hybrid-engine reshard path
    adapters0 = host(worker.state.params)
    assert set(adapters0) == {"q_proj", "v_proj", "down_proj"}
    n_opt = sum(int(np.size(x)) for x in jax.tree.leaves(worker.state.opt_state) if np.ndim(x) > 0)
    assert n_opt == 2 * adapter_param_count(adapters0)  # Adam moments of the adapters, nothing for the base
    base0 = host(worker.lora.base)
    for _ in range(2):
        out = worker.update_actor(_update_batch(worker, seed=len(jax.tree.leaves(adapters0))))
        assert np.isfinite(out.meta_info["metrics"]["actor/pg_loss"])
    adapters = host(worker.state.params)
    assert np.abs(adapters["q_proj"]["lora_B"]).max() > 0  # B moved off zero
    for x, y in zip(jax.tree.leaves(host(worker.lora.base)), jax.tree.leaves(base0), strict=True):
        np.testing.assert_array_equal(x, y)  # the frozen base is bit-identical

    prompts, mask = random_prompts(11, 4, 5, TINY_WORKER_MODEL["vocab_size"])
    gen = worker.generate_sequences(Batch.from_dict({"prompts": prompts, "prompt_mask": mask}))
    merged = merge_lora(base0, adapters, worker.lora.cfg)
    logits = np.asarray(forward(merged, worker.model.config, jnp.asarray(gen["input_ids"]),
                                jnp.asarray(gen["attention_mask"])), np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    p = prompts.shape[1]
    resp = np.asarray(gen["responses"])
    want = np.take_along_axis(logp[:, p - 1:-1], resp[..., None], -1)[..., 0]
    rmask = np.asarray(gen["response_mask"]) > 0
    np.testing.assert_allclose(np.asarray(gen["rollout_log_probs"])[rmask], want[rmask], atol=1e-5)
    plain = np.asarray(forward(base0, worker.model.config, jnp.asarray(gen["input_ids"]),
                               jnp.asarray(gen["attention_mask"])))
    assert np.abs(plain - logits).max() > 1e-3  # the adapters matter

    ckpt = worker.save_checkpoint(str(tmp_path / "ckpt"))
    restored = worker.load_checkpoint(ckpt)
    assert restored == worker.global_step
    for x, y in zip(jax.tree.leaves(host(worker.state.params)), jax.tree.leaves(adapters), strict=True):
        np.testing.assert_array_equal(x, y)
    export = worker.export_hf(str(tmp_path / "hf"))
    import os

    from jaxrl_hf.workers.checkpoint import LORA_ADAPTER_DIR
    assert os.path.isfile(os.path.join(export, LORA_ADAPTER_DIR, "adapter_model.safetensors"))


def test_offline_export_merges_the_checkpointed_adapters_into_the_base(worker, tmp_path):
    """launch/export_hf.py on a LoRA run's checkpoint (adapters only on disk): the base from the run's config.yaml
    plus the adapters, merged, equals what the worker itself exports (trainer.export_hf), tensor for tensor, and the
    PEFT adapter dir beside it is byte-identical."""
    import os

    from safetensors.numpy import load_file

    from jaxrl_hf.config.loader import dump_config
    from jaxrl_hf.models.weights_hf import params_to_hf_state_dict
    from jaxrl_hf.trainer.checkpointing import CheckpointManager
    from jaxrl_hf.trainer.hf_export import export_checkpoint

    worker.update_actor(_update_batch(worker, 5))  # adapters off zero, so the merge matters
    run = tmp_path / "run"
    CheckpointManager(str(run / "checkpoints")).save(1, {"actor": worker.save_checkpoint}, {"global_step": 1})
    dump_config(worker.config, run / "config.yaml")
    offline = export_checkpoint(str(run), str(tmp_path / "offline"), dtype="float32")
    online = worker.export_hf(str(tmp_path / "online"))
    mine, theirs = load_file(os.path.join(offline, "model.safetensors")), load_file(os.path.join(online,
                                                                                                "model.safetensors"))
    assert sorted(mine) == sorted(theirs)
    for name in theirs:  # the worker exports bf16 by default: the offline float32 merge, rounded, is identical
        np.testing.assert_array_equal(mine[name].astype(theirs[name].dtype).view(np.uint16),
                                      theirs[name].view(np.uint16), err_msg=name)
    base = params_to_hf_state_dict(host(worker.lora.base), worker.model.config)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert np.abs(mine[name] - base[name]).max() > 1e-4, name  # the adapters' delta is in the export
    np.testing.assert_array_equal(mine["model.layers.0.self_attn.k_proj.weight"],  # an untargeted module: the base
                                  base["model.layers.0.self_attn.k_proj.weight"])
    from jaxrl_hf.workers.checkpoint import LORA_ADAPTER_DIR
    for file in ("adapter_config.json", "adapter_model.safetensors"):  # the adapters alone too, as the worker's
        with open(os.path.join(offline, LORA_ADAPTER_DIR, file), "rb") as a, \
                open(os.path.join(online, LORA_ADAPTER_DIR, file), "rb") as b:
            assert a.read() == b.read(), file
