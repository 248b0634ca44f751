"""Native JAX generation engine: batched prefill + jitted decode loop over a static KV cache.

``JaxGenerationEngine.generate(prompts, SamplingParams(...))`` left-pads the prompts to a length
bucket, repeats each prompt ``n`` times (interleaved, as verl's ``repeat(interleave=True)``), pads the
batch to a batch bucket, and runs one compiled program: prefill over the prompt, then a
``lax.while_loop`` that emits one token per row per step, stops a row after its first stop token
(EOS included in the response and its mask), and exits early when every row has stopped.
Buckets bound recompilation: calls whose (batch bucket, length bucket, max_new_tokens, top_k,
greedy, logprobs mode, stop ids) agree reuse the compiled program; temperature, top-p and the seed
are runtime values.

Several JAX processes (a mesh whose devices belong to more than one process, ``jax.distributed``): every
process calls ``generate`` with *its own* prompts, in lockstep, and gets back only its own rows — see
`jaxrl_hf.rollout.multiprocess` for the row-group contract, the cross-process agreement on buckets and
the seeds (a row's key is ``fold_in(seed, global row index)``, as with one process).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf.backends.cpu import ffi, layer_unrolled
from jaxrl_hf.mesh.rules import logical_to_spec
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.forward import compute_dtype_weights, decode_weights, make_module, param_shardings
from jaxrl_hf.models.llama import (KV_CACHE_LOGICAL_AXES, CausalLM, default_positions, init_kv_cache,
                                   write_kv_cache)
from jaxrl_hf.rollout import multiprocess as mp
from jaxrl_hf.rollout.base import GenerationOutput, SamplingParams
from jaxrl_hf.rollout.padding import DEFAULT_LENGTH_BUCKETS, bucket, left_pad_prompts
from jaxrl_hf.rollout.sampling import sample_tokens

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def default_cache_dtype(config: DecoderConfig) -> str:
    """The KV cache's dtype when none is given: the compute dtype (stored as `cache_storage_dtype` says)."""
    return config.dtype


def cache_storage_dtype(cache_dtype: str, config: DecoderConfig, as_bits: bool) -> str:
    """How a KV cache of ``cache_dtype`` is held: with ``as_bits`` (the engine's default on CPU devices) a 16-bit
    cache in the compute dtype as its ``uint16`` bit patterns, else ``cache_dtype`` itself.

    XLA:CPU has no in-place 16-bit float ``dynamic-update-slice`` or ``dynamic-slice``: a bf16 cache would be
    converted to float32 and back as a whole to write one slot and sliced through float32 per layer. As
    integers it is written in place and each layer's slots are read as stored; the numbers are the same."""
    if as_bits and cache_dtype == config.dtype and jnp.dtype(cache_dtype).itemsize == 2:
        return "uint16"
    return cache_dtype


def _on_cpu(mesh: jax.sharding.Mesh | None) -> bool:
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    return device.platform == "cpu"


def _constrain(module: CausalLM, x: jnp.ndarray, names: tuple) -> jnp.ndarray:
    """``x`` constrained to the logical axes ``names`` on the module's mesh (no-op without mesh and rules)."""
    if module.mesh is None or module.rules is None:
        return x
    spec = logical_to_spec(names, module.rules)
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(module.mesh, spec))


def _constrain_layer_cache(module: CausalLM, cache: dict) -> dict:
    """One layer's cache constrained to its logical axes (keys stored transposed: ``kt``)."""
    axes = KV_CACHE_LOGICAL_AXES[1:]
    return {name: _constrain(module, a, axes[:2] + axes[:1:-1] if name == "kt" else axes)
            for name, a in cache.items()}


def _store_kv(module: CausalLM, cache: dict, new_kv: dict, index: Any) -> dict:
    """Write a step's new keys/values into the cache at slot ``index`` (one update per tensor, in place on a
    loop-carried or donated cache; the layer scan itself only reads the cache)."""
    return jax.tree.map(lambda c: _constrain(module, c, KV_CACHE_LOGICAL_AXES), write_kv_cache(cache, new_kv, index))


