"""Save and load a trained reward model as an HF-style directory.

Layout of a reward-model directory::

    model.safetensors       HF LlamaForSequenceClassification names: model.* + score.weight [1, hidden]
    config.json             HF config (architectures = [...ForSequenceClassification], num_labels = 1)
    tokenizer.json, tokenizer_config.json, ...   copied from the backbone's directory
    reward_model.json       how a sequence is scored + training metadata (pairs, steps, accuracies)

A ``LlamaForSequenceClassification`` / ``Qwen2ForSequenceClassification`` (``num_labels=1``) saved by
transformers loads as well: without ``reward_model.json`` the eos/pad ids come from its ``config.json``, the
weights may be sharded and in any float dtype, and the tokenizer files are optional (``score_ids`` needs none).

``load_reward_model(dir)`` returns a ``RewardModel`` whose ``score(prompt_messages, response)`` gives
the float reward; a reward-model worker calls ``score_batch`` or ``score_ids`` on token ids it already has.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from jaxrl_hf.models.config import HF_ARCHITECTURES, DecoderConfig
from jaxrl_hf.models.tokenizer import Tokenizer
from jaxrl_hf.models.value_head import hf_state_dict_to_value_params, value_params_to_hf_state_dict
from jaxrl_hf.models.weights_hf import iter_safetensors
from jaxrl_hf.rewards.rm_data import encode_sequence, pad_right
from jaxrl_hf.rewards.rm_training import make_score_fn

METADATA_FILE = "reward_model.json"
FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
SEQUENCE_LAYOUT = "chat_template(prompt, add_generation_prompt=True) + response + eos; score at last token"


def reward_model_hf_config(config: DecoderConfig) -> dict[str, Any]:
    """``config.json`` for the value model: the decoder's HF config as a 1-label sequence classifier."""
    hf = config.to_hf_dict()
    lm_class = HF_ARCHITECTURES[config.model_type]  # Gemma 3's text-only classifier has "Text" in its name
    lm_class = "Gemma3TextForCausalLM" if config.model_type == "gemma3_text" else lm_class
    hf["architectures"] = [lm_class.replace("ForCausalLM", "ForSequenceClassification")]
    hf["num_labels"] = 1
    hf["id2label"] = {"0": "LABEL_0"}
    hf["label2id"] = {"LABEL_0": 0}
    return hf


def save_reward_model(out_dir: str | os.PathLike, params: Any, config: DecoderConfig, tokenizer_dir: str,
                      eos_id: int, pad_id: int, metadata: Mapping[str, Any] | None = None) -> str:
    """Write weights, config, tokenizer files and ``reward_model.json`` into ``out_dir``; returns it."""
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    state = value_params_to_hf_state_dict(jax.device_get(params), config)
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in state.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(reward_model_hf_config(config), fh, indent=2)
    copied = []
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, name)):
            shutil.copyfile(src, os.path.join(out_dir, name))
            copied.append(name)
    if "tokenizer.json" not in copied and not os.path.isfile(os.path.join(out_dir, "tokenizer.json")):
        raise FileNotFoundError(f"save_reward_model: no tokenizer.json in {tokenizer_dir} to copy")
    meta = {"format_version": FORMAT_VERSION, "sequence_layout": SEQUENCE_LAYOUT, "eos_token_id": int(eos_id),
            "pad_token_id": int(pad_id), **dict(metadata or {})}
    with open(os.path.join(out_dir, METADATA_FILE), "w") as fh:
        json.dump(meta, fh, indent=2)
    return out_dir


