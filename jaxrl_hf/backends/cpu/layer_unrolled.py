"""The decoder with its layers unrolled over per-layer weights and per-layer KV caches (the CPU decode loop).

`CausalLM` scans its layers over stacked weights and a stacked ``[layers, ...]`` KV cache. Inside a decode loop,
XLA:CPU copies every layer's weights and cache slots out of the stacked arrays at every step (a ``dynamic-slice``
is a copy there, not a view). Here each layer reads its own arrays, which need no slicing:

* `split_layers` turns a `CausalLM` param tree into ``(rest, layers)``: the tree without ``model/layers`` and a
  tuple of per-layer trees (the same leaves as the stacked tree's ``[i]``);
* `init_layer_caches` gives one ``{"k", "v"}: [batch, kv_heads, cache_len, head_dim]`` cache per layer (or keys
  stored transposed, ``"kt"``; `slot_axis` says where a tensor's slots are);
* `hidden_states` runs embedding, layers and final norm. With ``store`` each layer writes its new keys/values
  into its own cache *before* reading it (``DecoderLayer(store=True)``), so the read depends on the write and
  XLA updates the loop-carried cache in place (read first and written after, as the scan does, the two are
  unordered and XLA copies every layer's cache twice per step). The new keys are then read back from the cache
  (`attention.stored_attention`: one softmax over its slots, no separate scores for them and no concatenation).

* `to_panels` / `cpu_kernel_module`: the weights with every projection kernel in panel order and the module
  that runs them in `backends.cpu.ffi` (`DecoderConfig.cpu_kernels`; the LM head untied).

The numbers are those of the scanned decoder up to float32 summation order: the same layer module, the same
keys seen, the same rounding of the new keys/values (`tests/test_rollout_engine.py`).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxrl_hf.backends.cpu.panel_matmul import from_panel_order, to_panel_order
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.llama import CausalLM, DecoderLayer, KVCache

Params = Any


def split_layers(params: Params, num_layers: int) -> tuple[Params, tuple[Params, ...]]:
    """``(rest, layers)``: the tree without ``model/layers``, and layer ``i``'s weights for each ``i``."""
    stacked = params["model"]["layers"]
    rest = {**params, "model": {k: v for k, v in params["model"].items() if k != "layers"}}
    return rest, tuple(jax.tree.map(lambda leaf, i=i: leaf[i], stacked) for i in range(num_layers))


def stack_layers(split: tuple[Params, tuple[Params, ...]]) -> Params:
    """The `CausalLM` tree again (`split_layers` inverted)."""
    rest, layers = split
    return {**rest, "model": {**rest["model"], "layers": jax.tree.map(lambda *a: jnp.stack(a), *layers)}}


FAN_IN_DIMS = {"o_proj": 2}
"""Leading kernel dims a projection contracts (``llama.Attention``'s ``o_proj``: heads and head_dim); others 1."""


def cpu_kernel_module(module: CausalLM) -> CausalLM:
    """The module that runs on `to_panels` weights in `backends.cpu.ffi` (``DecoderConfig.cpu_kernels``; its LM
    head untied)."""
    return CausalLM(module.config.replace(cpu_kernels=True, tie_word_embeddings=False), module.mesh, module.rules)


def to_panels(params: tuple[Params, tuple[Params, ...]]) -> tuple[Params, tuple[Params, ...]]:
    """`split_layers` weights with each layer's projection kernels holding their ``[fan_in, fan_out]`` matrices in
    panel order (float32; same shapes), and the LM head as ``lm_head/kernel`` in panel order (the embedding
    transposed when tied; the embedding stays for the lookup)."""
    rest, layers = params
    head = rest["lm_head"]["kernel"] if "lm_head" in rest else rest["model"]["embed_tokens"]["embedding"].T
    rest = {**rest, "lm_head": {"kernel": to_panel_order(head.astype(jnp.float32))}}
    return rest, _map_kernels(lambda w: to_panel_order(w.astype(jnp.float32)), layers)