def _routed_apply(module: CausalLM, params: Any, *args: Any, record: bool) -> tuple:
    """``hidden_states_and_new_kv`` of a stacked tree, and with ``record`` the experts each MoE layer chose for each
    token, ``[layers, B·T, k]`` (``-1`` in a dense layer; `jaxrl_hf.models.llama.DecoderLayer`), else None."""
    if not record:
        return module.apply({"params": params}, *args, method=CausalLM.hidden_states_and_new_kv), None
    out, state = module.apply({"params": params}, *args, method=CausalLM.hidden_states_and_new_kv,
                              mutable=["intermediates"])
    return out, state["intermediates"]["model"]["layers"]["router_experts"][0]


def decode_step(params: Any, cache: Any, full_mask: jnp.ndarray, tokens: jnp.ndarray, positions: jnp.ndarray,
                index: Any, *, module: CausalLM, record: bool = False) -> tuple:
    """One decode step: ``tokens [B]`` at ``positions [B]`` go into cache slot ``index``; returns the next-token
    logits ``[B, vocab]`` (float32) and the updated cache. ``full_mask [B, S]`` marks the valid cache slots
    (prompt mask, then ones for the generated slots). The body of the engine's decode loop.

    ``params`` / ``cache`` are a `CausalLM` tree and a stacked cache, or `layer_unrolled.split_layers` weights and
    per-layer caches (a tuple: the layers unrolled, each cache written in place before it is read). ``record`` (a
    stacked tree): a third output, the experts of each row's token, ``[layers, B, k]``."""
    if isinstance(cache, tuple):
        hidden, cache = layer_unrolled.hidden_states(module, params, tokens[:, None], positions[:, None], full_mask,
                                                     cache, index, store=True)
        cache = tuple(_constrain_layer_cache(module, c) for c in cache)
        return _logits(module, params[0], hidden)[:, 0], cache
    (hidden, new_kv), experts = _routed_apply(module, params, tokens[:, None], positions[:, None], full_mask, cache,
                                              index, record=record)
    cache = _store_kv(module, cache, new_kv, index)
    return (_logits(module, params, hidden)[:, 0], cache) + ((experts,) if record else ())


def _logits(module: CausalLM, params: Any, hidden: jnp.ndarray) -> jnp.ndarray:
    return module.apply({"params": params}, hidden, method=CausalLM.logits_from_hidden)


def _prefill(params: Any, cache: Any, ids: jnp.ndarray, mask: jnp.ndarray, full_mask: jnp.ndarray, *,
             module: CausalLM, config: DecoderConfig, share: int, batch: int, record: bool = False) -> tuple:
    """The prompts' last hidden states' logits ``[rows, vocab]`` and ``cache`` with their keys/values written at
    slot 0, each prompt's copied to its ``share`` rows (``cache`` stacked, or per layer with unrolled weights).
    ``record`` (stacked): a third output, the prompt tokens' experts ``[layers, rows, P, k]`` (per row)."""
    positions = default_positions(mask)
    repeat = lambda kv: jax.tree.map(lambda a: _repeat_rows(a, share, batch, axis=a.ndim - 4), kv)  # noqa: E731
    if isinstance(cache, tuple):
        hidden, new_kv = layer_unrolled.hidden_states(module, params, ids, positions, full_mask, cache, 0,
                                                      store=False)
        cache = tuple(_constrain_layer_cache(module, write_kv_cache(c, repeat(kv), 0)) for c, kv in zip(cache, new_kv))
        return _logits(module, params[0], hidden[:, -1:])[:, 0], cache
    prefill_cache = cache if share == 1 else init_kv_cache(config, ids.shape[0], cache["k"].shape[3],
                                                          cache["k"].dtype)
    (hidden, new_kv), experts = _routed_apply(module, params, ids, positions, full_mask, prefill_cache, 0,
                                              record=record)
    out = _logits(module, params, hidden[:, -1:])[:, 0], _store_kv(module, cache, repeat(new_kv), 0)
    if not record:
        return out
    layers, _, k = experts.shape
    return out + (_repeat_rows(experts.reshape(layers, ids.shape[0], ids.shape[1], k), share, batch, axis=1),)


