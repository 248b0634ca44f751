"""Decoder configuration for the Llama / Qwen2 / Qwen3 / Mistral / Gemma 2 / Gemma 3 (text) families, and its
translation from and to HF ``config.json`` (`decoder_config_from_hf`, `decoder_config_to_hf`).

``DecoderConfig`` is frozen and hashable so it can be a static argument of ``jax.jit`` and an
attribute of a flax module. Architecture fields mirror the HF names; ``dtype`` / ``param_dtype`` /
``remat`` / ``attn_implementation`` / ``scan_layers`` / ``row_layout`` / ``cpu_kernels`` / ``pair_kernels``
are runtime options that never appear in ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

from jaxrl_hf.models.row_layout import RowLayout

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "qwen3_moe", "mixtral")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")
GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                    "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
UNSUPPORTED_MODEL_TYPES = {
    "gemma": "Gemma 1 (GeGLU and (1+w) norms but without Gemma 2's post-attention/post-MLP norms) is not "
             "implemented",
    "gemma3": "this is Gemma 3's image-text model (Gemma3ForConditionalGeneration): the vision tower and its "
              "multimodal projector are not implemented; the text-only Gemma 3 (model_type gemma3_text, "
              "Gemma3ForCausalLM, e.g. gemma-3-1b) is",
}
"""model_types met in the wild that this decoder refuses, with what exactly is missing."""
UNSUPPORTED_MOE_FIELDS = {
    "shared_expert_intermediate_size": "shared experts (Qwen2-MoE) are not implemented",
    "n_shared_experts": "shared experts (DeepSeek) are not implemented",
    "kv_lora_rank": "multi-head latent attention (DeepSeek's MLA) is not implemented",
    "q_lora_rank": "multi-head latent attention (DeepSeek's MLA) is not implemented",
    "n_group": "grouped top-k routing (DeepSeek-V3) is not implemented",
    "topk_group": "grouped top-k routing (DeepSeek-V3) is not implemented",
}
"""config.json keys of MoE variants this decoder refuses when set (a positive number), with what is missing."""
QWEN3_MOE_DEFAULTS = {"num_experts": 128, "num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                      "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
"""transformers' ``Qwen3MoeConfig`` defaults of the MoE keys a config.json may leave out."""
MIXTRAL_DEFAULTS = {"num_local_experts": 8, "num_experts_per_tok": 2, "rope_theta": 1_000_000.0}
"""transformers' ``MixtralConfig`` defaults of the keys a config.json may leave out."""
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
SUPPORTED_REMAT = ("none", "full", "dots", "dots_no_batch", "save_attn_out", "save_attn_out_mlp_in",
                   "dots_no_batch_attn_out")
