"""Shared helpers for the models/rollout tests (tiny random configs, HF reference models)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf.models import DecoderConfig, forward, init_params


def tiny_config(**overrides) -> DecoderConfig:
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,),
                pad_token_id=0)
    base.update(overrides)
    return DecoderConfig(**base)


@functools.lru_cache(maxsize=32)
def random_params(config: DecoderConfig, seed: int = 0):
    """Random params with the norms and biases perturbed too, so every tensor's mapping matters (cached)."""
    params = init_params(config, seed)
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    out = [np.asarray(x) + rng.normal(0, 0.1, x.shape).astype(np.float32) for x in leaves]
    return jax.tree.unflatten(treedef, out)


jit_forward = jax.jit(forward, static_argnums=1)


def random_prompts(seed: int, rows: int, width: int, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(prompts, prompt_mask)`` ``[rows, width]`` int32: left-padded random prompts of 2..width tokens
    (ids >= 3, clear of pad/bos/eos), reproducible from ``seed``."""
    rng = np.random.default_rng(seed)
    prompts, mask = np.zeros((rows, width), np.int32), np.zeros((rows, width), np.int32)
    for i in range(rows):
        length = int(rng.integers(2, width + 1))
        prompts[i, width - length:] = rng.integers(3, vocab_size, length)
        mask[i, width - length:] = 1
    return prompts, mask


TINY_WORKER_MODEL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=4, max_position_embeddings=128)


def tiny_worker_config(*, lr: float, n: int, response_length: int, seed: int, **sections: dict) -> dict:
    """A worker config (a ``RunConfig`` mapping; the schema fills every other default) for the tiny random model:
    mini-batches of 2 prompts, micro-batches of 1 row, the native JAX engine. ``sections`` are deep-merged into
    (or add) top-level sections, e.g. ``actor={"shuffle": True, "optim": {"weight_decay": 0.0}}``."""
    config = {
        "model": {"path": "tiny-random", "tiny": dict(TINY_WORKER_MODEL), "seed": 0},
        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_device": 1, "optim": {"lr": lr}},
        "rollout": {"name": "jax", "n": n, "response_length": response_length, "seed": seed},
    }
    return _deep_merge(config, sections)


DP4_TP2_PLACEMENT = {"num_processes": 1, "devices_per_process": 8, "train": {"pp": 1, "tp": 2, "dp": 4}}
"""One process on 8 fake CPU devices, dp 4 x tp 2 (``placement`` of `tiny_worker_config`)."""


def local_actor(config: dict, role: str = "actor_rollout"):
    """An ``ActorRolloutRefWorker`` of ``config`` in this process, its model initialised, at global step 1."""
    from jaxrl_hf.controller.worker import WorkerContext
    from jaxrl_hf.workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker._instantiate(WorkerContext("w", "local", 0, 1), (config, role), {})
    worker.init_model()
    worker.set_step(1)
    return worker


def _deep_merge(base: dict, extra: dict) -> dict:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(
            merged.get(key), dict) else value
    return merged


def assert_smoke_run_trained(run_dir, steps: int) -> list[dict]:
    """The update records of a finished run's ``metrics.jsonl``: ``steps`` of them, numbered 1.., each with a
    response and a finite gradient norm."""
    import json
    import os

    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        records = [json.loads(line) for line in fh if line.strip()]
    updates = [r for r in records if "actor/pg_loss" in r]
    assert [r["step"] for r in updates] == list(range(1, steps + 1))
    for r in updates:
        assert r["response_length/mean"] > 0 and np.isfinite(r["actor/grad_norm"])
    return updates


def assert_same_log_probs_and_grads(plain, other, params, valid, bf16: bool) -> None:
    """``other(params)`` gives ``plain(params)``'s ``(log-probs, entropies)`` where ``valid`` and the gradient of a
    weighted sum of both, leaf by leaf relative to its largest entry (2e-5, or 2e-2 in bfloat16; 10x for grads)."""
    tol = 2e-2 if bf16 else 2e-5
    for a, b in zip(jax.jit(plain)(params), jax.jit(other)(params)):
        np.testing.assert_allclose(np.asarray(a) * valid, np.asarray(b) * valid, atol=tol, rtol=tol)
    weights = jnp.asarray(valid * np.linspace(-1.0, 1.0, valid.size).reshape(valid.shape))

    def loss(fn):
        return lambda p: jnp.sum(fn(p)[0] * weights) + 0.1 * jnp.sum(fn(p)[1] * weights)

    g_plain, g_other = jax.jit(jax.grad(loss(plain)))(params), jax.jit(jax.grad(loss(other)))(params)
    for a, b in zip(jax.tree.leaves(g_plain), jax.tree.leaves(g_other)):
        scale = max(float(np.abs(np.asarray(a, np.float32)).max()), 1e-6)
        np.testing.assert_allclose(np.asarray(b, np.float32) / scale, np.asarray(a, np.float32) / scale,
                                   atol=10 * tol)


def grouped_rollout_batch(ids, mask, positions, valid, prompt: int, seed: int = 5):
    """A rollout `Batch` of grouped rows (``bench_shared_prompt.grouped_rows``) with random advantages."""
    from jaxrl_hf.controller import Batch

    rng = np.random.default_rng(seed)
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                            "responses": ids[:, prompt:], "response_mask": valid.astype(np.int32),
                            "advantages": (rng.normal(size=valid.shape) * valid).astype(np.float32)})


def log_probs_and_update(worker, batch):
    """``(old log-probs, update metrics, parameter change)`` of an actor worker's ``compute_log_prob`` then
    ``update_actor`` on ``batch``."""
    logp = worker.compute_log_prob(batch)["old_log_probs"]
    before = [np.asarray(x) for x in jax.tree.leaves(worker.state.params)]
    metrics = worker.update_actor(batch).meta_info["metrics"]
    delta = np.concatenate([(np.asarray(x) - b).ravel() for x, b in zip(jax.tree.leaves(worker.state.params), before)])
    return logp, metrics, delta


def write_tiny_hf_dir(path, config: DecoderConfig, seed: int):
    """A tiny HF model directory: ``config``'s random params (`random_params`) and a real word-level tokenizer
    (``t<i>`` for id ``i``; bos t1, eos t2, pad t0), loadable by our loader and by transformers; returns ``path``
    as a string."""
    import json
    import os

    from tokenizers import Tokenizer, models

    from jaxrl_hf.models import save_hf_dir

    save_hf_dir(path, random_params(config, seed=seed), config)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(config.vocab_size)}, unk_token="t0")).save(
        os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2",
                   "pad_token": "t0"}, fh)
    return str(path)


def left_padded_update_columns(vocab_size: int, prompt: int, response: int, pads: tuple[int, ...],
                               early_stop: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """One given update batch's columns: ``len(pads)`` rows of random ids ``[rows, prompt + response]`` with row
    ``i``'s first ``pads[i]`` columns padding, its masks and positions, ``responses``, ``response_mask`` (``early_stop
    = (row, t)``: that row's response ends before token ``t``) and ±1, ±0.5 advantages (seeded, reproducible)."""
    rng = np.random.default_rng(0)
    rows = len(pads)
    ids = rng.integers(3, vocab_size, (rows, prompt + response)).astype(np.int32)
    mask = np.ones((rows, prompt + response), np.int32)
    for row, pad in enumerate(pads):
        mask[row, :pad], ids[row, :pad] = 0, 0
    response_mask = np.ones((rows, response), np.float32)
    if early_stop is not None:
        response_mask[early_stop[0], early_stop[1]:] = 0
    advantages = np.resize(np.array([1.0, -1.0, 0.5, -0.5], np.float32), rows)[:, None] * response_mask
    return {"input_ids": ids, "attention_mask": mask,
            "position_ids": np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32), "responses": ids[:, prompt:],
            "response_mask": response_mask, "advantages": advantages}