def _repeat_rows(x: jnp.ndarray, share: int, rows: int, axis: int = 0) -> jnp.ndarray:
    """Each row ``share`` times in a row (row r of the result is row r // share of ``x``), cut to ``rows``."""
    if share == 1:
        return x
    return jax.lax.slice_in_dim(jnp.repeat(x, share, axis=axis), 0, rows, axis=axis)


def _generate_program(params: Any, prompt_ids: jnp.ndarray, prompt_mask: jnp.ndarray, row_valid: jnp.ndarray,
                      row_keys: jax.Array, temperature: jnp.ndarray, top_p: jnp.ndarray, *, module: CausalLM,
                      config: DecoderConfig, max_new: int, top_k: int, use_top_p: bool, greedy: bool,
                      logprobs_mode: str, stop_ids: tuple[int, ...], pad_id: int, cache_dtype: str,
                      share: int = 1, unrolled: bool = False, keys_transposed: bool = False,
                      cpu_kernels: bool = False, record_routing: bool = False) -> tuple:
    """Prefill + decode loop (pure; jitted by the engine). Returns (tokens, mask, logprobs, stopped), and with
    ``record_routing`` (a mixture-of-experts model, stacked layers) the experts of every prompt and generated token,
    ``[rows, P + max_new, layers, k]`` (a token's entry is the routing of the step that read it).

    ``share`` > 1: ``prompt_ids`` holds each prompt once and the ``row_valid.shape[0]`` rows are its ``share``
    samples in a row; the prompt is prefilled once and its keys/values and first-token logits are copied to its
    samples (the n samples of a prompt share one prefill, as vLLM's prefix cache does). ``unrolled``: ``params``
    are `layer_unrolled.split_layers` weights and the cache is one array pair per layer; ``cpu_kernels``: in panel
    order too (`layer_unrolled.to_panels`), run by `layer_unrolled.cpu_kernel_module`."""
    batch, prompt_len = row_valid.shape[0], prompt_ids.shape[1]
    module = layer_unrolled.cpu_kernel_module(module) if cpu_kernels else module
    ends = decode_phases(max_new) if unrolled else (max_new,)
    if unrolled:
        cache = layer_unrolled.init_layer_caches(config, batch, prompt_len + ends[0], cache_dtype, keys_transposed)
        cache = tuple(_constrain_layer_cache(module, c) for c in cache)
    else:
        cache = init_kv_cache(config, batch, prompt_len + max_new, cache_dtype)
        cache = jax.tree.map(lambda c: _constrain(module, c, KV_CACHE_LOGICAL_AXES), cache)
    prompt_rows = prompt_ids.shape[0]
    prefill_mask = jnp.concatenate([prompt_mask.astype(jnp.int32), jnp.ones((prompt_rows, max_new), jnp.int32)],
                                   axis=1)
    logits, cache, *prompt_experts = _prefill(params, cache, prompt_ids, prompt_mask, prefill_mask, module=module,
                                              config=config, share=share, batch=batch, record=record_routing)
    logits = _repeat_rows(logits, share, batch)
    full_mask = _repeat_rows(prefill_mask, share, batch)
    positions = default_positions(_repeat_rows(prompt_mask, share, batch))
    sample = partial(sample_tokens, temperature=temperature, top_k=top_k, top_p=top_p, use_top_p=use_top_p,
                     greedy=greedy, logprobs_mode=logprobs_mode)
    step_keys = lambda step: jax.vmap(jax.random.fold_in, (0, None))(row_keys, step)  # noqa: E731
    token, logp = sample(step_keys(0), logits)
    stop_arr = jnp.asarray(stop_ids if stop_ids else (-1,), jnp.int32)

    state = dict(
        step=jnp.zeros((), jnp.int32), token=token, logp=logp, done=~row_valid.astype(bool),
        pos=positions[:, -1] + 1, cache=cache,
        out_tokens=jnp.full((batch, max_new), pad_id, jnp.int32), out_mask=jnp.zeros((batch, max_new), jnp.int32),
        out_logp=jnp.zeros((batch, max_new), jnp.float32), stopped=jnp.zeros((batch,), bool))
    if record_routing:
        layers, k = config.num_hidden_layers, config.num_experts_per_tok
        state["out_experts"] = jnp.zeros((layers, batch, max_new, k), jnp.int32)

    def body(s: dict, full_mask: jnp.ndarray) -> dict:
        step, token = s["step"], s["token"]
        emit = ~s["done"]
        hit_stop = emit & jnp.isin(token, stop_arr)
        out_tokens = s["out_tokens"].at[:, step].set(jnp.where(emit, token, pad_id))
        out_mask = s["out_mask"].at[:, step].set(emit.astype(jnp.int32))
        out_logp = s["out_logp"].at[:, step].set(jnp.where(emit, s["logp"], 0.0))
        feed = jnp.where(emit, token, pad_id)
        next_logits, new_cache, *experts = decode_step(params, s["cache"], full_mask, feed, s["pos"],
                                                       prompt_len + step, module=module, record=record_routing)
        next_token, next_logp = sample(step_keys(step + 1), next_logits)
        new = dict(step=step + 1, token=next_token, logp=next_logp, done=s["done"] | hit_stop, pos=s["pos"] + 1,
                   cache=new_cache, out_tokens=out_tokens, out_mask=out_mask, out_logp=out_logp,
                   stopped=s["stopped"] | hit_stop)
        if record_routing:  # the token fed at this step is response token `step`
            new["out_experts"] = s["out_experts"].at[:, :, step].set(experts[0])
        return new

    for phase, end in enumerate(ends):  # unrolled: each phase attends over the slots its last step can fill
        if phase:
            state["cache"] = tuple(layer_unrolled.grow_cache(c, prompt_len + end) for c in state["cache"])
        state = jax.lax.while_loop(lambda s, end=end: (s["step"] < end) & ~jnp.all(s["done"]),
                                   partial(body, full_mask=full_mask[:, :prompt_len + end]), state)
    out = state["out_tokens"], state["out_mask"], state["out_logp"], state["stopped"]
    if not record_routing:
        return out
    experts = jnp.concatenate([prompt_experts[0], state["out_experts"]], axis=2)  # [layers, rows, P + max_new, k]
    return out + (jnp.transpose(experts, (1, 2, 0, 3)),)