def from_panels(params: tuple[Params, tuple[Params, ...]], tied: bool) -> tuple[Params, tuple[Params, ...]]:
    """`to_panels` inverted (``tied``: the LM head was the embedding, and is dropped)."""
    rest, layers = params
    head = {} if tied else {"lm_head": {"kernel": from_panel_order(rest["lm_head"]["kernel"])}}
    rest = {**{k: v for k, v in rest.items() if k != "lm_head"}, **head}
    return rest, _map_kernels(from_panel_order, layers)


def _map_kernels(fn: Any, layers: tuple[Params, ...]) -> tuple[Params, ...]:
    """``fn`` applied to each projection kernel as its ``[fan_in, fan_out]`` matrix (same shapes back)."""
    def apply(path: tuple, leaf: jnp.ndarray) -> jnp.ndarray:
        names = [getattr(key, "key", None) for key in path]
        if names[-1] != "kernel":
            return leaf
        fan_in = math.prod(leaf.shape[:FAN_IN_DIMS.get(names[-2], 1)])
        return fn(leaf.reshape(fan_in, -1)).reshape(leaf.shape)
    return jax.tree_util.tree_map_with_path(apply, layers)


def init_layer_caches(config: DecoderConfig, batch: int, cache_len: int, dtype: Any,
                      keys_transposed: bool = False) -> tuple[KVCache, ...]:
    """Zeroed ``{"k", "v"}: [batch, kv_heads, cache_len, head_dim]`` caches, one per layer; ``keys_transposed``:
    ``{"kt": [batch, kv_heads, head_dim, cache_len], "v"}``."""
    shape = (batch, config.num_key_value_heads, cache_len, config.head_dim)
    k_shape = (*shape[:2], shape[3], shape[2]) if keys_transposed else shape
    return tuple({"kt" if keys_transposed else "k": jnp.zeros(k_shape, dtype), "v": jnp.zeros(shape, dtype)}
                 for _ in range(config.num_hidden_layers))


def slot_axis(name: str) -> int:
    """The cache-slot axis of one layer's cache tensor ``name`` (``"kt"``: keys stored transposed)."""
    return 3 if name == "kt" else 2


def grow_cache(cache: KVCache, cache_len: int) -> KVCache:
    """One layer's cache with zeroed slots appended up to ``cache_len``."""
    def grow(name: str, a: jnp.ndarray) -> jnp.ndarray:
        pad = [(0, 0)] * a.ndim
        pad[slot_axis(name)] = (0, cache_len - a.shape[slot_axis(name)])
        return jnp.pad(a, pad)
    return {name: grow(name, a) for name, a in cache.items()}


def hidden_states(module: CausalLM, params: tuple[Params, tuple[Params, ...]], input_ids: jnp.ndarray,
                  positions: jnp.ndarray, attention_mask: jnp.ndarray, caches: tuple[KVCache, ...],
                  cache_index: jnp.ndarray | int, store: bool) -> tuple[jnp.ndarray, tuple[KVCache, ...]]:
    """``(hidden [B, T, embed], per-layer results)`` of `CausalLM.hidden_states_and_new_kv` over ``split_layers``
    weights: with ``store``, each layer's cache with this call's keys/values written at ``cache_index``; without,
    each layer's new keys/values ``[B, T, kv_heads, head_dim]`` (a Python-int ``cache_index`` 0 reads no slot)."""
    rest, layers = params
    config = module.config
    x = module.apply({"params": rest}, input_ids, method=lambda m, ids: m.model.embed(ids))
    if isinstance(cache_index, int) and cache_index == 0 and not store:
        caches = tuple({name: jax.lax.slice_in_dim(a, 0, 0, axis=slot_axis(name)) for name, a in cache.items()}
                       for cache in caches)
    index = jnp.asarray(cache_index, jnp.int32)
    layer = DecoderLayer(config, module.mesh, module.rules)
    windows = config.layer_windows
    outs = []
    for i, (weights, cache) in enumerate(zip(layers, caches)):
        window = None if windows is None else jnp.int32(windows[i])
        sparse = (jnp.asarray(config.moe_layers[i]),) if config.is_moe and not all(config.moe_layers) else ()
        x, out = layer.apply({"params": weights}, x, positions, attention_mask, index, cache, window, store, *sparse)
        outs.append(out)
    return module.apply({"params": rest}, x, method=lambda m, h: m.model.norm(h)), tuple(outs)