def assert_hf_round_trip(tmp_path, architecture: str):
    """``tmp_path/hf`` (a transformers checkpoint) -> params -> HF names bit for bit; ours -> config.json +
    safetensors -> ours unchanged; transformers loads our export as ``architecture``. Returns ``(config, the
    original state dict)``."""
    import torch
    import transformers
    from safetensors.numpy import load_file

    from jaxrl_hf.models import load_hf_dir, save_hf_dir
    from jaxrl_hf.models.weights_hf import params_to_hf_state_dict

    config, params = load_hf_dir(tmp_path / "hf")
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = params_to_hf_state_dict(params, config)
    assert sorted(back) == sorted(original)
    for name, value in original.items():
        assert back[name].shape == value.shape and np.array_equal(back[name], value), name
    save_hf_dir(tmp_path / "ours", params, config)
    config2, params2 = load_hf_dir(tmp_path / "ours")
    assert config2 == config
    assert jax.tree.all(jax.tree.map(np.array_equal, params, params2))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32)
    assert type(reloaded).__name__ == architecture
    return config, original


def assert_logits_match_hf(hf_model, params, config, ids: np.ndarray, mask: np.ndarray, tol: float = 1e-4) -> None:
    """Our float32 logits of left-padded ``ids`` equal the transformers model's on every unmasked position."""
    import torch

    ours = np.asarray(jax.jit(forward, static_argnums=1)(params, config, jnp.asarray(ids), jnp.asarray(mask)))
    with torch.no_grad():
        positions = torch.from_numpy(np.maximum(np.cumsum(mask, -1) - 1, 0))
        ref = hf_model(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                       position_ids=positions).logits.numpy()
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], ref[valid], atol=tol, rtol=tol)
