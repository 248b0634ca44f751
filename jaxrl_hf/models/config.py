"""Decoder configuration for the Llama / Qwen2 family, read from and written to HF ``config.json``.

``DecoderConfig`` is frozen and hashable so it can be a static argument of ``jax.jit`` and an
attribute of a flax module. Architecture fields mirror the HF names; ``dtype`` / ``param_dtype`` /
``remat`` / ``attn_implementation`` are runtime options that never appear in ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_REMAT = ("none", "full", "dots", "dots_no_batch", "save_attn_out", "save_attn_out_mlp_in",
                   "dots_no_batch_attn_out")
"""Rematerialisation policies of the decoder layers (``jaxrl_hf.models.llama.REMAT_POLICIES`` documents each)."""
SUPPORTED_ATTN_IMPLEMENTATIONS = ("auto", "eager", "blockwise", "cudnn")
"""Self-attention implementations (``jaxrl_hf.models.attention`` documents each)."""
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture + runtime options of a Llama/Qwen2-style decoder.

    ``rope_scaling`` is a sorted tuple of ``(key, value)`` pairs (hashable form of HF's
    ``rope_parameters`` minus ``rope_theta``), e.g. ``(("factor", 8.0), ("rope_type", "llama3"), ...)``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # Runtime options (not part of config.json).
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attn_implementation: str = "auto"
    scan_layers: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"DecoderConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention needs it)")
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim={self.head_dim} must be even for RoPE")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"DecoderConfig.model_type={self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in SUPPORTED_DTYPES:
                raise ValueError(f"DecoderConfig.{name}={getattr(self, name)!r}; valid: {SUPPORTED_DTYPES}")
        if self.remat not in SUPPORTED_REMAT:
            raise ValueError(f"DecoderConfig.remat={self.remat!r}; valid: {SUPPORTED_REMAT}")
        if self.attn_implementation not in SUPPORTED_ATTN_IMPLEMENTATIONS:
            raise ValueError(f"DecoderConfig.attn_implementation={self.attn_implementation!r} (config key "
                             f"model.attn_implementation); valid: {SUPPORTED_ATTN_IMPLEMENTATIONS}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")

    # ----------------------------------------------------------------------------------------
    @property
    def rope_type(self) -> str:
        return str(dict(self.rope_scaling).get("rope_type", "default"))

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **changes: Any) -> "DecoderConfig":
        """A copy with ``changes`` applied; unknown field names raise with the valid list."""
        valid = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - valid)
        if unknown:
            raise ValueError(f"unknown DecoderConfig field(s) {unknown}; valid: {sorted(valid)}")
        return dataclasses.replace(self, **changes)

    def num_params(self) -> int:
        """Number of parameters of the causal LM (embedding counted once when tied)."""
        e, m, h, k, d = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                         self.num_key_value_heads, self.head_dim)
        attn = e * h * d * 2 + e * k * d * 2
        if self.qkv_bias:
            attn += (h + 2 * k) * d
        if self.o_bias:
            attn += e
        layer = attn + 3 * e * m + 2 * e
        total = self.num_hidden_layers * layer + self.vocab_size * e + e
        if not self.tie_word_embeddings:
            total += self.vocab_size * e
        return total

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], **runtime: Any) -> "DecoderConfig":
        """Build from a parsed HF ``config.json``; ``runtime`` sets dtype/param_dtype/remat/attn_implementation."""
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type={model_type!r} is not supported; "
                             f"supported: {SUPPORTED_MODEL_TYPES}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"config.json is missing required key(s) {missing}")
        if hf.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported by this decoder")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}; only 'silu' (SwiGLU) is supported")
        if model_type == "qwen2" and hf.get("use_sliding_window"):
            raise ValueError("config.json use_sliding_window=true is not supported by this decoder")
        rope = dict(hf.get("rope_parameters") or {})
        legacy = hf.get("rope_scaling") or {}
        for key, value in legacy.items():
            rope.setdefault(key, value)
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.pop("type", None)
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        if rope.get("rope_type", "default") == "default":
            rope = {}
        heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(x) for x in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))
        qkv_bias = bool(hf.get("attention_bias", False)) or model_type == "qwen2"
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=tuple(sorted(rope.items())),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=bool(hf.get("attention_bias", False)) and model_type != "qwen2",
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
            **runtime,
        )

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike, **runtime: Any) -> "DecoderConfig":
        """Read ``<path>/config.json``."""
        file = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json in {path!s}")
        with open(file) as f:
            return cls.from_hf_dict(json.load(f), **runtime)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` content for this architecture (loadable by transformers and vLLM)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default", **dict(self.rope_scaling)}
        out: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if not self.rope_scaling else dict(self.rope_scaling),
            "rope_parameters": rope_parameters,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                             else list(self.eos_token_ids) or None),
            "pad_token_id": self.pad_token_id,
            "torch_dtype": "float32",
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.qkv_bias
            out["mlp_bias"] = False
        if self.model_type == "qwen2":
            out["use_sliding_window"] = False
        return out
