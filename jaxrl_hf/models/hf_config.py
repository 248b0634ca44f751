"""HF ``config.json`` <-> `DecoderConfig`, per family, with transformers' defaults where a key is absent.

Families (``model_type``): ``llama``, ``qwen2`` (QKV bias), ``qwen3`` (q/k head norms), ``mistral``, ``gemma2``
and ``gemma3_text`` (Gemma structure; Gemma 3 adds q/k norms and a RoPE base of its own for sliding layers).
Sliding windows are read as transformers reads them (`hf_sliding_layers`); model types met in the wild but not
implemented are refused naming what is missing (``UNSUPPORTED_MODEL_TYPES``).
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxrl_hf.models.config import (GEMMA_MODEL_TYPES, HF_ARCHITECTURES, HIDDEN_ACTS, LAYER_TYPES,
                                    SUPPORTED_MODEL_TYPES, UNSUPPORTED_MODEL_TYPES, DecoderConfig)

GEMMA_DEFAULTS = {  # Gemma2Config / Gemma3TextConfig defaults of the keys a config.json may leave out
    "gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window": 4096, "rope_theta": 10000.0},
    "gemma3_text": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                    "sliding_window_pattern": 6},
}


def _check_model_type(hf: Mapping[str, Any]) -> str:
    model_type = hf.get("model_type", "llama")
    if model_type in UNSUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported: "
                         f"{UNSUPPORTED_MODEL_TYPES[model_type]}; supported: {SUPPORTED_MODEL_TYPES}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type={model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [k for k in required if k not in hf]
    if missing:
        raise ValueError(f"config.json is missing required key(s) {missing}")
    if hf.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true is not supported by this decoder")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention=true (an encoder variant) is not supported")
    return model_type


def _hidden_act(hf: Mapping[str, Any], model_type: str) -> str:
    gemma = model_type in GEMMA_MODEL_TYPES
    key = "hidden_activation" if gemma else "hidden_act"
    act = hf.get(key) or ("gelu_pytorch_tanh" if gemma else "silu")
    if act not in HIDDEN_ACTS or (act == "silu") == gemma:
        raise ValueError(f"config.json {key}={act!r} is not supported for model_type {model_type!r} (SwiGLU "
                         f"'silu' for Llama-style models, GeGLU 'gelu_pytorch_tanh' for {GEMMA_MODEL_TYPES})")
    return act


def _rope(params: Mapping[str, Any], legacy: Mapping[str, Any] | None, theta: float) -> tuple[float, dict]:
    """``(rope_theta, scaling)`` from HF's ``rope_parameters`` merged with the legacy ``rope_scaling``
    (``type`` read as ``rope_type``); a ``default`` rope type has no scaling entries."""
    rope = dict(params)
    for key, value in (legacy or {}).items():
        rope.setdefault(key, value)
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    rope.pop("type", None)
    theta = float(rope.pop("rope_theta", theta))
    return theta, ({} if rope.get("rope_type", "default") == "default" else rope)


def _gemma3_rope(hf: Mapping[str, Any]) -> tuple[float, dict, float]:
    """``(rope_theta, scaling, local_theta)``: transformers 5 writes ``rope_parameters`` per layer type; older
    files hold ``rope_theta`` + ``rope_scaling`` (full layers) and ``rope_local_base_freq`` (sliding layers)."""
    params, defaults = hf.get("rope_parameters") or {}, GEMMA_DEFAULTS["gemma3_text"]
    if "full_attention" in params or "sliding_attention" in params:
        local = dict(params.get("sliding_attention") or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"config.json rope_parameters.sliding_attention rope_type={local['rope_type']!r}: only "
                             "'default' is supported for Gemma 3's sliding layers")
        theta, scaling = _rope(params.get("full_attention") or {}, None, defaults["rope_theta"])
        return theta, scaling, float(local.get("rope_theta", defaults["rope_local_base_freq"]))
    theta, scaling = _rope(params, hf.get("rope_scaling"), float(hf.get("rope_theta", defaults["rope_theta"])))
    return theta, scaling, float(hf.get("rope_local_base_freq", defaults["rope_local_base_freq"]))


def hf_sliding_layers(hf: Mapping[str, Any], model_type: str) -> tuple[int | None, tuple[str, ...]]:
    """``(sliding_window, layer_types)`` as transformers reads them: Mistral slides every layer when
    ``sliding_window`` is set; Qwen2/Qwen3 only with ``use_sliding_window``, the layers from ``max_window_layers``
    on (or as ``layer_types`` says); Gemma 2 alternates sliding/full from layer 0, Gemma 3 has one full layer in
    every ``sliding_window_pattern`` (6), unless ``layer_types`` says. A window at least
    ``max_position_embeddings`` long never hides a key and is dropped, ``(None, ())`` (not for Gemma 3, whose
    layer types also choose the RoPE base)."""
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", GEMMA_DEFAULTS.get(model_type, {}).get("sliding_window"))
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
        elif model_type in GEMMA_MODEL_TYPES:
            pattern = 2 if model_type == "gemma2" else int(hf.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        else:
            first = int(hf.get("max_window_layers", 28))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    types = tuple(types)
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"config.json layer_types={list(types)!r}: one of {LAYER_TYPES} per layer ({layers} layers)")
    never_hides = window >= int(hf.get("max_position_embeddings", 2048)) and model_type != "gemma3_text"
    if "sliding_attention" not in types or never_hides:
        return None, ()
    return window, types


def decoder_config_from_hf(hf: Mapping[str, Any], **runtime: Any) -> DecoderConfig:
    """`DecoderConfig` of a parsed HF ``config.json``; ``runtime`` sets dtype/param_dtype/remat/attn_implementation."""
    model_type = _check_model_type(hf)
    hidden_act = _hidden_act(hf, model_type)
    sliding_window, layer_types = hf_sliding_layers(hf, model_type)
    gemma = GEMMA_DEFAULTS.get(model_type)
    local_theta = None
    if model_type == "gemma3_text":
        rope_theta, rope, local_theta = _gemma3_rope(hf)
    else:
        default_theta = gemma["rope_theta"] if gemma else 10000.0
        rope_theta, rope = _rope(hf.get("rope_parameters") or {}, hf.get("rope_scaling"),
                                 float(hf.get("rope_theta", default_theta)))
    heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    eos_ids = tuple(int(x) for x in (eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else []))

    def gemma_float(key: str) -> float | None:
        value = hf.get(key, gemma[key]) if gemma else None
        return None if value is None else float(value)

    if model_type == "gemma3_text" and gemma_float("attn_logit_softcapping") is not None:
        raise ValueError(f"config.json attn_logit_softcapping={hf['attn_logit_softcapping']!r} for gemma3_text: "
                         "transformers' and vLLM's Gemma 3 do not apply it (published Gemma 3 configs hold null); "
                         "set it to null, or use model_type gemma2 if the model needs it")

    return DecoderConfig(
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
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma is not None)),
        qkv_bias=bool(hf.get("attention_bias", False)) or model_type == "qwen2",
        o_bias=bool(hf.get("attention_bias", False)) and model_type != "qwen2",
        model_type=model_type,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id"),
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        sliding_window=sliding_window,
        layer_types=layer_types,
        hidden_act=hidden_act,
        query_pre_attn_scalar=gemma_float("query_pre_attn_scalar"),
        attn_logit_softcapping=gemma_float("attn_logit_softcapping"),
        final_logit_softcapping=gemma_float("final_logit_softcapping"),
        rope_local_theta=local_theta,
        **runtime,
    )


def decoder_config_to_hf(config: DecoderConfig) -> dict[str, Any]:
    """The HF ``config.json`` content for ``config`` (loadable by transformers and vLLM)."""
    c = config
    rope_parameters = {"rope_theta": c.rope_theta, "rope_type": "default", **dict(c.rope_scaling)}
    out: dict[str, Any] = {
        "architectures": [HF_ARCHITECTURES[c.model_type]],
        "model_type": c.model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None if not c.rope_scaling else dict(c.rope_scaling),
        "rope_parameters": rope_parameters,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else list(c.eos_token_ids) or None,
        "pad_token_id": c.pad_token_id,
        "torch_dtype": "float32",
    }
    if c.model_type in ("llama", "qwen3") + GEMMA_MODEL_TYPES:
        out["attention_bias"] = c.qkv_bias
    if c.model_type == "llama":
        out["mlp_bias"] = False
    windows = c.layer_windows
    # transformers' Gemma configs want a window even when no layer slides: one that hides nothing
    out["sliding_window"] = c.sliding_window if windows else (c.max_position_embeddings if c.is_gemma else None)
    if c.model_type in ("qwen2", "qwen3"):
        out["use_sliding_window"] = windows is not None
        out["max_window_layers"] = c.num_hidden_layers
    if c.model_type != "mistral":  # Mistral slides every layer when sliding_window is set
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows or (0,) * c.num_hidden_layers]
    if c.is_gemma:
        scalar = c.query_pre_attn_scalar or float(c.head_dim)  # transformers types it int
        out.update(hidden_activation=c.hidden_act, query_pre_attn_scalar=int(scalar) if scalar.is_integer() else scalar,
                   attn_logit_softcapping=c.attn_logit_softcapping, final_logit_softcapping=c.final_logit_softcapping)
    if c.model_type == "gemma3_text":  # per layer type, as transformers 5 writes it
        del out["rope_theta"], out["rope_scaling"]
        local = c.rope_local_theta if c.rope_local_theta is not None else GEMMA_DEFAULTS[c.model_type]["rope_local_base_freq"]
        out["rope_parameters"] = {"full_attention": rope_parameters,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": float(local)}}
    return out
