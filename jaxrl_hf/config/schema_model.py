"""The model section of the run configuration (verl's ``actor_rollout_ref.model``): which weights, the compute dtype,
attention implementation, gradient checkpointing and packing, plus the shape of the ``tiny-random`` model.

Part of the schema in ``jaxrl_hf.config.schema`` (which composes ``RunConfig`` from it); kept apart only to keep
each file small. Import the classes from either module: it is one class each.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional


@dataclass
class TinyModelConfig:
    """Shape of the ``model.path=tiny-random`` model (smoke tests); the tokenizer is SmolLM2's."""

    vocab_size: int = 49152
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    head_dim: Optional[int] = None
    """Default ``hidden_size // num_heads``; vLLM's CPU attention needs >= 32 (``rollout.name=vllm``)."""
    max_position_embeddings: int = 2048
    pad_token_id: int = 0
    eos_token_id: int = 2
    bos_token_id: Optional[int] = 1
    tie_word_embeddings: bool = False
    num_experts: int = 0
    """0: a dense Llama; > 0: a Qwen3-MoE (q/k norms, every layer sparse) with this many experts."""
    num_experts_per_tok: int = 2
    moe_intermediate_size: Optional[int] = None
    """Width of one expert (default ``intermediate_size``)."""


@dataclass
class ModelConfig:
    """The policy (and, by default, reference/critic backbone) model."""

    path: str = "smollm2-135m-instruct"
    """``smollm2-135m-instruct``, an HF directory, a ``.gguf`` file, ``tiny-random``, or a hub id ``org/name``
    read offline from the local Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``; fetch it first with
    ``huggingface-cli download org/name``). ``config.json`` model types: llama, qwen2, qwen3, mistral, gemma2, gemma3_text."""
    dtype: Literal["float32", "bfloat16", "auto"] = "float32"
    """Compute dtype (parameters and Adam state stay float32). ``auto``: on GPUs ``bfloat16``; on CPUs the faster of
    ``float32`` and ``bfloat16`` (with float32 accumulation) on the host, measured once and cached with the peak
    (``workers/peak_flops.py``); resolved at the start of a run, before any worker starts, and written as resolved
    into the run's ``config.yaml``."""
    remat: Literal["none", "full", "dots", "dots_no_batch", "save_attn_out", "save_attn_out_mlp_in",
                   "dots_no_batch_attn_out"] = "none"
    """Gradient checkpointing policy of each decoder layer: ``none``; ``full`` (keep only layer inputs, recompute
    the rest); ``dots`` / ``dots_no_batch`` (keep all / the weight matmul outputs); ``save_attn_out`` (keep the
    attention output, recompute projections and MLP but not the attention); ``save_attn_out_mlp_in`` (also
    keep the MLP input); ``dots_no_batch_attn_out`` (weight matmuls and the attention output). See
    ``jaxrl_hf.models.llama.REMAT_POLICIES``."""
    enable_gradient_checkpointing: bool = False
    """verl's switch (``actor_rollout_ref.model.enable_gradient_checkpointing``): ``true`` means ``remat=full``
    unless ``remat`` names a policy."""
    attn_implementation: str = "auto"
    """Self-attention without a KV cache, a name in ``jaxrl_hf.models.attention.ATTENTION_IMPLEMENTATIONS``:
    ``eager`` (materialises the [T, T] scores), ``blockwise`` (flash-attention-style online softmax in pure JAX,
    O(T) memory), ``cudnn`` (cuDNN flash attention; GPU, bfloat16/float16), what an ``--import``ed module
    registers, or ``auto`` (cudnn where usable, else blockwise above 1024 tokens, else eager). Decoding over the KV
    cache is always eager."""
    scan_layers: bool = True
    """Run the decoder layers as one XLA loop (``true``: compile time independent of depth) or unrolled
    (``false``: one straight-line program; the parameters stay stacked the same way). MaxText's key. Unrolled
    compiles in time proportional to depth; where a backend copies a loop's stacked activations every layer it
    can run faster. Generation always keeps the loop. Large models keep ``true``."""
    seed: int = 0
    cpu_backend: Literal["auto", "off"] = "auto"
    """The optional CPU backend (docs/CPU_BACKEND.md: the C++ kernels, the fused clip + AdamW, the bf16 pair
    matmul, the unrolled float32 decode): ``auto`` uses each form where its capability probe says it runs (a CPU
    device with the instructions and a C++ compiler); ``off`` keeps XLA's ops and the scanned layer loop only. No
    effect on a GPU."""
    use_remove_padding: bool = False
    """Pack each micro-batch's rows into one sequence per device, no padding between them (verl's key; attention
    and positions per row): ``jaxrl_hf.workers.packing``. For the critic: ``critic.model``'s, else this one."""
    lora_rank: int = 0
    """LoRA rank ``r`` (verl's key; 0 = full fine-tuning): the base is frozen and only low-rank adapters on
    ``target_modules`` are trained (`jaxrl_hf.models.lora`)."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator: the update is ``(lora_alpha / lora_rank) · B A``."""
    target_modules: Any = "all-linear"
    """``all-linear`` or a list of HF module names (``[q_proj, v_proj]``) that get adapters."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
