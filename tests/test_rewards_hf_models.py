"""Reward models saved by transformers (``LlamaForSequenceClassification`` / ``Qwen2ForSequenceClassification``,
random tiny configs, ``num_labels=1``, ``pad_token_id`` set) load in the reward-model path (rm_io and the
RewardModelWorker) and score as transformers does (its score is read at the last non-pad token)."""

from __future__ import annotations

import copy

import jax
import numpy as np
import pytest

from jaxrl_hf.controller import Batch
from jaxrl_hf.controller.worker import WorkerContext
from jaxrl_hf.rewards.rm_io import load_reward_model
from jaxrl_hf.workers import RewardModelWorker

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices: set "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")

VOCAB, PAD, EOS = 96, 0, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, num_labels=1, pad_token_id=PAD, eos_token_id=EOS,
              bos_token_id=1, initializer_range=0.2)


def _saved_classifier(kind, path, **save_kwargs):
    """A random ``<kind>ForSequenceClassification`` (norms perturbed too) saved by ``save_pretrained``."""
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(head_dim=16, **COMMON)
        model = transformers.LlamaForSequenceClassification(config)
    else:
        config = transformers.Qwen2Config(**COMMON)
        model = transformers.Qwen2ForSequenceClassification(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.eval().save_pretrained(path, **save_kwargs)
    return model


def _batch(seed, rows=8, prompt=5, response=7):
    """Left-padded prompts + right-padded responses (the trainer's layout); no real token equals the pad id."""
    rng = np.random.default_rng(seed)
    ids = np.full((rows, prompt + response), PAD, np.int32)
    mask = np.zeros_like(ids)
    rmask = np.zeros((rows, response), np.int32)
    for i in range(rows):
        p, r = int(rng.integers(1, prompt + 1)), int(rng.integers(1, response + 1))
        ids[i, prompt - p:prompt + r] = rng.integers(3, VOCAB, p + r)
        mask[i, prompt - p:prompt + r] = 1
        rmask[i, :r] = 1
    position_ids = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return ids, mask, rmask, position_ids


def _transformers_scores(model, ids, mask, position_ids):
    """transformers' own batched scoring (its pooling reads each row's logit at the last non-pad token)."""
    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(position_ids, dtype=torch.long))
    return out.logits[:, 0].double().numpy()


@pytest.mark.parametrize("kind,save_kwargs", [("llama", {}), ("qwen2", {"max_shard_size": "60KB"})])
def test_transformers_sequence_classifier_scores_match(kind, save_kwargs, tmp_path):
    model = _saved_classifier(kind, str(tmp_path / kind), **save_kwargs)
    if save_kwargs:
        assert (tmp_path / kind / "model.safetensors.index.json").is_file()  # sharded by transformers
    ids, mask, rmask, position_ids = _batch(1)
    want = _transformers_scores(model, ids, mask, position_ids)
    assert want.std() > 0.05  # the scores differ enough for the comparison to mean something

    rm = load_reward_model(str(tmp_path / kind))
    assert (rm.pad_id, rm.eos_id, rm.tokenizer) == (PAD, EOS, None)
    np.testing.assert_allclose(rm.score_ids(ids, mask), want, atol=1e-4)
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        rm.score("1+1", "2")

    config = {"model": {"path": "tiny-random"},
              "reward_model": {"path": str(tmp_path / kind), "micro_batch_size_per_device": 1},
              "placement": {"num_processes": 1, "devices_per_process": 8, "train": {"pp": 1, "tp": 1, "dp": 8}}}
    worker = RewardModelWorker._instantiate(WorkerContext("reward", "local", 0, 1), (copy.deepcopy(config),), {})
    worker.init_model()
    out = worker.compute_rm_score(Batch.from_dict({"input_ids": ids, "attention_mask": mask,
                                                   "position_ids": position_ids, "response_mask": rmask}))
    scores = out["rm_scores"]
    last = rmask.sum(1) - 1
    np.testing.assert_allclose(scores[np.arange(len(ids)), last], want, atol=1e-4)
    assert np.count_nonzero(scores) == len(ids)


def test_bfloat16_checkpoint_and_bad_directories_are_named(tmp_path):
    _saved_classifier("llama", str(tmp_path / "bf16")).to(torch.bfloat16).save_pretrained(str(tmp_path / "bf16"))
    # the reference: transformers loading the bf16 files upcast to float32 (as we do)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "bf16"),
                                                                           dtype=torch.float32).eval()
    ids, mask, _, position_ids = _batch(2)
    want = _transformers_scores(model, ids, mask, position_ids)
    np.testing.assert_allclose(load_reward_model(str(tmp_path / "bf16")).score_ids(ids, mask), want, atol=1e-4)

    two = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(head_dim=16, **dict(COMMON, num_labels=2)))
    two.save_pretrained(str(tmp_path / "two"))
    with pytest.raises(ValueError, match=r"two/config.json: num_labels=2"):
        load_reward_model(str(tmp_path / "two"))
    lm = transformers.LlamaForCausalLM(transformers.LlamaConfig(head_dim=16, **COMMON))
    lm.save_pretrained(str(tmp_path / "lm"))
    with pytest.raises(ValueError, match=r"lm/config.json: architectures=\['LlamaForCausalLM'\]"):
        load_reward_model(str(tmp_path / "lm"))
    with pytest.raises(FileNotFoundError, match="no reward_model.json and no config.json"):
        load_reward_model(str(tmp_path))
