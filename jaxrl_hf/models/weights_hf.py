"""HF safetensors <-> flax param tree, with an exact name mapping both ways.

HF stores ``nn.Linear`` weights as ``[out, in]``; here kernels are ``[in, *out]`` with heads split
out (``q_proj``: ``[embed, heads, head_dim]``, ``o_proj``: ``[heads, head_dim, embed]``) and the
layers stacked on axis 0. Conversions are transposes/reshapes only, so a round trip is bit-exact.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Mapping

import jax
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_hf import progress
from jaxrl_hf.models.config import DecoderConfig

Params = dict[str, Any]
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


_DENSE_MLP_ENTRIES = [(f"mlp.{n}_proj.weight", ("mlp", f"{n}_proj", "kernel"), "linear") for n in ("gate", "up", "down")]


def hf_layer_entries(config: DecoderConfig) -> list[tuple[str, tuple[str, ...], str]]:
    """(HF suffix, path in ``params['model']['layers']``, kind) for one layer: the tensors every layer has (an MoE
    model's feed-forward differs per layer: `hf_mlp_entries`)."""
    entries = [
        ("input_layernorm.weight", ("input_layernorm", "scale"), "vec"),
        ("post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), "vec"),
        ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), "in_proj"),
        ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), "in_proj"),
        ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), "in_proj"),
        ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), "out_proj"),
    ]
    if not config.is_moe:
        entries += _DENSE_MLP_ENTRIES
    if config.qkv_bias:
        entries += [(f"self_attn.{n}_proj.bias", ("self_attn", f"{n}_proj", "bias"), "head_bias") for n in "qkv"]
    if config.o_bias:
        entries.append(("self_attn.o_proj.bias", ("self_attn", "o_proj", "bias"), "vec"))
    if config.qk_norm:  # Qwen3
        entries += [(f"self_attn.{n}_norm.weight", ("self_attn", f"{n}_norm", "scale"), "vec") for n in "qk"]
    if config.is_gemma:
        entries += [(f"{n}.weight", (n, "scale"), "vec")
                    for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")]
    return entries


_MOE_HF_NAMES = {"qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
                 "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"})}
"""Per MoE family: the sparse block's HF module name and its experts' projection names."""


def hf_mlp_entries(config: DecoderConfig, layer: int) -> list[tuple[str, tuple[str, ...], str, int | None]]:
    """An MoE model's (HF suffix, path in ``params['model']['layers']``, kind, expert) of layer ``layer``'s
    feed-forward (``expert``: the index into the path's ``expert`` axis, ``None`` for a whole per-layer leaf):
    the dense ``mlp.{gate,up,down}_proj`` of a dense layer; the router and the experts of a sparse one, named per
    family (`_MOE_HF_NAMES`: Qwen3-MoE ``mlp.gate`` and ``mlp.experts.{e}.{gate,up,down}_proj``, Mixtral
    ``block_sparse_moe.gate`` and ``block_sparse_moe.experts.{e}.{w1,w3,w2}``). Empty for a dense model
    (`hf_layer_entries` has its MLP)."""
    if not config.is_moe:
        return []
    if not config.moe_layers[layer]:
        return [(*entry, None) for entry in _DENSE_MLP_ENTRIES]
    block, names = _MOE_HF_NAMES[config.model_type]
    entries = [(f"{block}.gate.weight", ("moe", "router", "kernel"), "linear", None)]
    for e in range(config.num_experts):
        entries += [(f"{block}.experts.{e}.{names[n]}.weight", ("moe", f"{n}_proj", "kernel"), "linear", e)
                    for n in ("gate", "up", "down")]
    return entries


