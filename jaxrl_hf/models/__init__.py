"""Flax Llama/Qwen2/Qwen3/Mistral/Gemma 2/Gemma 3 (text) decoder, value head, HF/GGUF weight import-export, tokenizer, ``load_pretrained``."""

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.forward import (forward, hidden_states, init_params, lm_head_kernel, make_module,
                                     next_token_targets, param_logical_axes, param_shapes, param_shardings,
                                     token_log_probs_and_entropy)
from jaxrl_hf.models.llama import CausalLM, init_kv_cache
from jaxrl_hf.models.pretrained import PretrainedLM, load_pretrained
from jaxrl_hf.models.tokenizer import Tokenizer
from jaxrl_hf.models.value_head import (ValueModel, init_value_params, value_forward, value_param_logical_axes,
                                        value_params_from_lm)
from jaxrl_hf.models.weights_hf import (hf_state_dict_to_params, load_hf_dir, params_to_hf_state_dict,
                                        save_hf_dir)

__all__ = [
    "CausalLM", "DecoderConfig", "PretrainedLM", "Tokenizer", "forward", "hf_state_dict_to_params",
    "hidden_states", "init_kv_cache", "init_params", "lm_head_kernel", "load_hf_dir", "load_pretrained",
    "make_module", "next_token_targets", "param_logical_axes", "param_shapes", "param_shardings",
    "params_to_hf_state_dict", "save_hf_dir", "token_log_probs_and_entropy", "ValueModel", "init_value_params",
    "value_forward", "value_param_logical_axes", "value_params_from_lm",
]
