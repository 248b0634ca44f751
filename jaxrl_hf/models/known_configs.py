"""Architectures of published models by name: the fields of their HF ``config.json``, no weights.

Used where only the shapes matter (`launch/plan_memory.py` compiles programs on abstract arrays). Each entry
holds the architecture fields of the model's ``config.json`` as published on its model card (dropout,
initializer and ``transformers_version`` fields, which do not change any shape, are left out) and goes through
the same reader as a downloaded directory, `DecoderConfig.from_hf_dict`. ``PUBLISHED_PARAM_COUNTS`` are the
parameter counts the model cards state, an independent check of the shapes (``tests/test_plan_memory.py``).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from jaxrl_hf.models.config import DecoderConfig

_LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}

KNOWN_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": False, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151643},
    "qwen2.5-32b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648, "num_hidden_layers": 64,
        "num_attention_heads": 40, "num_key_value_heads": 8, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "tie_word_embeddings": False, "use_sliding_window": False,
        "bos_token_id": 151643, "eos_token_id": 151643},
    "llama3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE, "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001},
    "llama3.1-70b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
        "rope_scaling": _LLAMA31_ROPE, "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001},
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu", "attention_bias": False,
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
        "max_window_layers": 36, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False, "bos_token_id": 151643,
        "eos_token_id": 151645},
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
        "attention_bias": False, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
        "max_position_embeddings": 40960, "max_window_layers": 48, "rms_norm_eps": 1e-06, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": None, "use_sliding_window": False, "tie_word_embeddings": False,
        "bos_token_id": 151643, "eos_token_id": 151645},
    "gemma2-9b": {
        "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "vocab_size": 256000, "hidden_size": 3584,
        "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 256, "max_position_embeddings": 8192, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0},
}

# Parameter counts stated by the model cards / safetensors indexes (embedding and LM head counted separately).
PUBLISHED_PARAM_COUNTS: dict[str, int] = {
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-32b": 32_763_876_352,
    "llama3.1-8b": 8_030_261_248,
    "llama3.1-70b": 70_553_706_496,
    "qwen3-8b": 8_190_735_360,
    "gemma2-9b": 9_241_705_984,
}


def known_decoder_config(name_or_path: str, **runtime: Any) -> DecoderConfig:
    """The `DecoderConfig` of a name in `KNOWN_HF_CONFIGS` (case-insensitive), a ``config.json`` file, or a
    directory holding one; ``runtime`` sets ``dtype``/``param_dtype``/``remat``. Anything else raises
    ``ValueError`` listing the known names."""
    key = name_or_path.lower()
    if key in KNOWN_HF_CONFIGS:
        return DecoderConfig.from_hf_dict(KNOWN_HF_CONFIGS[key], **runtime)
    path = os.path.join(name_or_path, "config.json") if os.path.isdir(name_or_path) else name_or_path
    if not os.path.isfile(path):
        raise ValueError(f"model {name_or_path!r}: not a known name {sorted(KNOWN_HF_CONFIGS)}, "
                         "nor a config.json file or a directory holding one")
    try:
        with open(path, encoding="utf-8") as fh:
            hf: Mapping[str, Any] = json.load(fh)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    try:
        return DecoderConfig.from_hf_dict(hf, **runtime)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
