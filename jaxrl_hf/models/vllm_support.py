"""Which decoder configs vLLM computes exactly as this decoder does, for ``rollout.name=vllm`` and HF exports.

vLLM builds its model from the ``config.json`` this project writes (`jaxrl_hf.models.config.decoder_config_to_hf`)
and receives the weights under the HF names of `jaxrl_hf.models.weights_hf` (q/k norms, Gemma's pre/post
feed-forward norms and its ``(1 + w)`` norm weights as stored, tied embeddings). Against vLLM 0.32 (CPU build),
greedy tokens equal to the native engine's and log-probs within 1e-4 of our forward where a test says so:

==============  ========================================================================  ==========================
model_type      what vLLM reads                                                           checked
==============  ========================================================================  ==========================
llama           the base layout                                                           tests/test_rollout_vllm.py
qwen2           the base layout with QKV bias; head_dim = hidden_size / heads (below)    test_rollout_vllm_families
qwen3           ``q_norm`` / ``k_norm``; a window only when every layer slides (below)   test_rollout_vllm_families
mistral         ``sliding_window`` on every layer                                         test_rollout_vllm_families
gemma2          ``query_pre_attn_scalar``, both soft-caps, ``layer_types`` (alternating   test_rollout_vllm_families
                windows), the sqrt(hidden_size) embedding scale, logits from the
                embedding (always tied)
gemma3_text     as Gemma 2 plus q/k norms and ``rope_parameters`` per layer type          test_rollout_vllm_families
qwen3_moe       per-expert ``mlp.experts.{e}.*_proj`` (vLLM fuses them into ``w13``/``w2``), test_rollout_vllm_moe
                ``mlp.gate`` router, ``mlp_only_layers`` / ``decoder_sparse_step``;
                each expert split over the TP ranks as the MLP is                         test_rollout_vllm_tp
mixtral         per-expert ``block_sparse_moe.experts.{e}.w1/w3/w2`` (fused as above),    test_rollout_vllm_moe
                ``block_sparse_moe.gate``; no sliding window (below)
==============  ========================================================================  ==========================

Refused (`vllm_support_problem`): Qwen2 with ``head_dim`` other than ``hidden_size / num_attention_heads`` (vLLM's
Qwen2 derives it from those two, as every published Qwen2/Qwen2.5 does; its CPU attention then met head_dim 16 on a
tiny config with head_dim 32). Qwen2/Qwen3 with a window on some layers only. vLLM's Qwen2/Qwen3 models do not
read ``layer_types`` (Qwen2 asserts ``max_window_layers == num_hidden_layers``); measured: such a Qwen3 decodes as
if no layer had a window. No published Qwen2.5/Qwen3 checkpoint sets ``use_sliding_window``. Mixtral with a
``sliding_window``: vLLM's Mixtral has no window (its attention reads none); published Mixtral configs hold null.
"""

from __future__ import annotations

from jaxrl_hf.models.config import DecoderConfig

HEAD_DIM_FROM_HIDDEN = ("qwen2",)
"""model_types whose vLLM implementation takes head_dim = hidden_size / num_attention_heads (ignores ``head_dim``)."""
PER_LAYER_WINDOWS_IGNORED = ("qwen2", "qwen3")
"""model_types whose vLLM implementation applies one window to all layers or none (it ignores ``layer_types``)."""
WINDOWS_IGNORED = ("mixtral",)
"""model_types whose vLLM implementation has no sliding window at all."""


def vllm_support_problem(config: DecoderConfig) -> str | None:
    """Why vLLM would not compute ``config``'s model as this decoder does (None: it does; module table)."""
    if config.model_type in HEAD_DIM_FROM_HIDDEN and config.head_dim * config.num_attention_heads != config.hidden_size:
        return (f"model_type {config.model_type!r} with head_dim={config.head_dim} != hidden_size / "
                f"num_attention_heads = {config.hidden_size}/{config.num_attention_heads}: vLLM's "
                f"{config.model_type} model ignores config.json head_dim and would build other projection shapes; "
                "use rollout.name=jax")
    windows = config.layer_windows
    if config.model_type in WINDOWS_IGNORED and windows is not None:
        return (f"model_type {config.model_type!r} with sliding_window={config.sliding_window}: vLLM's "
                f"{config.model_type} model has no sliding window and would attend to every earlier token; use "
                "rollout.name=jax")
    if config.model_type in PER_LAYER_WINDOWS_IGNORED and windows is not None and len(set(windows)) > 1:
        sliding = [i for i, w in enumerate(windows) if w]
        return (f"model_type {config.model_type!r} with sliding_window={config.sliding_window} on layers {sliding} "
                f"only (of {config.num_hidden_layers}): vLLM's {config.model_type} model ignores layer_types / "
                "max_window_layers, so it would not generate from the model being trained; use rollout.name=jax")
    return None


__all__ = ["HEAD_DIM_FROM_HIDDEN", "PER_LAYER_WINDOWS_IGNORED", "WINDOWS_IGNORED", "vllm_support_problem"]
