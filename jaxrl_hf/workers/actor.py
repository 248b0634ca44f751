"""`ActorRolloutRefWorker`: the actor (PPO-family updates), its rollout (native JAX engine) and the frozen
reference policy, colocated in one worker (HybridFlow §2.4/§2.5; verl's ``ActorRolloutRefWorker``).

Roles: ``"actor_rollout_ref"`` (all three; the reference is a frozen copy of the initial params),
``"actor_rollout"`` (no reference), ``"ref"`` (only ``compute_ref_log_prob``).

Batch keys (see the issue-8 contract): ``generate_sequences`` reads ``prompts``/``prompt_mask`` and returns
``responses, response_mask, input_ids, attention_mask, position_ids, rollout_log_probs`` (+ the input
columns repeated ``n`` times, interleaved, and ``uid``); ``compute_log_prob`` adds ``old_log_probs`` and
``entropys``; ``compute_ref_log_prob`` adds ``ref_log_prob``; ``update_actor`` reads ``old_log_probs`` (absent
when the update is one optimizer step: π_old = stop_gradient(π_θ)), ``advantages`` (+ ``ref_log_prob`` with a
KL loss, ``rollout_log_probs`` with rollout correction) and returns an empty Batch whose ``meta_info["metrics"]``
holds verl-named floats.

Rollout engine: ``rollout.name`` through `jaxrl_hf.rollout.make_rollout_engine` (``jax``: the native engine;
``vllm``: vLLM in this process, fed the actor's weights in place after every update; its options are the
``rollout`` keys named in ``VllmOptions``). Generation layout (native engine): with ``placement.generate``
(``p_g``, ``t_g``) equal to ``placement.train``'s pp/tp (or unset) the engine runs on the training mesh;
otherwise each rollout reshards the training params to the generation layout with the 3D-HybridEngine
(`jaxrl_hf.workers.generation_layout`), generates on the generation mesh (batch over ``dg``·``dp``) and
slices the training params back, freeing the generation copy. vLLM keeps its own copy of the weights, so with
``rollout.name=vllm`` no JAX generation mesh is built: at TP 1 each weight sync streams the training-layout leaves
(a sharded leaf gathered to one buffer at a time, ``rollout.weight_sync``); with ``placement.generate.tp`` (verl's
``rollout.tensor_model_parallel_size``) > 1 each process hosts one vLLM TP rank and is fed only its shard
(`jaxrl_hf.rollout.vllm_tp`), whatever the training layout.
``actor.offload_optimizer`` keeps the optimizer state in host memory outside ``update_actor``
(`jaxrl_hf.workers.offload`). ``actor.ulysses_sequence_parallel_size > 1`` (Ulysses) adds an ``sp`` axis to the
training mesh: rows over ``dp``, the sequence over ``sp`` (left-padded to a multiple of it), the strategy's
sequence-parallel rule set; rollouts then always go through a generation layout, which spreads rows over every
device and does not split sequences. LoRA (``model.lora_rank``): `jaxrl_hf.workers.lora_policy`. The forward
passes compute each prompt once for its ``rollout.n`` samples where the rows allow it
(``actor.share_prompt_forward``, `jaxrl_hf.workers.shared_prompt`).

Rollout loop: ``generate_sequences`` runs ``rollout.loop`` (`jaxrl_hf.rollout.loops`, default ``single_turn``) on
the engine, inside the reshard above; the loop assembles the output columns.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf import mesh as meshlib
from jaxrl_hf.backends.cpu import pair_matmul
from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.config.validate import rollout_tensor_parallel
from jaxrl_hf.controller import PAD_ROWS_KEY, Batch, Dispatch, Worker, register
from jaxrl_hf.models import param_logical_axes
from jaxrl_hf.models.pretrained import tokenizer_dir
from jaxrl_hf.rollout import ENGINE_NAMES, JaxGenerationEngine, RolloutEngine, SamplingParams, make_rollout_engine
from jaxrl_hf.rollout.loops import RolloutRequest, make_rollout_loop
from jaxrl_hf.workers import checkpoint as ckpt
from jaxrl_hf.workers.actor_programs import LOG_PROB_INPUTS, build_actor_update, log_probs_program
from jaxrl_hf.workers.checkpoint import export_hf_dir, hf_export_options
from jaxrl_hf.workers.common import (LoadedModel, WorkerConfigError, check_sequence_parallel_heads,
                                     lm_param_shardings, load_model, pad_sequences_to,
                                     reference_params, to_global, train_parallel, train_rule_set, worker_run_config)
from jaxrl_hf.workers.generation_layout import GenerationLayout, generation_parallel, jax_generation_placement
from jaxrl_hf.workers.group_packing import pack_micro_stack, token_counts as group_token_counts
from jaxrl_hf.workers.lora_policy import LoraPolicy
from jaxrl_hf.workers.losses import lm_log_prob_fn
from jaxrl_hf.workers.memory_metrics import memory_metrics
from jaxrl_hf.workers.minibatch import MiniBatchPlan, iterate_minibatches, mean_metrics
from jaxrl_hf.workers.offload import OptimizerOffload
from jaxrl_hf.workers.optim import update_schedule_step
from jaxrl_hf.workers.packed_forward import packed_log_prob_fn
from jaxrl_hf.workers.peak_flops import mfu_summary
from jaxrl_hf.workers.protocols import MESH_DP_MERGE
from jaxrl_hf.workers.routing_replay import ROUTED_EXPERTS, check_router_replay
from jaxrl_hf.workers.shared_prompt import SharedPromptForward
from jaxrl_hf.workers.token_batches import MicroBatching, actor_micro_batching, has_response_tokens
from jaxrl_hf.workers.train_step import TrainState, init_train_state

ROLES = ("actor_rollout_ref", "actor_rollout", "ref")


class ActorRolloutRefWorker(Worker):
    """Actor + rollout + reference of one policy, on one ``('pp','tp','dp')`` mesh over the pool's devices
    (plus, when ``placement.generate`` differs from the training pp/tp, a generation mesh over the same devices).

    ``config``: the run's `RunConfig` (reads ``model``, ``actor``, ``rollout``, ``placement``), or a plain
    nested mapping built into one (`worker_run_config`). Call ``init_model()`` once before anything else.
    """

    def __init__(self, config: RunConfig | Mapping[str, Any], role: str = "actor_rollout_ref"):
        if role not in ROLES:
            raise WorkerConfigError(f"ActorRolloutRefWorker role={role!r}; valid: {list(ROLES)}")
        self.config, self.worker_role = worker_run_config(config), role
        self.has_actor, self.has_ref = role != "ref", role in ("actor_rollout_ref", "ref")
        self.train = train_parallel(self.config.placement, sp=self.config.actor.ulysses_sequence_parallel_size)
        self.rule_set = train_rule_set(self.config, "actor", self.train)  # the ref follows the actor
        self.vllm_tp = rollout_tensor_parallel(self.config)  # 1 unless rollout.name=vllm with TP > 1
        self.gen = generation_parallel(jax_generation_placement(self.config.placement, self.config.rollout.name),
                                       self.train, rule_set=self.rule_set)
        offload = self.config.actor.offload_optimizer
        if not isinstance(offload, bool):
            raise WorkerConfigError(f"actor.offload_optimizer={offload!r}: must be true or false")
        self.offload = OptimizerOffload() if offload and self.has_actor else None
        self.mesh = meshlib.build_train_mesh(self.train, meshlib.ordered_devices())
        self.layout: GenerationLayout | None = None
        self.engine_name = self.config.rollout.name
        if self.engine_name not in ENGINE_NAMES:
            raise WorkerConfigError(f"rollout.name={self.engine_name!r}; valid: {list(ENGINE_NAMES)}")
        self.model: LoadedModel | None = None
        self.state: TrainState | None = None
        self.ref_params: Any = None
        self.lora: LoraPolicy | None = None  # set by init_model when model.lora_rank > 0
        self.global_step, self._gen_calls = 0, 0
        self.batching = actor_micro_batching(self.config)  # by rows, by tokens and/or packed, per pass
        loop_name = self.config.rollout.loop
        try:
            self.rollout_loop = make_rollout_loop(loop_name)
        except ValueError as err:
            raise WorkerConfigError(f"rollout.loop={loop_name!r}: {err}") from None

    # ------------------------------------------------------------------------------ setup
    @property
    def dp_processes(self) -> int:
        """Number of data-parallel shards at process granularity (rows are split this many ways)."""
        return self.mesh_coords().dp_size

    @property
    def dp_devices(self) -> int:
        """Size of the ``dp`` mesh axis (micro-batches are split this many ways): ``placement.train.dp / sp``."""
        return int(self.mesh.shape["dp"])

    def _require_model(self, method: str) -> None:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}.{method}: call init_model() first")

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load/initialise the policy, place it on the mesh, build the optimizer, train step, rollout
        engine and (for roles with a reference) the frozen reference copy. Returns a small summary."""
        self.model = load_model(self.config.model)
        config = self.model.config
        check_sequence_parallel_heads(config, self.train, "actor.ulysses_sequence_parallel_size")
        shardings = lm_param_shardings(config, self.model.params, self.mesh, self.gen, self.rule_set)
        if self.gen is not None and self.has_actor and self.engine_name == "jax":
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype), self.model.params)
            self.layout = GenerationLayout.build(self.gen, param_logical_axes(config), shapes,
                                                 meshlib.ordered_devices(), self.rule_set)
            self.layout.check_train_shardings(shardings)
            self.layout.check_process_rows(self.mesh, self.train, self.gen)
        params = jax.device_put(self.model.params, shardings)
        self.model.params = None  # the placed copy is the only one
        train_config = pair_matmul.training_config(config, self.mesh, self.config.model.cpu_backend)  # update, log-probs
        self.log_prob_fn = lm_log_prob_fn(train_config, self.mesh, self.rule_set.activations)
        self.packed_log_prob_fn = packed_log_prob_fn(train_config, self.mesh, self.rule_set.activations)
        self.replay_routing = check_router_replay(self.config.actor.router_replay.mode, config, self.engine_name,
                                                  self.config.rollout.loop, self.dp_processes)
        self.recording_fns = {packed: make(train_config, self.mesh, self.rule_set.activations, record_routing=True)
                              for packed, make in ((False, lm_log_prob_fn), (True, packed_log_prob_fn))} \
            if self.replay_routing == "R2" else {}
        self.shared_prompt = SharedPromptForward(train_config, self.config.actor.share_prompt_forward,
                                                 self.config.rollout.n, self.train.sp, self.mesh,
                                                 self.rule_set.activations, self.config.model.use_remove_padding)
        if self.has_ref:
            self.ref_params = reference_params(params, config.dtype)
        self.lora = LoraPolicy.from_config(self.config.model, config, params, shardings, self.mesh,
                                           self.rule_set.for_transition(self.gen).params) if self.has_actor else None
        mfu = mfu_summary(config, params, self.config.trainer.peak_flops_per_device,
                          -(-self.config.placement.num_processes // (self.config.trainer.nnodes or 1))) if self.has_actor else {}
        if self.lora is not None:  # train only the adapters; the base stays frozen in self.lora
            params, shardings = self.lora.init_adapters(self.config.model.seed), self.lora.adapter_shardings
        if self.has_actor:
            update = self.batching["update"]
            build = functools.partial(build_actor_update, self.config.actor, self.config.rollout.temperature,
                                      param_shapes=params, param_shardings=shardings, mesh=self.mesh,
                                      live_fn=has_response_tokens if update.dynamic else None,
                                      combine=self.lora.combine if self.lora is not None else None,
                                      unrolled_layers=0 if config.scan_layers else config.num_hidden_layers,
                                      cpu_backend=self.config.model.cpu_backend)
            program = build(self._update_forward_fn(update, config))
            self.loss_cfg, self.optim = program.loss_cfg, program.optim
            self._train_steps = {False: program.step}  # keyed by "the prompts are shared" (jitted lazily)
            # a mixture-of-experts update needs its routing, which the shared-prompt forward does not return
            if self.shared_prompt.log_prob_fn is not None and not update.dynamic and not config.is_moe:
                self._train_steps[True] = build(self.shared_prompt.log_prob_fn).step
            self.state = jax.jit(lambda p: init_train_state(p, program.optimizer),
                                 out_shardings=program.state_shardings)(params)
            self.engine = self._build_engine()
            self.rollout_loop.setup(self.config.rollout, self.model.tokenizer)  # e.g. loads the tools
            if self.offload is not None:
                self.state = self.offload.offload(self.state)
        summary = {"role": self.worker_role, "num_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
                   "lora_rank": self.lora.cfg.rank if self.lora is not None else 0,
                   "devices": jax.device_count(), "mesh": dict(self.mesh.shape), **mfu}
        if self.layout is not None:
            summary["generation"] = self.layout.describe()
        return summary

    def policy_params(self) -> Any:
        """The actor's full weights: the train state's params, or base + LoRA adapters merged."""
        return self.state.params if self.lora is None else self.lora.merged(self.state.params)

    def _engine_options(self) -> dict[str, Any] | None:
        """vLLM options: the ``rollout`` keys that ``VllmOptions`` names (`VllmOptions.from_rollout`), and as verl
        sizes it, ``max_model_len`` = the longest prompt + response when unset (single-turn loops; a multi-turn
        loop keeps the model's ``max_position_embeddings``), so the KV cache needs to hold that, not the model's
        whole context."""
        if self.engine_name != "vllm":
            return None
        from jaxrl_hf.rollout.vllm_budget import longest_sequence
        from jaxrl_hf.rollout.vllm_engine import VllmOptions

        options = {**VllmOptions.from_rollout(self.config.rollout), "tensor_parallel_size": self.vllm_tp}
        if "max_model_len" not in options:
            longest = longest_sequence(self.config)
            if longest is not None:
                options["max_model_len"] = min(longest, int(self.model.config.max_position_embeddings))
        return options

    def _tp_group(self) -> Any:
        """vLLM TP > 1: this process's rank of its TP group (``tp`` consecutive pool processes; a collective)."""
        if self.vllm_tp == 1:
            return None
        from jaxrl_hf.rollout.vllm_tp import make_tp_group

        device = jax.local_devices()[0]
        local = int(getattr(device, "local_hardware_id", None) or 0) if device.platform != "cpu" else 0
        try:
            return make_tp_group(self.vllm_tp, local_rank=local)
        except ValueError as err:
            raise WorkerConfigError(f"placement.generate.tp={self.vllm_tp} with rollout.name=vllm: {err}") from None

    def _build_engine(self) -> Any:
        """``rollout.name``'s engine on the generation mesh (the training mesh when the layouts are equal).

        With a hybrid layout the native engine is handed the generation-layout params of each rollout as
        they are (see `_generate`); the placed copy made at construction is dropped at once."""
        mesh, rules = ((self.layout.mesh, self.layout.activation_rules) if self.layout is not None
                       else (self.mesh, self.rule_set.activations))
        try:
            engine = make_rollout_engine(self.engine_name, config=self.model.config, params=self.policy_params(),
                                         pad_token_id=self.model.pad_token_id, eos_token_ids=self.model.eos_token_ids,
                                         mesh=mesh, rules=rules, model_dir=self.model.path,
                                         tokenizer_dir=self.model.path, options=self._engine_options(),
                                         tp_group=self._tp_group(), cpu_backend=self.config.model.cpu_backend,
                                         record_routing=self.replay_routing == "R3")
        except ValueError as err:
            raise WorkerConfigError(f"rollout.name={self.engine_name!r}: {err}") from err
        if getattr(engine, "multi_process", False):  # native engine over several processes: rows by dp rank
            coords = self.mesh_coords()
            engine.row_group = (coords.dp_rank, coords.dp_size)
        if self.layout is not None:
            if not isinstance(engine, JaxGenerationEngine):  # pragma: no cover - guarded by __init__
                raise WorkerConfigError(f"rollout.name={self.engine_name!r} has no JAX generation layout")
            engine.params = None
        return engine

    @contextlib.contextmanager
    def _engine_for_rollout(self) -> Iterator[RolloutEngine]:
        """The engine, serving the current params for one rollout loop, put to sleep afterwards; with a hybrid
        layout, inside a training -> generation -> training reshard.

        The reshard consumes the training params (every device's generation shard contains its training
        shard) and `GenerationLayout.to_training` slices them back bit-identically and frees the generation
        copy, also when generation fails, so the actor's state is never left without params."""
        if self.layout is None:
            if self.engine.weights_discarded:  # vLLM slept at level 2 since the last sync (no update in between)
                self.engine.set_params(self.policy_params())
            try:
                yield self.engine
            finally:
                self.engine.sleep()
            return
        gen_params = self.layout.to_generation(self.policy_params())
        try:
            # already laid out on the engine's mesh: used as they are (set_params would re-place a copy)
            self.engine.params = gen_params
            yield self.engine
        finally:
            self.engine.params = None
            self.engine.sleep()
            back = self.layout.to_training(gen_params)  # with LoRA: the merged copy, dropped
            self.state = self.state._replace(params=back) if self.lora is None else self.state

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def set_step(self, step: int) -> None:
        """Set the global training step; generation seeds and mini-batch shuffles derive from it."""
        self.global_step, self._gen_calls = int(step), 0

    # ------------------------------------------------------------------------------ rollout
    def _sampling(self, meta: Mapping[str, Any]) -> SamplingParams:
        rollout = self.config.rollout
        val = rollout.val if meta.get("validate") else None

        def pick(key: str) -> Any:  # meta_info, else rollout.val's key (validation), else rollout's
            return meta.get(key, getattr(val, key) if hasattr(val, key) else getattr(rollout, key))

        greedy = bool(meta.get("greedy", val is not None and val.greedy))
        seed = meta.get("seed")
        # The native engine runs one SPMD batch over all processes and keys each row by its global index, so
        # its seed is the same on every process (dp rank 0's: what one process uses). vLLM runs one engine per
        # process over its own rows (keyed by local index), so there the dp rank goes into the seed.
        # vLLM with TP > 1 runs one engine per TP group over its processes' rows: the group index goes into the seed.
        coords = self.mesh_coords()
        rank = 0 if self.engine_name == "jax" else (coords.dp_rank if self.vllm_tp == 1 else self.rank // self.vllm_tp)
        if seed is None:
            words = [rollout.seed, self.global_step, self._gen_calls, rank,
                     int(bool(meta.get("validate")))]
            seed = int(np.random.SeedSequence(words).generate_state(1)[0])
        elif self.engine_name != "jax" and coords.dp_size > self.vllm_tp:
            seed = int(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, rank]).generate_state(1)[0])
        try:
            return SamplingParams(temperature=float(pick("temperature")), top_p=float(pick("top_p")),
                                  top_k=max(int(pick("top_k") or 0), 0), n=int(pick("n")),
                                  max_new_tokens=int(meta.get("response_length", rollout.response_length)),
                                  greedy=greedy, seed=seed)
        except ValueError as err:
            raise WorkerConfigError(f"rollout sampling: {err}") from None

    @register(dispatch=MESH_DP_MERGE)
    def generate_sequences(self, batch: Batch) -> Batch:
        """Sample ``n`` responses per prompt: the ``rollout.loop`` on the engine (meta_info may override ``n``,
        ``temperature``, ``top_p``, ``top_k``, ``greedy``, ``seed``, ``response_length``;
        ``validate=True`` uses ``rollout.val``). Samples of a prompt are adjacent.

        Several processes: every process generates its own dp shard in lockstep — the native engine as one
        SPMD program over all of them (`jaxrl_hf.rollout.multiprocess`; a row's sample is the one a single
        process would draw for the concatenated batch), vLLM as one engine per process on its own rows."""
        self._require_model("generate_sequences")
        if not self.has_actor:
            raise RuntimeError("role 'ref' has no rollout; use role 'actor_rollout[_ref]'")
        for key in ("prompts", "prompt_mask"):
            if key not in batch:
                raise KeyError(f"generate_sequences: Batch has no {key!r}; columns: {batch.keys()}")
        sampling = self._sampling(batch.meta_info)
        self._gen_calls += 1
        first_uid = self.mesh_coords().dp_rank * len(batch)  # uid of this shard's first prompt (if none is given)
        request = RolloutRequest(batch.arrays, batch.objects, sampling, first_uid=first_uid)
        start = time.perf_counter()
        with self._engine_for_rollout() as engine:
            result = self.rollout_loop.run(engine, request)
        elapsed = time.perf_counter() - start
        meta = {k: v for k, v in batch.meta_info.items() if k != PAD_ROWS_KEY}
        meta.update(result.meta_info)
        meta.update(gen_timing_s=elapsed, num_generated_tokens=int(result.arrays["response_mask"].sum()),
                    eos_token_ids=[int(i) for i in self.engine.eos_token_ids])
        return Batch(result.arrays, result.objects, meta)

    # ------------------------------------------------------------------------------ log-probs
    def _forward_fn(self, batching: MicroBatching) -> Any:
        return self.packed_log_prob_fn if batching.remove_padding else self.log_prob_fn

    def _update_forward_fn(self, batching: MicroBatching, config: Any) -> Any:
        """The update pass's forward: `_forward_fn`'s, and for a mixture-of-experts policy the same with its routing
        (the router losses and ``actor/moe/*`` metrics of `jaxrl_hf.workers.losses.actor_loss`)."""
        if not config.is_moe:
            return self._forward_fn(batching)
        make = packed_log_prob_fn if batching.remove_padding else lm_log_prob_fn
        return make(pair_matmul.training_config(config, self.mesh, self.config.model.cpu_backend), self.mesh,
                    self.rule_set.activations, with_routing=True)

    def _log_probs(self, params: Any, batch: Batch, temperature: float, batching: MicroBatching,
                   record_routing: bool = False, replay_routing: bool = False) -> tuple[np.ndarray, ...]:
        """``(log_prob, entropy)`` ``[B, R]`` (0 outside ``response_mask``); ``record_routing``: ``+ (routed
        experts [B, P+R, layers, k],)``; ``replay_routing``: routed by the batch's ``routed_experts``
        (`jaxrl_hf.workers.routing_replay`)."""
        for key in LOG_PROB_INPUTS:
            if key not in batch:
                raise KeyError(f"log-prob computation: Batch has no {key!r}; columns: {batch.keys()}")
        replayed = (ROUTED_EXPERTS,) if replay_routing else ()
        if replayed and ROUTED_EXPERTS not in batch:
            raise KeyError(f"log-prob computation: actor.router_replay.mode=R3 replays the rollout's routing, but the "
                           f"Batch has no {ROUTED_EXPERTS!r} (the rollout engine records it); columns: {batch.keys()}")
        arrays = pad_sequences_to({k: batch[k] for k in (*LOG_PROB_INPUTS, "response_mask", *replayed) if k in batch},
                                  self.train.sp)
        shared = (not batching.dynamic and not record_routing and not replayed
                  and self.shared_prompt.applies(arrays, batching.rows_per_device))
        fn = self.recording_fns[batching.remove_padding] if record_routing else self._forward_fn(batching)
        program = functools.partial(log_probs_program, log_prob_fn=self.shared_prompt.log_prob_fn if shared else fn)
        run = functools.partial(self.shared_prompt.apply, rows_per_device=batching.rows_per_device) if shared \
            else batching.apply
        logp, ent, *routed = run(program, params, arrays, self.mesh, self.dp_processes, jnp.float32(temperature))
        if "response_mask" in batch:
            valid = np.asarray(batch["response_mask"]) != 0
            logp, ent = logp * valid, ent * valid
        width = np.shape(batch["input_ids"])[1]  # the recorded columns without the sequence-parallel padding
        return (logp.astype(np.float32), ent.astype(np.float32), *(r[:, -width:].astype(np.int32) for r in routed))

    def _temperature(self, meta: Mapping[str, Any]) -> float:
        return float(meta.get("temperature", self.config.rollout.temperature))

    @register(dispatch=Dispatch.MESH_DP)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """``old_log_probs`` and ``entropys`` ``[B, R]`` of the current actor (log-softmax(logits / T),
        T = rollout temperature), 0 outside ``response_mask``; with ``actor.router_replay.mode=R2`` also the
        ``routed_experts`` of that pass (`jaxrl_hf.workers.routing_replay`)."""
        self._require_model("compute_log_prob")
        if not self.has_actor:
            raise RuntimeError("role 'ref' has no actor; call compute_ref_log_prob")
        logp, ent, *routed = self._log_probs(self.policy_params(), batch, self._temperature(batch.meta_info),
                                             self.batching["log_prob"], record_routing=self.replay_routing == "R2",
                                             replay_routing=self.replay_routing == "R3")
        return Batch.from_dict({"old_log_probs": logp, "entropys": ent, **dict(zip((ROUTED_EXPERTS,), routed))})

    @register(dispatch=Dispatch.MESH_DP)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob`` ``[B, R]`` under the frozen initial policy (same temperature convention)."""
        self._require_model("compute_ref_log_prob")
        if not self.has_ref:
            raise RuntimeError(f"role {self.worker_role!r} holds no reference policy; use 'actor_rollout_ref' or 'ref'")
        logp, _ = self._log_probs(self.ref_params, batch, self._temperature(batch.meta_info), self.batching["ref"])
        return Batch.from_dict({"ref_log_prob": logp})

    # ------------------------------------------------------------------------------ update
    def minibatch_plan(self, rows: int) -> MiniBatchPlan:
        """How this rank's ``rows`` split into mini-batches (optimizer steps) and micro-batches."""
        actor = self.config.actor
        return self.batching["update"].minibatch_plan(
            rows, mini_batch_prompts=actor.ppo_mini_batch_size, samples_per_prompt=self.config.rollout.n,
            dp_devices=self.dp_devices, dp_processes=self.dp_processes, epochs=actor.ppo_epochs,
            shuffle=actor.shuffle, where="actor")

    @register(dispatch=MESH_DP_MERGE)  # per-process wall-clock metrics (timing_s/weight_sync) differ: rank 0's
    def update_actor(self, batch: Batch) -> Batch:
        """``ppo_epochs`` × mini-batches optimizer steps, each accumulating micro-batch gradients with the
        exact mini-batch denominator. Padding rows added by the dispatch get a zero ``response_mask``.
        Returns an empty Batch with ``meta_info["metrics"]`` (``actor/pg_loss``, ``actor/pg_clipfrac``,
        ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``, ``actor/entropy``, ``actor/grad_norm``, ``actor/lr``,
        ``actor/kl_loss`` and ``actor/kl_coef`` with a KL loss, ``actor/num_updates``, ``timing_s/update_weights``)."""
        self._require_model("update_actor")
        if not self.has_actor:
            raise RuntimeError("role 'ref' cannot update_actor")
        plan = self.minibatch_plan(len(batch))
        one_step = plan.num_minibatches * plan.epochs == 1 and self.loss_cfg.rollout_correction_level is None
        missing = [k for k in self.loss_cfg.required_keys()  # one step: π_old = stop_gradient(π_θ) in the loss
                   if k not in batch and not (one_step and k == "old_log_probs")]
        if missing:
            raise KeyError(f"update_actor: Batch lacks {missing} (needed by this actor config, {plan.num_minibatches} "
                           f"mini-batch(es) x {plan.epochs} epoch(s)); columns: {batch.keys()}")
        if ROUTED_EXPERTS not in batch and (self.replay_routing == "R3" or self.replay_routing and not one_step):
            source = "the rollout engine" if self.replay_routing == "R3" else "actor.compute_log_prob"
            raise KeyError(f"update_actor: actor.router_replay.mode={self.replay_routing} replays recorded routing, "
                           f"but the Batch has no {ROUTED_EXPERTS!r} ({source} records it); columns: {batch.keys()}")
        replayed = (ROUTED_EXPERTS,) if self.replay_routing and ROUTED_EXPERTS in batch else ()
        arrays = {k: np.asarray(batch[k]) for k in (*self.loss_cfg.required_keys(), *replayed) if k in batch}
        pad = int(batch.meta_info.get(PAD_ROWS_KEY, 0))
        if pad:
            arrays["response_mask"] = arrays["response_mask"].copy()
            arrays["response_mask"][len(batch) - pad:] = 0
        arrays = pad_sequences_to(arrays, self.train.sp)
        if self.offload is not None:
            self.state = self.offload.restore(self.state)
        seed = [self.config.rollout.seed, self.global_step, self.mesh_coords().dp_rank]
        lr_step = np.int32(update_schedule_step(batch.meta_info, self.global_step))  # one lr for the whole call
        collected = []
        update = self.batching["update"]
        shared = (True in self._train_steps and not plan.shuffle
                  and self.shared_prompt.applies(arrays, plan.micro_rows // (self.dp_devices // self.dp_processes)))
        packed = shared and self.shared_prompt.packs(arrays)
        for micro in iterate_minibatches(arrays, plan, seed):
            if packed:  # one packed row per group (group_packing)
                devices = self.dp_devices // self.dp_processes
                micro = pack_micro_stack(micro, np.shape(arrays["responses"])[1], self.shared_prompt.group,
                                         self.shared_prompt.groups_per_row(np.shape(micro["attention_mask"])[1], devices))
                update.count_tokens(*group_token_counts(micro))
            elif not shared:
                micro = update.update_micro_batches(micro, self.dp_devices // self.dp_processes)  # by tokens/packed
            placed = {k: to_global(v, self.mesh, self.dp_processes, micro_axis=True) for k, v in micro.items()}
            self.state, metrics = self._train_steps[shared](self.state, placed, lr_step,
                                                            *(() if self.lora is None else (self.lora.base,)))
            collected.append(metrics)
        metrics = {**mean_metrics(collected, prefix="actor/", last=("lr",)), **update.padding_metrics("actor/"),
                   "actor/shared_prompt_forward": float(shared), "actor/packed_group_rows": float(packed)}
        metrics.update(memory_metrics("actor/"))
        if self.loss_cfg.use_kl_loss:  # verl logs the KL loss's coefficient beside it
            metrics["actor/kl_coef"] = float(self.loss_cfg.kl_loss_coef)
        if self.layout is None:
            start = time.perf_counter()
            self.engine.set_params(self.policy_params())  # vLLM: the in-place weight sync
            # verl's name for the rollout engine's weight update, and ours (kept as an alias)
            metrics["timing_s/update_weights"] = metrics["timing_s/weight_sync"] = time.perf_counter() - start
            if self.engine_name == "vllm":  # perf/weight_sync_{path,bytes,...}, bytes freed/regained by sleep/wake
                metrics.update(self.engine.sync_metrics())
        if self.offload is not None:
            self.state = self.offload.offload(self.state)
            metrics["actor/offloaded_optimizer_bytes"] = float(self.offload.freed_bytes)
        return Batch.from_dict({}, meta_info={"metrics": metrics})

    # ------------------------------------------------------------------------------ persistence
    def _checkpoint_tree(self) -> dict[str, Any]:
        return {"train_state": self.state} if self.has_actor else {"ref_params": self.ref_params}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> str:
        """Atomically write params, optimizer state, update count and the RNG/step counters to ``path``."""
        self._require_model("save_checkpoint")
        meta = {"role": self.worker_role, "global_step": self.global_step, "gen_calls": self._gen_calls,
                "rollout_seed": self.config.rollout.seed, "model_config": self.model.config.to_hf_dict(),
                "model_path": self.model.path}
        with self._optimizer_on_device():
            return ckpt.save_state(path, self._checkpoint_tree(), meta)

    @contextlib.contextmanager
    def _optimizer_on_device(self) -> Iterator[None]:
        """Bring an offloaded optimizer state back for the block (checkpoint I/O), then offload it again."""
        if self.offload is None:
            yield
            return
        self.state = self.offload.restore(self.state)
        try:
            yield
        finally:
            self.state = self.offload.offload(self.state)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        """Restore a checkpoint written by ``save_checkpoint`` onto the current mesh; returns its global step."""
        self._require_model("load_checkpoint")
        with self._optimizer_on_device():
            tree, meta = ckpt.restore_state(path, self._checkpoint_tree())
            if meta.get("role") != self.worker_role:
                raise ValueError(f"checkpoint {path} was written by role {meta.get('role')!r}, this worker is "
                                 f"{self.worker_role!r}")
            if self.has_actor:
                self.state = TrainState(*tree["train_state"])
        if self.has_actor:
            if self.layout is None:
                self.engine.set_params(self.policy_params())
        else:
            self.ref_params = tree["ref_params"]
        self.global_step, self._gen_calls = int(meta["global_step"]), int(meta["gen_calls"])
        return self.global_step

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> str:
        """The actor's current weights as an HF model directory (`export_hf_dir`, ``trainer.export_hf_*``)."""
        self._require_model("export_hf")
        params = self.policy_params() if self.has_actor else self.ref_params
        adapters = None
        if self.lora is not None:  # merged weights, and the adapters alone (PEFT format) beside them
            adapters = lambda out: self.lora.save_adapter(out, self.state.params, self.model.path)  # noqa: E731
        tokenizer = self.model.path or tokenizer_dir(self.config.model.path)  # tiny-random: SmolLM2's tokenizer
        return export_hf_dir(path, params, self.model.config, tokenizer, adapters, **hf_export_options(self.config))