def _program_form(params: Any, *, layers: int, panels: bool) -> tuple:
    """A `CausalLM` tree as an unrolled program reads it: split per layer, in panel order with ``panels``."""
    split = layer_unrolled.split_layers(params, layers)
    return layer_unrolled.to_panels(split) if panels else split


def _tree_form(params: tuple, *, tied: bool, panels: bool) -> Any:
    """`_program_form` inverted."""
    return layer_unrolled.stack_layers(layer_unrolled.from_panels(params, tied) if panels else params)


def decode_phases(max_new: int) -> tuple[int, ...]:
    """The steps after which an unrolled decode loop grows its per-layer caches: up to four phases, each but the last
    ``max(32, ceil(max_new / 32) * 32 // 4)`` steps long (one phase below 64 new tokens)."""
    if max_new < 64:
        return (max_new,)
    size = max(32, -(-max_new // 32) * 32 // 4)
    return tuple(range(size, max_new, size)) + (max_new,)


class JaxGenerationEngine:
    """Batched sampler over a ``CausalLM`` param tree, optionally on a sharded mesh.

    With ``mesh`` and ``rules`` (logical -> mesh axis rules, as used by ``mesh/``) the params are
    placed by ``param_shardings`` and prompts/KV cache are sharded on the ``batch`` logical axis.
    """

    engine_name = "jax"
    weights_discarded = False  # its sleep frees nothing

    def __init__(self, config: DecoderConfig, params: Any, *, pad_token_id: int,
                 eos_token_ids: Sequence[int] = (), mesh: jax.sharding.Mesh | None = None, rules: Any = None,
                 length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
                 batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS, cache_dtype: str | None = None,
                 cast_weights: bool | None = None, cache_as_bits: bool | None = None,
                 unroll_layers: bool | None = None, cpu_kernels: bool | None = None,
                 record_routing: bool = False) -> None:
        if (mesh is None) != (rules is None):
            raise ValueError("JaxGenerationEngine: pass both mesh and rules, or neither")
        if record_routing and (not config.is_moe or unroll_layers):
            raise ValueError("JaxGenerationEngine(record_routing=True) needs a mixture-of-experts model and the "
                             "stacked decode loop (unroll_layers off)")
        self.record_routing = bool(record_routing)  # GenerationOutput.routed_experts (routing replay R3)
        unroll_layers = False if record_routing else unroll_layers
        # Decoding keeps the layer loop whatever model.scan_layers says for training (an unrolled decode is the
        # CPU backend's per-layer form below, not a flattened loop).
        config = dataclasses.replace(config, scan_layers=True)
        self.config = config
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.mesh, self.rules = mesh, (tuple(tuple(r) for r in rules) if rules is not None else None)
        self.length_buckets = tuple(sorted(length_buckets))
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.cache_dtype = cache_dtype or default_cache_dtype(config)
        # XLA:CPU copies each layer's weights and cache slots out of stacked arrays at every decode step: on CPUs
        # a float32 cache's layers are unrolled over per-layer weights and caches (`backends.cpu.layer_unrolled`).
        # A 16-bit cache has no in-place write there (each per-layer write converts the whole cache): bf16 stays
        # scanned over its bit patterns.
        wide = jnp.dtype(self.cache_dtype).itemsize == 4
        self.unroll_layers = _on_cpu(mesh) and wide if unroll_layers is None else bool(unroll_layers)
        as_bits = _on_cpu(mesh) and not self.unroll_layers if cache_as_bits is None else bool(cache_as_bits)
        self._cache_storage = cache_storage_dtype(self.cache_dtype, config, as_bits)
        # float32 keys stored transposed ([head_dim, slots], the operand order XLA:CPU's float32 q·k product
        # reads contiguously); a 16-bit cache's transposed write costs more than it saves
        self.keys_transposed = self.unroll_layers and jnp.dtype(self._cache_storage).itemsize == 4
        # ... and its float32 projections and attention run in kernels of ours (`backends.cpu.ffi`: weights held in
        # panel order) where they build (x86-64, AVX-512, g++), on one device
        self.cpu_kernels = self._cpu_kernels_wanted(cpu_kernels, mesh)
        # The weights in the compute dtype once per set_params (XLA:CPU would convert them in every decode step),
        # for a stacked loop in a form it slices natively (`decode_weights`). A second copy of the weights: on by
        # default where that is host memory.
        self.cast_weights = _on_cpu(mesh) if cast_weights is None else bool(cast_weights)
        cast = compute_dtype_weights if self.unroll_layers else decode_weights
        self._cast = jax.jit(partial(cast, config=config))
        layers, panels = config.num_hidden_layers, self.cpu_kernels
        self._to_program = jax.jit(partial(_program_form, layers=layers, panels=panels))
        self._to_tree = jax.jit(partial(_tree_form, tied=config.tie_word_embeddings, panels=panels))
        self._module = make_module(config, mesh, self.rules)
        self._batch_multiple = 1
        if mesh is not None:
            axes = logical_to_spec(("batch",), self.rules)[0]
            names = (axes,) if isinstance(axes, str) else tuple(axes or ())
            self._batch_multiple = int(np.prod([mesh.shape[a] for a in names])) if names else 1
        def program(*args: Any, **kwargs: Any) -> tuple:  # a per-engine function: a per-engine jit cache
            return _generate_program(*args, **kwargs)

        statics = ("module", "config", "max_new", "top_k", "use_top_p", "greedy", "logprobs_mode", "stop_ids",
                   "pad_id", "cache_dtype", "share", "unrolled", "keys_transposed", "cpu_kernels", "record_routing")
        self._program = jax.jit(program, static_argnames=statics)

        def keyed_program(params: Any, ids: Any, mask: Any, valid: Any, key_data: Any, *args: Any,
                          **kwargs: Any) -> tuple:  # several processes: keys arrive as a global uint32 array
            return _generate_program(params, ids, mask, valid, jax.random.wrap_key_data(key_data), *args, **kwargs)

        self._keyed_program = jax.jit(keyed_program, static_argnames=statics)
        self.multi_process = mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1
        # several processes: this process's (rank, size) row group for every ``generate`` (None: by its batch
        # shards); the actor sets it once (its dp coordinates), so rollout loops call ``generate(prompts, sampling)``
        self.row_group: tuple[int, int] | None = None
        self._params = None
        self.set_params(params)

    def _cpu_kernels_wanted(self, wanted: bool | None, mesh: jax.sharding.Mesh | None) -> bool:
        one_cpu = _on_cpu(mesh) and (mesh is None or mesh.devices.size == 1)
        fits = one_cpu and self.unroll_layers and self.config.dtype == "float32" and not self.config.num_experts
        if wanted is None:
            return fits and ffi.available()
        if wanted and not (fits and ffi.available()):
            raise ValueError("JaxGenerationEngine(cpu_kernels=True) needs the unrolled float32 decode of a dense "
                             f"model on one CPU device (unroll_layers={self.unroll_layers}, dtype "
                             f"{self.config.dtype}, num_experts {self.config.num_experts}) and the "
                             f"kernels built (available: {ffi.available()}; the log says why not)")
        return bool(wanted)

    # ------------------------------------------------------------------------------------------
    def set_params(self, params: Any) -> None:
        """Replace the weights (e.g. after a training step); placed on the mesh when one is set."""
        if self.mesh is not None:
            params = jax.device_put(params, param_shardings(self.config, self.mesh, self.rules))
        params = self._cast(params) if self.cast_weights else params
        self._params = self._to_program(params) if self.unroll_layers else params

    @property
    def params(self) -> Any:
        """The weights as a `CausalLM` tree (per-layer weights held by an unrolled engine are stacked anew, their
        kernels back in row-major order)."""
        return self._to_tree(self._params) if isinstance(self._params, tuple) else self._params

    @params.setter
    def params(self, value: Any) -> None:  # a tree laid out by the caller (a hybrid layout's actor), or None
        self._params = value

    def _program_params(self) -> Any:
        """The weights in the program's form: split per layer when unrolled, in panel order with ``cpu_kernels``
        (a tree assigned to ``params`` is converted at each call)."""
        if self.unroll_layers and not isinstance(self._params, tuple):
            return self._to_program(self._params)
        return self._params

    @property
    def num_compilations(self) -> int:
        """How many distinct programs have been compiled (the jit cache size)."""
        return int(self._program._cache_size()) + int(self._keyed_program._cache_size())

    def _place_batch(self, x: np.ndarray) -> jax.Array:
        if self.mesh is None:
            return jnp.asarray(x)
        spec = logical_to_spec(("batch",) + (None,) * (x.ndim - 1), self.rules)
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, spec))

    def _left_pad(self, prompts: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        return left_pad_prompts(prompts, self.pad_token_id, self.config.vocab_size, self.length_buckets)

    def sleep(self) -> None:
        """Nothing to free: the KV cache lives only inside one ``generate`` call (same interface as vLLM's)."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = SamplingParams(), *,
                 row_group: tuple[int, int] | None = None) -> GenerationOutput:
        """Sample ``sampling.n`` responses per prompt (lists of token ids, unpadded).

        On a mesh spanning several processes ``prompts`` are this process's rows and every process must
        call at once; ``row_group = (rank, size)`` places them in the global batch (default: the engine's
        ``row_group`` attribute, else by the process's batch shards; `jaxrl_hf.rollout.multiprocess`). One
        process: ``row_group`` is ignored."""
        if self.multi_process:
            return self._generate_multiprocess(prompts, sampling, self.row_group if row_group is None else row_group)
        unique_ids, unique_mask = self._left_pad(prompts)
        ids, mask = np.repeat(unique_ids, sampling.n, axis=0), np.repeat(unique_mask, sampling.n, axis=0)
        rows = ids.shape[0]
        if ids.shape[1] + sampling.max_new_tokens > self.config.max_position_embeddings:
            raise ValueError(f"generate: prompt bucket {ids.shape[1]} + max_new_tokens {sampling.max_new_tokens} "
                             f"exceeds max_position_embeddings {self.config.max_position_embeddings}")
        batch = bucket(rows, self.batch_buckets, "batch size (prompts x n)", self._batch_multiple)
        share = self._prefill_share(sampling.n, batch)
        fill_ids, fill_mask = (unique_ids, unique_mask) if share > 1 else (ids, mask)  # one prefill per prompt
        pad_rows = -(-batch // share) - fill_ids.shape[0]
        ids_b = np.concatenate([fill_ids, np.full((pad_rows, ids.shape[1]), self.pad_token_id, np.int32)])
        mask_b = np.concatenate([fill_mask, np.zeros((pad_rows, ids.shape[1]), np.int32)])
        valid = np.arange(batch) < rows
        base = jax.random.key(sampling.seed)
        row_keys = jax.vmap(jax.random.fold_in, (None, 0))(base, jnp.arange(batch))
        stop_ids, temperature = self._stop_ids(sampling), self._temperature(sampling)
        tokens, out_mask, logp, stopped, *routed = self._program(
            self._program_params(), self._place_batch(ids_b), self._place_batch(mask_b), self._place_batch(valid),
            row_keys, jnp.float32(temperature), jnp.float32(sampling.top_p), module=self._module,
            config=self.config, max_new=int(sampling.max_new_tokens), top_k=int(sampling.top_k),
            use_top_p=sampling.top_p < 1.0, greedy=sampling.is_greedy, logprobs_mode=sampling.logprobs_mode,
            stop_ids=stop_ids, pad_id=self.pad_token_id, cache_dtype=self._cache_storage, share=share,
            unrolled=self.unroll_layers, keys_transposed=self.keys_transposed,
            cpu_kernels=self.cpu_kernels, record_routing=self.record_routing)
        tokens, out_mask, logp, stopped, *routed = jax.device_get((tokens, out_mask, logp, stopped, *routed))
        return GenerationOutput(
            prompt_ids=ids, prompt_mask=mask, response_ids=np.asarray(tokens[:rows]),
            response_mask=np.asarray(out_mask[:rows]), log_probs=np.asarray(logp[:rows], np.float32),
            finish_reason=["stop" if s else "length" for s in stopped[:rows]],
            routed_experts=np.asarray(routed[0][:rows]) if routed else None)

    # ------------------------------------------------------------------------------------------
    def _prefill_share(self, n: int, batch: int) -> int:
        """How many rows share one prefill: ``n`` (a prompt's samples), unless the prompt rows would not split
        evenly over the mesh's batch shards (then 1: every row prefilled)."""
        if n <= 1:
            return 1
        return n if (-(-batch // n)) % self._batch_multiple == 0 else 1

    def _stop_ids(self, sampling: SamplingParams) -> tuple[int, ...]:
        return tuple(sorted(set(self.eos_token_ids) | set(sampling.stop_token_ids)))

    @staticmethod
    def _temperature(sampling: SamplingParams) -> float:
        return 1.0 if sampling.is_greedy else float(sampling.temperature)

    def _generate_multiprocess(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams,
                               row_group: tuple[int, int] | None) -> GenerationOutput:
        """One SPMD program over every process's rows; this process's rows back (module docstring)."""
        slabs = mp.process_batch_slabs(self.mesh, self.rules)
        me = jax.process_index()
        try:  # every process learns of any process's bad input before anyone raises (no one left waiting)
            ids, mask = self._left_pad(prompts)
            local = mp.LocalRows.of(prompts, sampling.n, row_group, slabs, me)
            error = None
        except ValueError as err:
            ids = mask = None
            local, error = mp.LocalRows.failed(), err
        plan = mp.agree(local, slabs, me, error)
        width = bucket(plan.max_prompt_len, self.length_buckets, "prompt length")
        if width + sampling.max_new_tokens > self.config.max_position_embeddings:
            raise ValueError(f"generate: prompt bucket {width} + max_new_tokens {sampling.max_new_tokens} "
                             f"exceeds max_position_embeddings {self.config.max_position_embeddings}")
        k = len(slabs[me])
        local_batch = bucket(plan.max_rows, self.batch_buckets, "batch size per row group (prompts x n)", k)
        rows = local.rows
        ids = np.repeat(np.pad(ids, ((0, 0), (width - ids.shape[1], 0)), constant_values=self.pad_token_id),
                        sampling.n, axis=0)
        mask = np.repeat(np.pad(mask, ((0, 0), (width - mask.shape[1], 0))), sampling.n, axis=0)
        pad_rows = local_batch - rows
        ids_b = np.concatenate([ids, np.full((pad_rows, width), self.pad_token_id, np.int32)])
        mask_b = np.concatenate([mask, np.zeros((pad_rows, width), np.int32)])
        valid = np.arange(local_batch) < rows
        # the key of a row is fold_in(seed, its index in the concatenated batch): as with one process
        index = plan.offset + np.arange(local_batch)
        keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(sampling.seed), jnp.asarray(index))
        global_rows = plan.num_groups * local_batch
        place = lambda x: self._place_local(x, global_rows)  # noqa: E731
        out = self._keyed_program(
            self._program_params(), place(ids_b), place(mask_b), place(valid),
            place(np.asarray(jax.random.key_data(keys))),
            np.float32(self._temperature(sampling)), np.float32(sampling.top_p), module=self._module,
            config=self.config, max_new=int(sampling.max_new_tokens), top_k=int(sampling.top_k),
            use_top_p=sampling.top_p < 1.0, greedy=sampling.is_greedy, logprobs_mode=sampling.logprobs_mode,
            stop_ids=self._stop_ids(sampling), pad_id=self.pad_token_id, cache_dtype=self._cache_storage,
            unrolled=self.unroll_layers, keys_transposed=self.keys_transposed,
            cpu_kernels=self.cpu_kernels)
        tokens, out_mask, logp, stopped = (mp.local_rows(x)[:rows] for x in out)
        return GenerationOutput(
            prompt_ids=ids, prompt_mask=mask, response_ids=tokens.astype(np.int32),
            response_mask=out_mask.astype(np.int32), log_probs=logp.astype(np.float32),
            finish_reason=["stop" if s else "length" for s in stopped])

    def _place_local(self, x: np.ndarray, global_rows: int) -> jax.Array:
        """This process's rows of a batch-sharded global array of ``global_rows`` rows."""
        spec = logical_to_spec(("batch",) + (None,) * (x.ndim - 1), self.rules)
        sharding = jax.sharding.NamedSharding(self.mesh, spec)
        return jax.make_array_from_process_local_data(sharding, x, (global_rows,) + x.shape[1:])