@dataclass
class RewardModel:
    """A loaded reward model: ``score(prompt_messages, response) -> float`` (higher = preferred)."""

    config: DecoderConfig
    params: Any
    tokenizer: Tokenizer | None
    path: str
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def eos_id(self) -> int:
        if self.metadata.get("eos_token_id") is None:
            raise ValueError(f"reward model {self.path}: no eos_token_id in its config.json to end a response with")
        return int(self.metadata["eos_token_id"])

    @property
    def pad_id(self) -> int:
        return int(self.metadata["pad_token_id"])

    @cached_property
    def _score_fn(self) -> Any:
        return make_score_fn(self.config)

    def encode(self, prompt: Sequence[Mapping[str, Any]] | str, response: str) -> list[int]:
        """Token ids of the scored sequence (the layout the model was trained on)."""
        if self.tokenizer is None:
            raise ValueError(f"reward model {self.path} has no tokenizer.json: score token ids (score_ids), or copy "
                             "the tokenizer files of its base model into the directory")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return encode_sequence(self.tokenizer, messages, response, self.eos_id)

    def score_ids(self, input_ids: Any, attention_mask: Any) -> np.ndarray:
        """Rewards ``[B]`` float32 for int ``input_ids [B, T]`` (read at each row's last masked-in token)."""
        ids = np.asarray(input_ids, np.int32)
        mask = np.asarray(attention_mask, np.int32)
        if ids.ndim != 2 or ids.shape != mask.shape:
            raise ValueError(f"score_ids: input_ids {ids.shape} and attention_mask {mask.shape} must be equal [B, T]")
        if not mask.any(axis=1).all():
            raise ValueError(f"score_ids: rows {np.flatnonzero(~mask.any(axis=1)).tolist()} have no tokens")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"score_ids: token ids out of range [0, {self.config.vocab_size})")
        return np.asarray(self._score_fn(self.params, jnp.asarray(ids), jnp.asarray(mask)), np.float32)

    def score_batch(self, items: Sequence[tuple[Sequence[Mapping[str, Any]] | str, str]],
                    batch_size: int = 16, bucket: int = 64) -> np.ndarray:
        """Rewards ``[N]`` for ``(prompt, response)`` items, in batches padded to multiples of ``bucket``."""
        sequences = [self.encode(prompt, response) for prompt, response in items]
        out = np.zeros(len(sequences), np.float32)
        for start in range(0, len(sequences), batch_size):
            chunk = sequences[start : start + batch_size]
            length = -(-max(len(s) for s in chunk) // bucket) * bucket
            ids, mask = pad_right(chunk + [chunk[0]] * (batch_size - len(chunk)), length, self.pad_id)
            out[start : start + len(chunk)] = self.score_ids(ids, mask)[: len(chunk)]
        return out

    def score(self, prompt: Sequence[Mapping[str, Any]] | str, response: str) -> float:
        """The reward of one response to ``prompt`` (chat messages or a plain user string)."""
        return float(self.score_batch([(prompt, response)], batch_size=1)[0])


def _hf_metadata(path: str) -> dict[str, Any]:
    """What ``reward_model.json`` would say, for a directory saved by transformers (``*ForSequenceClassification``
    with ``num_labels = 1``): eos/pad ids from its ``config.json`` (pad: else eos, else 0; a pad only pads)."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path} is not a reward-model directory: no {METADATA_FILE} and no config.json")
    with open(file) as fh:
        hf = json.load(fh)
    archs = hf.get("architectures") or []
    if not any(a.endswith("ForSequenceClassification") for a in archs):
        classifiers = sorted(a.replace("ForCausalLM", "ForSequenceClassification") for a in HF_ARCHITECTURES.values())
        raise ValueError(f"{file}: architectures={archs}; a reward model is a ...ForSequenceClassification "
                         f"(e.g. {classifiers}) or a directory with {METADATA_FILE}")
    labels = hf.get("num_labels", len(hf.get("id2label") or {}) or 2)
    if labels != 1:
        raise ValueError(f"{file}: num_labels={labels}; a reward model has one output (num_labels=1)")
    eos = hf.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    pad = hf.get("pad_token_id")
    return {"format_version": FORMAT_VERSION, "sequence_layout": "as trained (transformers checkpoint)",
            "eos_token_id": eos, "pad_token_id": pad if pad is not None else (eos if eos is not None else 0)}


def load_reward_model(path: str | os.PathLike, dtype: str = "float32",
                      attn_implementation: str = "auto") -> RewardModel:
    """Load a directory written by ``save_reward_model``, or a transformers ``...ForSequenceClassification``
    (``num_labels=1``; single or sharded safetensors, any float dtype; tokenizer optional). ``dtype`` = compute
    dtype (params stay float32); ``attn_implementation`` as ``model.attn_implementation``."""
    path = os.fspath(path)
    meta_file = os.path.join(path, METADATA_FILE)
    if os.path.isfile(meta_file):
        with open(meta_file) as fh:
            metadata = json.load(fh)
        if metadata.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{meta_file}: format_version {metadata.get('format_version')!r}, "
                             f"expected {FORMAT_VERSION}")
        for key in ("eos_token_id", "pad_token_id"):
            if not isinstance(metadata.get(key), int):
                raise ValueError(f"{meta_file}: missing integer {key!r}")
    else:
        metadata = _hf_metadata(path)
    config = DecoderConfig.from_pretrained_dir(path, dtype=dtype, attn_implementation=attn_implementation)
    state = dict(iter_safetensors(path))
    params = hf_state_dict_to_value_params(state, config, source=path)
    params = jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float32)), params)
    tokenizer = Tokenizer.from_dir(path) if os.path.isfile(os.path.join(path, "tokenizer.json")) else None
    return RewardModel(config=config, params=params, tokenizer=tokenizer, path=path, metadata=metadata)