"""Rematerialisation policies of the decoder layers (``jaxrl_hf.models.llama.REMAT_POLICIES`` documents each)."""
"""Self-attention implementations (``jaxrl_hf.models.attention`` documents each)."""
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Architecture + runtime options of a Llama-style decoder and its variants.

    ``rope_scaling`` is a sorted tuple of ``(key, value)`` pairs (hashable form of HF's
    ``rope_parameters`` minus ``rope_theta``), e.g. ``(("factor", 8.0), ("rope_type", "llama3"), ...)``.
    ``qk_norm``: Qwen3's per-head RMSNorm of queries and keys before RoPE. ``layer_types``: HF's per-layer
    ``"full_attention"`` / ``"sliding_attention"`` (``()`` = all full); a sliding layer's query ``i`` sees keys
    ``j`` with ``i - sliding_window < j <= i``. ``model_type`` ``gemma2`` / ``gemma3_text`` add the Gemma
    structure (scaled embedding, ``(1 + w)`` norms, norms after attention and MLP); ``query_pre_attn_scalar`` and
    the soft-caps are fields here, and ``rope_local_theta`` is Gemma 3's RoPE base of its sliding layers (the
    full layers use ``rope_theta`` and ``rope_scaling``). ``row_layout``: what one input row holds
    (`jaxrl_hf.models.row_layout.RowLayout`, a registered entry of `row_layout.ROW_LAYOUTS`: ``padded`` by default;
    ``packed``, ``shared_prompt`` and ``shared_prefix`` set per program by the packed and shared-prompt forward
    passes).
    ``cpu_kernels`` (float32 only; set by the CPU generation program, `layer_unrolled.cpu_kernel_module`): every
    projection kernel holds its ``[fan_in, fan_out]`` matrix in panel order, applied by `backends.cpu.panel_matmul`, and
    attention over a stored cache runs in `backends.cpu.ffi.cache_attention`. ``pair_kernels`` (bfloat16 only;
    set by the actor's and critic's training programs where `backends.cpu.pair_matmul.wanted`): the projections' weight
    gradients run in `backends.cpu.pair_matmul` (forward passes, the generation program included, are unchanged).
    MoE (``model_type`` ``qwen3_moe`` or ``mixtral``; ``num_experts = 0`` is a dense model): layer ``i`` is sparse iff ``i`` is
    not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (`moe_layers`); a sparse layer routes
    each token to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``
    (`jaxrl_hf.models.moe`), the other layers keep the dense MLP of width ``intermediate_size``.
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
    rope_local_theta: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Runtime options (not part of config.json).
    dtype: str = "float32"
    param_dtype: str = "float32"
    remat: str = "none"
    attn_implementation: str = "auto"
    scan_layers: bool = True
    row_layout: RowLayout = RowLayout()
    cpu_kernels: bool = False
    pair_kernels: bool = False

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
        if not isinstance(self.row_layout, RowLayout):
            raise ValueError(f"DecoderConfig.row_layout={self.row_layout!r} must be a "
                             "jaxrl_hf.models.row_layout.RowLayout")
        if self.cpu_kernels and self.dtype != "float32":
            raise ValueError(f"DecoderConfig.cpu_kernels needs dtype float32, got {self.dtype!r}")
        if self.pair_kernels and self.dtype != "bfloat16":
            raise ValueError(f"DecoderConfig.pair_kernels needs dtype bfloat16, got {self.dtype!r}")
        from jaxrl_hf.models.attention import implementation_names  # JAX's import only when a model is built

        if self.attn_implementation not in implementation_names():
            raise ValueError(f"DecoderConfig.attn_implementation={self.attn_implementation!r} (config key "
                             f"model.attn_implementation); valid: {implementation_names()}")
        self._check_moe()
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling rope_type={rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")

    def _check_moe(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ValueError(f"DecoderConfig.num_experts={self.num_experts!r} must be an int >= 0 (0: dense)")
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(int(i) for i in self.mlp_only_layers))))
        if not self.num_experts:
            if self.num_experts_per_tok or self.moe_intermediate_size or self.mlp_only_layers or self.norm_topk_prob \
                    or self.decoder_sparse_step != 1:
                raise ValueError("DecoderConfig: MoE fields (num_experts_per_tok, moe_intermediate_size, "
                                 "norm_topk_prob, decoder_sparse_step, mlp_only_layers) set with num_experts=0")
            return
        if not isinstance(self.num_experts_per_tok, int) or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"DecoderConfig.num_experts_per_tok={self.num_experts_per_tok!r} must be in 1 .. "
                             f"num_experts={self.num_experts}")
        if not isinstance(self.moe_intermediate_size, int) or self.moe_intermediate_size <= 0:
            raise ValueError(f"DecoderConfig.moe_intermediate_size={self.moe_intermediate_size!r} must be a "
                             "positive int")
        if not isinstance(self.decoder_sparse_step, int) or self.decoder_sparse_step < 1:
            raise ValueError(f"DecoderConfig.decoder_sparse_step={self.decoder_sparse_step!r} must be an int >= 1")
        if any(not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ValueError(f"DecoderConfig.mlp_only_layers={list(self.mlp_only_layers)} must be layer indices in "
                             f"0 .. {self.num_hidden_layers - 1}")
        if self.cpu_kernels:
            raise ValueError("DecoderConfig.cpu_kernels (panel-order kernels) has no MoE path; num_experts > 0")
        if self.model_type not in MOE_MODEL_TYPES:
            raise ValueError(f"DecoderConfig.num_experts={self.num_experts} with model_type={self.model_type!r}: the "
                             f"mixture-of-experts families are {MOE_MODEL_TYPES}")
        if self.model_type == "mixtral" and (self.moe_intermediate_size != self.intermediate_size
                                             or not self.norm_topk_prob or not all(self.moe_layers)):
            raise ValueError("DecoderConfig model_type='mixtral': every layer sparse (no mlp_only_layers, "
                             "decoder_sparse_step=1), experts of width intermediate_size (moe_intermediate_size="
                             f"{self.moe_intermediate_size} vs {self.intermediate_size}) and norm_topk_prob=True")

    # ----------------------------------------------------------------------------------------
    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it is sparse (an MoE block instead of the dense MLP), by transformers' rule: layer
        ``i`` is sparse iff ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``."""
        return tuple(i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0
                     for i in range(self.num_hidden_layers))

    @property
    def is_moe(self) -> bool:
        """Some layer is sparse."""
        return any(self.moe_layers)

    @property
    def rope_type(self) -> str:
        return str(dict(self.rope_scaling).get("rope_type", "default"))

    @property
    def is_gemma(self) -> bool:
        """Gemma 2 / Gemma 3 structure: scaled embedding, ``(1 + w)`` norms, post-attention/MLP norms."""
        return self.model_type in GEMMA_MODEL_TYPES

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

    def num_params(self, active: bool = False) -> int:
        """Number of parameters of the causal LM (embedding counted once when tied). ``active``: those one token
        is computed with, a mixture of experts' sparse layers counting the router and ``num_experts_per_tok`` of
        their experts (the ``N_active`` of ``6 · N_active`` FLOPs per token)."""
        e, m, h, k, d = (self.hidden_size, self.intermediate_size, self.num_attention_heads,
                         self.num_key_value_heads, self.head_dim)
        attn = e * h * d * 2 + e * k * d * 2
        if self.qkv_bias:
            attn += (h + 2 * k) * d
        if self.o_bias:
            attn += e
        if self.qk_norm:
            attn += 2 * d
        layer = attn + (4 if self.is_gemma else 2) * e
        used = self.num_experts_per_tok if active else self.num_experts
        moe = e * self.num_experts + 3 * used * e * self.moe_intermediate_size
        mlps = sum(moe if sparse else 3 * e * m for sparse in self.moe_layers)
        total = self.num_hidden_layers * layer + mlps + self.vocab_size * e + e
        if not self.tie_word_embeddings:
            total += self.vocab_size * e
        return total

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], **runtime: Any) -> "DecoderConfig":
        """Build from a parsed HF ``config.json`` (`decoder_config_from_hf`); ``runtime`` sets
        dtype/param_dtype/remat/attn_implementation."""
        return decoder_config_from_hf(hf, **runtime)

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike, **runtime: Any) -> "DecoderConfig":
        """Read ``<path>/config.json``."""
        file = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json in {path!s}")
        with open(file) as f:
            return cls.from_hf_dict(json.load(f), **runtime)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` content for this architecture (loadable by transformers and vLLM;
        `decoder_config_to_hf`)."""
        return decoder_config_to_hf(self)


# ------------------------------------------------------------------------------------------ HF config.json
# HF ``config.json`` <-> `DecoderConfig`, per family, with transformers' defaults where a key is absent.
# 
# Families (``model_type``): ``llama``, ``qwen2`` (QKV bias), ``qwen3`` (q/k head norms), ``mistral``, ``gemma2``
# and ``gemma3_text`` (Gemma structure; Gemma 3 adds q/k norms and a RoPE base of its own for sliding layers);
# mixtures of experts ``qwen3_moe`` (Qwen3 attention) and ``mixtral`` (Mistral attention, every layer sparse,
# experts of width ``intermediate_size``, top-k weights renormalised).
# Sliding windows are read as transformers reads them (`hf_sliding_layers`); model types met in the wild but not
# implemented are refused naming what is missing (``UNSUPPORTED_MODEL_TYPES``).

GEMMA_DEFAULTS = {  # Gemma2Config / Gemma3TextConfig defaults of the keys a config.json may leave out
    "gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window": 4096, "rope_theta": 10000.0},
    "gemma3_text": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "sliding_window": 4096, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
                    "sliding_window_pattern": 6},
}