def _moe_leaf_shapes(config: DecoderConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """The stacked ``[layers, ...]`` shapes of an MoE model's feed-forward leaves."""
    c = config
    e, x, mi, layers = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.num_hidden_layers
    shapes = {("moe", "router", "kernel"): (layers, e, x), ("moe", "gate_proj", "kernel"): (layers, x, e, mi),
              ("moe", "up_proj", "kernel"): (layers, x, e, mi), ("moe", "down_proj", "kernel"): (layers, x, mi, e)}
    if not all(c.moe_layers):  # every layer holds the dense MLP too
        m = c.intermediate_size
        shapes.update({("mlp", "gate_proj", "kernel"): (layers, e, m), ("mlp", "up_proj", "kernel"): (layers, e, m),
                       ("mlp", "down_proj", "kernel"): (layers, m, e)})
    return shapes


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _from_hf(kind: str, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if kind == "in_proj":
        return np.ascontiguousarray(w.T).reshape(shape)
    if kind == "out_proj":
        return np.ascontiguousarray(w.T).reshape(shape)
    if kind == "linear":
        return np.ascontiguousarray(w.T)
    return w.reshape(shape)


def _expected_layer_shapes(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    e, m, h, k, d = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                     config.num_key_value_heads, config.head_dim)
    return {
        "input_layernorm.weight": (e,), "post_attention_layernorm.weight": (e,),
        "self_attn.q_proj.weight": (e, h, d), "self_attn.k_proj.weight": (e, k, d),
        "self_attn.v_proj.weight": (e, k, d), "self_attn.o_proj.weight": (h, d, e),
        "mlp.gate_proj.weight": (e, m), "mlp.up_proj.weight": (e, m), "mlp.down_proj.weight": (m, e),
        "self_attn.q_proj.bias": (h, d), "self_attn.k_proj.bias": (k, d), "self_attn.v_proj.bias": (k, d),
        "self_attn.o_proj.bias": (e,), "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "pre_feedforward_layernorm.weight": (e,), "post_feedforward_layernorm.weight": (e,),
    }


def to_hf_view(kind: str, x: Any) -> Any:
    """Flax layout -> HF layout of one layer's leaf, as a transposed/reshaped view (numpy or torch alike)."""
    if kind == "in_proj":  # [E, H, D] -> [H*D, E]
        return x.reshape(x.shape[0], -1).T
    if kind == "out_proj":  # [H, D, E] -> [E, H*D]
        return x.reshape(-1, x.shape[-1]).T
    if kind == "linear":
        return x.T
    if kind == "head_bias":
        return x.reshape(-1)
    return x


def iter_hf_tensor_views(params: Params, config: DecoderConfig,
                         to_array: Any = np.asarray) -> Iterator[tuple[str, Any]]:
    """Stream ``(hf_name, view)`` per HF tensor, layer by layer, without building the whole state dict.

    ``to_array`` turns each param leaf (a stacked ``[layers, ...]`` array) into an array type that
    supports ``[i]``, ``reshape`` and ``.T`` as views (numpy, or ``torch.from_dlpack`` for zero-copy
    torch tensors); it is called once per leaf. Views are in HF layout but generally not contiguous.
    Order: embedding, then all tensors of layer 0, layer 1, ..., then the final norm and ``lm_head``.
    """
    model = params["model"]
    yield "model.embed_tokens.weight", to_array(model["embed_tokens"]["embedding"])
    entries = hf_layer_entries(config)
    stacked = [to_array(_get(model["layers"], path)) for _, path, _ in entries]
    moe = {path: to_array(_get(model["layers"], path)) for path in _moe_leaf_shapes(config)} if config.is_moe else {}
    for i in range(config.num_hidden_layers):
        for (suffix, _, kind), leaf in zip(entries, stacked):
            yield f"model.layers.{i}.{suffix}", to_hf_view(kind, leaf[i])
        for suffix, path, kind, expert in hf_mlp_entries(config, i):
            leaf = moe[path][i]
            yield f"model.layers.{i}.{suffix}", to_hf_view(kind, leaf if expert is None else leaf[expert])
    yield "model.norm.weight", to_array(model["norm"]["scale"])
    if not config.tie_word_embeddings:
        yield "lm_head.weight", to_array(params["lm_head"]["kernel"]).T


def params_to_hf_state_dict(params: Params, config: DecoderConfig) -> dict[str, np.ndarray]:
    """HF-named numpy state dict (``model.layers.{i}.self_attn.q_proj.weight`` ...) from ``params``."""
    return {name: np.ascontiguousarray(view) for name, view in iter_hf_tensor_views(jax.device_get(params), config)}


def hf_state_dict_to_params(state: Mapping[str, np.ndarray], config: DecoderConfig,
                            source: str = "state dict", prefix: str = "") -> Params:
    """Inverse of ``params_to_hf_state_dict``; missing, unexpected or mis-shaped tensors raise, naming them.

    ``prefix`` is prepended to every HF name (e.g. ``"model."`` inside a ``...ForCausalLM``); the
    ``lm_head.weight`` of a tied checkpoint is ignored.
    """
    remaining = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    params: Params = {}

    def take(name: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
        if name not in remaining:
            raise KeyError(f"{source}: missing tensor {name!r}")
        value = np.asarray(remaining.pop(name))
        if shape is not None and int(np.prod(value.shape)) != int(np.prod(shape)):
            raise ValueError(f"{source}: tensor {name!r} has shape {value.shape}, expected {shape} elements")
        return value

    v, e = config.vocab_size, config.hidden_size
    emb = take(f"{prefix}model.embed_tokens.weight")
    if emb.shape != (v, e):
        raise ValueError(f"{source}: model.embed_tokens.weight has shape {emb.shape}, expected {(v, e)}")
    _set(params, ("model", "embed_tokens", "embedding"), emb)
    _set(params, ("model", "norm", "scale"), take(f"{prefix}model.norm.weight", (e,)))
    shapes = _expected_layer_shapes(config)
    for suffix, path, kind in hf_layer_entries(config):
        per_layer = []
        for i in range(config.num_hidden_layers):
            w = take(f"{prefix}model.layers.{i}.{suffix}", shapes[suffix])
            per_layer.append(_from_hf(kind, w, shapes[suffix]))
        _set(params, ("model", "layers", *path), np.stack(per_layer))
    if config.is_moe:  # per layer, the leaves it has; the rest (a sparse layer's dense MLP, ...) stay zero
        stacked = {path: None for path in _moe_leaf_shapes(config)}
        for i in range(config.num_hidden_layers):
            for suffix, path, kind, expert in hf_mlp_entries(config, i):
                shape = _moe_leaf_shapes(config)[path][2 if expert is not None else 1:]
                w = _from_hf(kind, take(f"{prefix}model.layers.{i}.{suffix}", shape), shape)
                if stacked[path] is None:
                    stacked[path] = np.zeros(_moe_leaf_shapes(config)[path], w.dtype)
                stacked[path][(i,) if expert is None else (i, expert)] = w
        for path, value in stacked.items():
            _set(params, ("model", "layers", *path), value)
    if config.tie_word_embeddings:
        remaining.pop(f"{prefix}lm_head.weight", None)
    else:
        head = take(f"{prefix}lm_head.weight")
        if head.shape != (v, e):
            raise ValueError(f"{source}: lm_head.weight has shape {head.shape}, expected {(v, e)}")
        _set(params, ("lm_head", "kernel"), np.ascontiguousarray(head.T))
    if remaining:
        raise ValueError(f"{source}: unexpected tensor(s) {sorted(remaining)[:8]} (total {len(remaining)}) "
                         f"for a {config.model_type} decoder with {config.num_hidden_layers} layers")
    return params


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(path, name) for name in json.load(f)["weight_map"].values()})
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, array)`` pairs of every tensor of an HF checkpoint directory (single or sharded); a bar counts the
    tensors read (`jaxrl_hf.progress.task`, on a terminal)."""
    files = _safetensors_files(os.fspath(path))
    names = []
    for file in files:  # the headers only
        with safe_open(file, "np") as fh:
            names.append(list(fh.keys()))
    with progress.task(f"reading {os.path.basename(os.path.normpath(path))}", sum(map(len, names)),
                       "tensors") as read:
        for file, keys in zip(files, names):
            with safe_open(file, "np") as fh:
                for name in keys:
                    yield name, fh.get_tensor(name)
                    read.advance()


def load_hf_dir(path: str | os.PathLike, **runtime: Any) -> tuple[DecoderConfig, Params]:
    """``(config, params)`` from an HF directory (``config.json`` + safetensors); params as numpy float32."""
    path = os.fspath(path)
    config = DecoderConfig.from_pretrained_dir(path, **runtime)
    state = {name: _to_param_dtype(arr, config.param_dtype) for name, arr in iter_safetensors(path)}
    return config, hf_state_dict_to_params(state, config, source=path)


def _to_param_dtype(arr: np.ndarray, dtype: str) -> np.ndarray:
    return arr if arr.dtype == np.dtype(dtype) else arr.astype(dtype)


def save_hf_dir(path: str | os.PathLike, params: Params, config: DecoderConfig,
                extra_files: Mapping[str, str] | None = None) -> None:
    """Write ``model.safetensors`` + ``config.json`` (+ ``extra_files`` name -> text) into ``path``.

    The result loads with ``transformers.AutoModelForCausalLM.from_pretrained(path)`` and vLLM.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    state = params_to_hf_state_dict(params, config)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f, indent=2)
    for name, text in (extra_files or {}).items():
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
