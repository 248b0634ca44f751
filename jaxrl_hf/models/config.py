"""Decoder configuration for the Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 families, read from and written to HF
``config.json``.

``DecoderConfig`` is frozen and hashable so it can be a static argument of ``jax.jit`` and an
attribute of a flax module. Architecture fields mirror the HF names; ``dtype`` / ``param_dtype`` /
``remat`` / ``attn_implementation`` are runtime options that never appear in ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM"}
UNSUPPORTED_MODEL_TYPES = {
    "gemma": "Gemma 1 (RMSNorm with (1+w), scaled embedding, GeGLU without Gemma 2's extra norms) is not implemented",
    "gemma3_text": "Gemma 3 needs q/k RMSNorm, separate local/global RoPE bases (rope_local_base_freq) and its "
                   "sliding-window pattern on top of Gemma 2; those are not implemented (gemma2 is)",
    "gemma3": "Gemma 3 needs q/k RMSNorm, separate local/global RoPE bases (rope_local_base_freq), its "
              "sliding-window pattern and a vision tower; those are not implemented (gemma2 is)",
}
"""model_types met in the wild that this decoder refuses, with what exactly is missing."""
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_REMAT = ("none", "full", "dots", "dots_no_batch", "save_attn_out", "save_attn_out_mlp_in",
                   "dots_no_batch_attn_out")
"""Rematerialisation policies of the decoder layers (``jaxrl_hf.models.llama.REMAT_POLICIES`` documents each)."""
SUPPORTED_ATTN_IMPLEMENTATIONS = ("auto", "eager", "blockwise", "cudnn")
"""Self-attention implementations (``jaxrl_hf.models.attention`` documents each)."""
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture + runtime options of a Llama-style decoder and its variants.

    ``rope_scaling`` is a sorted tuple of ``(key, value)`` pairs (hashable form of HF's
    ``rope_parameters`` minus ``rope_theta``), e.g. ``(("factor", 8.0), ("rope_type", "llama3"), ...)``.
    ``qk_norm``: Qwen3's per-head RMSNorm of queries and keys before RoPE. ``layer_types``: HF's per-layer
    ``"full_attention"`` / ``"sliding_attention"`` (``()`` = all full); a sliding layer's query ``i`` sees keys
    ``j`` with ``i - sliding_window < j <= i``. ``model_type="gemma2"`` adds Gemma 2's structure (scaled
    embedding, ``(1 + w)`` norms, norms after attention and MLP); its ``query_pre_attn_scalar`` and soft-caps
    are fields here.
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
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
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
        if self.layer_types and (len(self.layer_types) != self.num_hidden_layers
                                 or any(t not in LAYER_TYPES for t in self.layer_types)):
            raise ValueError(f"DecoderConfig.layer_types={self.layer_types!r}: one of {LAYER_TYPES} per layer "
                             f"({self.num_hidden_layers} layers)")
        if (self.sliding_window is not None or "sliding_attention" in self.layer_types) and (
                not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"DecoderConfig.sliding_window={self.sliding_window!r} must be a positive int (or "
                             "None with no sliding_attention in layer_types)")
        if self.layer_types and len(set(self.layer_types)) == 1:  # canonical: () = every layer alike
            if self.layer_types[0] == "full_attention":
                object.__setattr__(self, "sliding_window", None)
            object.__setattr__(self, "layer_types", ())
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"DecoderConfig.hidden_act={self.hidden_act!r}; supported: {HIDDEN_ACTS}")
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
    def is_gemma2(self) -> bool:
        return self.model_type == "gemma2"

    @property
    def layer_windows(self) -> tuple[int, ...] | None:
        """Per layer, its sliding window (``0``: full attention); ``None`` when no layer slides. Empty
        ``layer_types`` with a ``sliding_window`` slides every layer (Mistral's convention)."""
        types = self.layer_types or ("sliding_attention",) * self.num_hidden_layers
        if self.sliding_window is None or "sliding_attention" not in types:
            return None
        return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in types)

    @property
    def attention_scale(self) -> float:
        """The factor on ``q . k``: ``query_pre_attn_scalar ** -0.5`` (Gemma 2), else ``head_dim ** -0.5``."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        if self.qk_norm:
            attn += 2 * d
        layer = attn + 3 * e * m + (4 if self.is_gemma2 else 2) * e
        total = self.num_hidden_layers * layer + self.vocab_size * e + e
        if not self.tie_word_embeddings:
            total += self.vocab_size * e
        return total

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], **runtime: Any) -> "DecoderConfig":
        """Build from a parsed HF ``config.json``; ``runtime`` sets dtype/param_dtype/remat/attn_implementation."""
        model_type = hf.get("model_type", "llama")
        if model_type in UNSUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type={model_type!r} is not supported: "
                             f"{UNSUPPORTED_MODEL_TYPES[model_type]}; supported: {SUPPORTED_MODEL_TYPES}")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json model_type={model_type!r} is not supported; "
                             f"supported: {SUPPORTED_MODEL_TYPES}")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in hf]
        if missing:
            raise ValueError(f"config.json is missing required key(s) {missing}")
        if hf.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true is not supported by this decoder")
        act_key = "hidden_activation" if model_type == "gemma2" else "hidden_act"
        hidden_act = hf.get(act_key) or ("gelu_pytorch_tanh" if model_type == "gemma2" else "silu")
        if hidden_act not in HIDDEN_ACTS or (hidden_act == "silu") == (model_type == "gemma2"):
            raise ValueError(f"config.json {act_key}={hidden_act!r} is not supported for model_type "
                             f"{model_type!r} (SwiGLU 'silu' for Llama-style models, GeGLU 'gelu_pytorch_tanh' "
                             "for gemma2)")
        sliding_window, layer_types = _hf_sliding_layers(hf, model_type)
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
        gemma2 = model_type == "gemma2"
        gemma2_defaults = {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,  # Gemma2Config's
                           "final_logit_softcapping": 30.0}

        def optional_float(key: str) -> float | None:
            value = hf.get(key, gemma2_defaults[key])
            return None if value is None else float(value)
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
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma2)),
            qkv_bias=qkv_bias,
            o_bias=bool(hf.get("attention_bias", False)) and model_type != "qwen2",
            model_type=model_type,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=hf.get("pad_token_id"),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            layer_types=layer_types,
            hidden_act=hidden_act,
            query_pre_attn_scalar=optional_float("query_pre_attn_scalar") if gemma2 else None,
            attn_logit_softcapping=optional_float("attn_logit_softcapping") if gemma2 else None,
            final_logit_softcapping=optional_float("final_logit_softcapping") if gemma2 else None,
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
        rope_parameters = {"rope_theta": self.rope_theta, "rope_type": "default", **dict(self.rope_scaling)}
        out: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
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
        if self.model_type in ("llama", "qwen3", "gemma2"):
            out["attention_bias"] = self.qkv_bias
        if self.model_type == "llama":
            out["mlp_bias"] = False
        windows = self.layer_windows
        # transformers' Gemma 2 wants a window even when no layer slides: one that hides nothing
        out["sliding_window"] = self.sliding_window if windows else (
            self.max_position_embeddings if self.is_gemma2 else None)
        if self.model_type in ("qwen2", "qwen3"):
            out["use_sliding_window"] = windows is not None
            out["max_window_layers"] = self.num_hidden_layers
        if self.model_type != "mistral":  # Mistral slides every layer when sliding_window is set
            out["layer_types"] = ["sliding_attention" if w else "full_attention"
                                  for w in windows or (0,) * self.num_hidden_layers]
        if self.is_gemma2:
            out["hidden_activation"] = self.hidden_act
            scalar = self.query_pre_attn_scalar or float(self.head_dim)  # transformers types it int
            out.update(query_pre_attn_scalar=int(scalar) if scalar is not None and scalar.is_integer() else scalar,
                       attn_logit_softcapping=self.attn_logit_softcapping,
                       final_logit_softcapping=self.final_logit_softcapping)
        return out


def _hf_sliding_layers(hf: Mapping[str, Any], model_type: str) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` as transformers reads them: Mistral slides every layer when
    ``sliding_window`` is set; Qwen2/Qwen3 only with ``use_sliding_window``, the layers from ``max_window_layers``
    on (or as ``layer_types`` says); Gemma 2 alternates sliding/full from layer 0 unless ``layer_types`` says.
    A window at least ``max_position_embeddings`` long never hides a key and is dropped: ``(None, ())``."""
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", 4096 if model_type == "gemma2" else None)
    if model_type in ("qwen2", "qwen3") and not hf.get("use_sliding_window"):
        window = None
    if model_type == "llama" or window is None:
        return None, ()
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"config.json sliding_window={window!r} must be a positive int or null")
    types = hf.get("layer_types") if model_type != "mistral" else None
    if types is None:
        if model_type == "mistral":
            types = ["sliding_attention"] * layers
        elif model_type == "gemma2":
            types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        else:
            first = int(hf.get("max_window_layers", 28))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"config.json layer_types={list(types)!r}: one of {LAYER_TYPES} per layer ({layers} layers)")
    if "sliding_attention" not in types or window >= int(hf.get("max_position_embeddings", 2048)):
        return None, ()
    return window, types