def _check_moe_variant(hf: Mapping[str, Any]) -> None:
    """Refuse the MoE variants not implemented (`UNSUPPORTED_MOE_FIELDS`), naming the key."""
    for key, why in UNSUPPORTED_MOE_FIELDS.items():
        value = hf.get(key)
        if value is not None and not isinstance(value, bool) and isinstance(value, (int, float)) and value > 0:
            raise ValueError(f"config.json {key}={value!r} is not supported: {why}")


def _moe_fields(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The `DecoderConfig` MoE fields of a ``qwen3_moe`` or ``mixtral`` config.json (transformers' defaults where
    absent)."""
    if model_type == "mixtral":
        if float(hf.get("router_jitter_noise") or 0.0) > 0:
            raise ValueError(f"config.json router_jitter_noise={hf['router_jitter_noise']!r} is not supported: the "
                             "training forward's multiplicative router noise is not implemented (set it to 0.0)")
        get = lambda key: hf.get(key, MIXTRAL_DEFAULTS[key])  # noqa: E731
        experts = hf.get("num_local_experts", hf.get("num_experts", MIXTRAL_DEFAULTS["num_local_experts"]))
        return {"num_experts": int(experts),
                "num_experts_per_tok": int(get("num_experts_per_tok")),
                "moe_intermediate_size": int(hf["intermediate_size"]), "norm_topk_prob": True}
    if model_type != "qwen3_moe":
        return {}
    get = lambda key: hf.get(key, QWEN3_MOE_DEFAULTS[key])  # noqa: E731
    # transformers 5 writes num_experts as num_local_experts (its attribute_map alias); Qwen's files num_experts
    experts = int(hf["num_experts"] if "num_experts" in hf else get("num_local_experts" if "num_local_experts" in hf
                                                                    else "num_experts") or 0)
    if experts <= 0:
        return {}
    return {"num_experts": experts, "num_experts_per_tok": int(get("num_experts_per_tok")),
            "moe_intermediate_size": int(get("moe_intermediate_size")), "norm_topk_prob": bool(get("norm_topk_prob")),
            "decoder_sparse_step": int(get("decoder_sparse_step")),
            "mlp_only_layers": tuple(int(i) for i in (get("mlp_only_layers") or ()))}


def _check_model_type(hf: Mapping[str, Any]) -> str:
    _check_moe_variant(hf)
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
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not hf.get("use_sliding_window"):
        window = None
    if model_type == "llama" or window is None:
        return None, ()
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"config.json sliding_window={window!r} must be a positive int or null")
    every_layer = model_type in ("mistral", "mixtral")  # transformers' Mistral / Mixtral ignore layer_types
    types = hf.get("layer_types") if not every_layer else None
    if types is None:
        if every_layer:
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
        default_theta = (gemma["rope_theta"] if gemma else
                         MIXTRAL_DEFAULTS["rope_theta"] if model_type == "mixtral" else 10000.0)
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
        qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe"),
        sliding_window=sliding_window,
        layer_types=layer_types,
        hidden_act=hidden_act,
        query_pre_attn_scalar=gemma_float("query_pre_attn_scalar"),
        attn_logit_softcapping=gemma_float("attn_logit_softcapping"),
        final_logit_softcapping=gemma_float("final_logit_softcapping"),
        rope_local_theta=local_theta,
        **_moe_fields(hf, model_type),
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
    if c.model_type in ("llama", "qwen3", "qwen3_moe") + GEMMA_MODEL_TYPES:
        out["attention_bias"] = c.qkv_bias
    if c.model_type == "llama":
        out["mlp_bias"] = False
    windows = c.layer_windows
    # transformers' Gemma configs want a window even when no layer slides: one that hides nothing
    out["sliding_window"] = c.sliding_window if windows else (c.max_position_embeddings if c.is_gemma else None)
    if c.model_type in ("qwen2", "qwen3", "qwen3_moe"):
        out["use_sliding_window"] = windows is not None
        out["max_window_layers"] = c.num_hidden_layers
    if c.model_type not in ("mistral", "mixtral"):  # these slide every layer when sliding_window is set
        out["layer_types"] = ["sliding_attention" if w else "full_attention" for w in windows or (0,) * c.num_hidden_layers]
    if c.model_type == "mixtral":
        out.update(num_local_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                   router_jitter_noise=0.0, output_router_logits=False)
    if c.model_type == "qwen3_moe":
        out.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                   moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                   decoder_sparse_step=c.decoder_sparse_step, mlp_only_layers=list(c.mlp_only_layers))
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
