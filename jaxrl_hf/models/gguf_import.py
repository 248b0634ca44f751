"""GGUF (llama.cpp) -> HF-format checkpoint: dequantised weights, config.json and tokenizer files.

Steps: read the file with the ``gguf`` package, dequantise every tensor to float32
(``gguf.quants.dequantize``), rename llama.cpp tensor names to HF names, undo the Q/K row
permutation that llama.cpp's converter applies to ``llama`` checkpoints (it interleaves the two
rotary halves of every head; HF keeps them as contiguous halves), and rebuild a byte-level BPE
``tokenizer.json`` from the ``tokenizer.ggml.*`` metadata.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxrl_hf import progress
from jaxrl_hf.models.config import DecoderConfig

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}

# Pre-tokenizer split regexes by ``tokenizer.ggml.pre`` (llama.cpp's names).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SUPPORTED_PRE_TOKENIZERS = ("smollm", "gpt-2", "default", "qwen2", "llama-bpe")


@dataclass
class GGUFCheckpoint:
    """Everything needed to write an HF directory."""

    config: DecoderConfig
    state_dict: dict[str, np.ndarray]
    tokenizer_json: str
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]


def unpermute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's ``permute``: rows ``[head, pair, 2]`` -> ``[head, 2, pair]`` (rotate-half layout)."""
    rows = weight.shape[0]
    head_dim = rows // n_head
    rest = weight.shape[1:]
    return weight.reshape(n_head, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str, default: Any = KeyError) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise KeyError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def read_config(reader: Any, path: str) -> DecoderConfig:
    """``DecoderConfig`` from GGUF ``{arch}.*`` metadata (``llama`` and ``qwen2`` architectures)."""
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: ['llama', 'qwen2'] "
                         "(an HF directory or hub id also takes qwen3, mistral, gemma2 and gemma3_text)")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id", None)
    rope_scaling: dict[str, Any] = {}
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", None)
    if scaling_type not in (None, "none"):
        if scaling_type != "linear":
            raise ValueError(f"{path}: GGUF rope scaling {scaling_type!r} is not supported by the importer")
        rope_scaling = {"rope_type": "linear", "factor": float(_field(reader, f"{arch}.rope.scaling.factor"))}
    return DecoderConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=tuple(sorted(rope_scaling.items())),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        model_type=arch,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_ids=() if eos is None else (int(eos),),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id", None),
    )


def read_state_dict(reader: Any, config: DecoderConfig, path: str) -> dict[str, np.ndarray]:
    """Dequantised float32 tensors under HF names, Q/K un-permuted for ``llama`` files."""
    from gguf.quants import dequantize

    state: dict[str, np.ndarray] = {}
    with progress.task(f"converting {os.path.basename(path)}", len(reader.tensors), "tensors") as converted:
        for tensor in reader.tensors:
            _convert_tensor(tensor, config, path, state, dequantize)
            converted.advance()
    return state


def _convert_tensor(tensor: Any, config: DecoderConfig, path: str, state: dict[str, np.ndarray],
                    dequantize: Any) -> None:
    """One GGUF tensor into ``state`` under its HF name (none for ``rope_freqs``)."""
    name = tensor.name
    if name.startswith("blk."):
        _, idx, local = name.split(".", 2)
        if local not in _LAYER_NAMES:
            raise ValueError(f"{path}: unknown GGUF tensor {name!r}")
        hf_name = f"model.layers.{int(idx)}.{_LAYER_NAMES[local]}"
    elif name in _GLOBAL_NAMES:
        hf_name = _GLOBAL_NAMES[name]
    elif name == "rope_freqs.weight":
        return
    else:
        raise ValueError(f"{path}: unknown GGUF tensor {name!r}")
    array = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if config.model_type == "llama":
        if local_is(hf_name, "q_proj"):
            array = unpermute_qk(array, config.num_attention_heads)
        elif local_is(hf_name, "k_proj"):
            array = unpermute_qk(array, config.num_key_value_heads)
    state[hf_name] = array


def local_is(hf_name: str, proj: str) -> bool:
    return f".self_attn.{proj}." in hf_name


def _bpe_pre_tokenizer(pre: str, path: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    if pre == "smollm":  # llama.cpp: digits split individually, then the GPT-2 regex
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    if pre in ("gpt-2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    split = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT}.get(pre)
    if split is None:
        raise ValueError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported; supported: {SUPPORTED_PRE_TOKENIZERS}")
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])


def build_tokenizer_json(reader: Any, path: str) -> str:
    """A ``tokenizer.json`` (HF ``tokenizers`` format) for the GGUF's byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = _bpe_pre_tokenizer(_field(reader, "tokenizer.ggml.pre", "default"), path)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # 3 = CONTROL (special, never split), 4 = USER_DEFINED (kept whole, not special).
    specials = [AddedToken(t, special=True, normalized=False) for t, y in zip(tokens, token_types) if y == 3]
    user = [AddedToken(t, special=False, normalized=False) for t, y in zip(tokens, token_types) if y == 4]
    tokenizer.add_special_tokens(specials)
    if user:
        tokenizer.add_tokens(user)
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(f"{path}: rebuilt tokenizer has {tokenizer.get_vocab_size(True)} tokens, file lists {len(tokens)}")
    return tokenizer.to_str(pretty=False)


def _token_or_none(tokens: list[str], idx: Any) -> str | None:
    return None if idx is None else tokens[int(idx)]


def read_gguf(path: str | os.PathLike) -> GGUFCheckpoint:
    """Parse a GGUF file into config, float32 HF state dict and tokenizer files."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = gguf.GGUFReader(path)
    config = read_config(reader, path)
    state = read_state_dict(reader, config, path)
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    template = _field(reader, "tokenizer.chat_template", None)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "bos_token": _token_or_none(tokens, _field(reader, "tokenizer.ggml.bos_token_id", None)),
        "eos_token": _token_or_none(tokens, _field(reader, "tokenizer.ggml.eos_token_id", None)),
        "unk_token": _token_or_none(tokens, _field(reader, "tokenizer.ggml.unknown_token_id", None)),
        "pad_token": _token_or_none(tokens, _field(reader, "tokenizer.ggml.padding_token_id", None)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
    }
    if template is not None:
        tokenizer_config["chat_template"] = template
    generation_config = {"bos_token_id": config.bos_token_id,
                         "eos_token_id": config.eos_token_ids[0] if config.eos_token_ids else None,
                         "pad_token_id": config.pad_token_id}
    return GGUFCheckpoint(config, state, build_tokenizer_json(reader, path), tokenizer_config, generation_config)


def write_hf_dir(checkpoint: GGUFCheckpoint, out_dir: str | os.PathLike) -> None:
    """Write the checkpoint as an HF directory (model.safetensors, config.json, tokenizer files)."""
    from safetensors.numpy import save_file

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    save_file(checkpoint.state_dict, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    files = {
        "config.json": checkpoint.config.to_hf_dict(),
        "tokenizer_config.json": checkpoint.tokenizer_config,
        "generation_config.json": checkpoint.generation_config,
    }
    for name, content in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(content, f, indent=2)
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        f.write(checkpoint.tokenizer_json)
