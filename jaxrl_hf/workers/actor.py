"""`ActorRolloutRefWorker`: the actor (PPO-family updates), its rollout (native JAX engine) and the frozen
reference policy, colocated in one worker (HybridFlow §2.4/§2.5; verl's ``ActorRolloutRefWorker``).

Roles: ``"actor_rollout_ref"`` (all three; the reference is a frozen copy of the initial params),
``"actor_rollout"`` (no reference), ``"ref"`` (only ``compute_ref_log_prob``).

Batch keys (see the issue-8 contract): ``generate_sequences`` reads ``prompts``/``prompt_mask`` and returns
``responses, response_mask, input_ids, attention_mask, position_ids, rollout_log_probs`` (+ the input
columns repeated ``n`` times, interleaved, and ``uid``); ``compute_log_prob`` adds ``old_log_probs`` and
``entropys``; ``compute_ref_log_prob`` adds ``ref_log_prob``; ``update_actor`` reads ``old_log_probs``,
``advantages`` (+ ``ref_log_prob`` with a KL loss, ``rollout_log_probs`` with rollout correction) and
returns an empty Batch whose ``meta_info["metrics"]`` holds verl-named floats.
"""

from __future__ import annotations

import functools
import os
import shutil
import time
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

import mesh as meshlib
from jaxrl_hf.controller import PAD_ROWS_KEY, Batch, Dispatch, Worker, register
from jaxrl_hf.models import save_hf_dir
from jaxrl_hf.rollout import JaxGenerationEngine, SamplingParams
from jaxrl_hf.workers import checkpoint as ckpt
from jaxrl_hf.workers.common import (LoadedModel, WorkerConfigError, chunked_apply, copy_tokenizer_files, get,
                                     lm_param_shardings, load_model, to_global, train_parallel)
from jaxrl_hf.workers.losses import (ACTOR_SUMMED_METRICS, ActorLossConfig, actor_loss, lm_log_prob_fn,
                                     response_denominator)
from jaxrl_hf.workers.minibatch import MiniBatchPlan, iterate_minibatches, mean_metrics
from jaxrl_hf.workers.optim import OptimConfig, make_optimizer
from jaxrl_hf.workers.protocols import MESH_DP_MERGE
from jaxrl_hf.workers.train_step import TrainState, init_train_state, make_train_step, train_state_shardings

ROLES = ("actor_rollout_ref", "actor_rollout", "ref")
LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def actor_loss_config(config: Mapping[str, Any]) -> ActorLossConfig:
    """`ActorLossConfig` from the ``actor`` and ``rollout`` sections (keys named as in verl)."""
    actor = get(config, "actor")
    correction = get(actor, "rollout_correction", {}) or {}
    try:
        return ActorLossConfig(
            loss_mode=get(actor, "policy_loss.loss_mode", "vanilla"),
            loss_agg_mode=get(actor, "loss_agg_mode", "token-mean"),
            clip_ratio=float(get(actor, "clip_ratio", 0.2)),
            clip_ratio_low=get(actor, "clip_ratio_low", None), clip_ratio_high=get(actor, "clip_ratio_high", None),
            clip_ratio_c=float(get(actor, "clip_ratio_c", 3.0)), entropy_coeff=float(get(actor, "entropy_coeff", 0.0)),
            use_kl_loss=bool(get(actor, "use_kl_loss", False)), kl_loss_coef=float(get(actor, "kl_loss_coef", 0.001)),
            kl_loss_type=get(actor, "kl_loss_type", "low_var_kl"),
            temperature=float(get(config, "rollout.temperature", 1.0)),
            rollout_correction_level=correction.get("level"),
            rollout_correction_threshold=float(correction.get("threshold", 2.0)))
    except ValueError as err:
        raise WorkerConfigError(f"actor config: {err}") from None


@functools.partial(jax.jit, static_argnames=("log_prob_fn",))
def _log_probs_program(params: Any, micro: Mapping[str, jax.Array], temperature: jax.Array, *,
                       log_prob_fn: Any) -> tuple[jax.Array, jax.Array]:
    return log_prob_fn(params, micro, temperature)


class ActorRolloutRefWorker(Worker):
    """Actor + rollout + reference of one policy, on one ``('pp','tp','dp')`` mesh over the pool's devices.

    ``config``: the validated nested dict (``model``, ``actor``, ``rollout``, ``placement``, ...).
    Call ``init_model()`` once before anything else.
    """

    def __init__(self, config: Mapping[str, Any], role: str = "actor_rollout_ref"):
        if role not in ROLES:
            raise WorkerConfigError(f"ActorRolloutRefWorker role={role!r}; valid: {list(ROLES)}")
        self.config, self.worker_role = config, role
        self.has_actor, self.has_ref = role != "ref", role in ("actor_rollout_ref", "ref")
        self.train = train_parallel(get(config, "placement", {}))
        generate = get(config, "placement.generate", {}) or {}
        if (int(generate.get("pp", self.train.pp)), int(generate.get("tp", self.train.tp))) != (self.train.pp, self.train.tp):
            raise WorkerConfigError(
                f"placement.generate={dict(generate)} differs from placement.train pp/tp ({self.train.pp}, "
                f"{self.train.tp}): the hybrid-engine generation layout is not wired into the actor yet; "
                "set placement.generate.pp/tp equal to placement.train")
        self.mesh = meshlib.build_train_mesh(self.train, meshlib.ordered_devices())
        self.model: LoadedModel | None = None
        self.state: TrainState | None = None
        self.ref_params: Any = None
        self.global_step, self._gen_calls = 0, 0

    # ------------------------------------------------------------------------------ setup
    @property
    def dp_processes(self) -> int:
        """Number of data-parallel shards at process granularity (rows are split this many ways)."""
        return self.mesh_coords().dp_size

    @property
    def dp_devices(self) -> int:
        """Size of the ``dp`` mesh axis (micro-batches are split this many ways)."""
        return int(self.mesh.shape["dp"])

    def _require_model(self, method: str) -> None:
        if self.model is None:
            raise RuntimeError(f"{type(self).__name__}.{method}: call init_model() first")

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load/initialise the policy, place it on the mesh, build the optimizer, train step, rollout
        engine and (for roles with a reference) the frozen reference copy. Returns a small summary."""
        self.model = load_model(get(self.config, "model"))
        config = self.model.config
        shardings = lm_param_shardings(config, self.model.params, self.mesh)
        params = jax.device_put(self.model.params, shardings)
        self.model.params = None  # the placed copy is the only one
        self.log_prob_fn = lm_log_prob_fn(config, self.mesh, meshlib.train_activation_rules())
        if self.has_ref:
            self.ref_params = jax.tree.map(jnp.copy, params) if self.has_actor else params
        if self.has_actor:
            self.loss_cfg = actor_loss_config(self.config)
            actor = get(self.config, "actor")
            self.optim = OptimConfig.from_dict(get(actor, "optim", {}), grad_clip=get(actor, "grad_clip", 1.0),
                                               where="actor.optim")
            optimizer = make_optimizer(self.optim)
            state_shardings = train_state_shardings(params, shardings, optimizer, self.mesh)
            self.state = jax.jit(lambda p: init_train_state(p, optimizer), out_shardings=state_shardings)(params)
            loss_fn = functools.partial(actor_loss, log_prob_fn=self.log_prob_fn, cfg=self.loss_cfg)
            self._train_step = make_train_step(loss_fn, self.optim, optimizer=optimizer,
                                               denominator_fn=response_denominator(self.loss_cfg.loss_agg_mode),
                                               summed_aux=ACTOR_SUMMED_METRICS, state_shardings=state_shardings)
            self.engine = JaxGenerationEngine(config, self.state.params, pad_token_id=self.model.pad_token_id,
                                              eos_token_ids=self.model.eos_token_ids, mesh=self.mesh,
                                              rules=meshlib.train_activation_rules())
        return {"role": self.worker_role, "num_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))),
                "devices": jax.device_count(), "mesh": dict(self.mesh.shape)}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def set_step(self, step: int) -> None:
        """Set the global training step; generation seeds and mini-batch shuffles derive from it."""
        self.global_step, self._gen_calls = int(step), 0

    # ------------------------------------------------------------------------------ rollout
    def _sampling(self, meta: Mapping[str, Any]) -> SamplingParams:
        rollout = get(self.config, "rollout")
        base = dict(rollout.get("val", {}) or {}) if meta.get("validate") else {}
        pick = lambda key, default: meta.get(key, base.get(key, rollout.get(key, default)))  # noqa: E731
        greedy = bool(pick("greedy", False))
        seed = meta.get("seed")
        if seed is None:
            words = [int(rollout.get("seed", 0)), self.global_step, self._gen_calls,
                     self.mesh_coords().dp_rank, int(bool(meta.get("validate")))]
            seed = int(np.random.SeedSequence(words).generate_state(1)[0])
        try:
            return SamplingParams(temperature=float(pick("temperature", 1.0)), top_p=float(pick("top_p", 1.0)),
                                  top_k=max(int(pick("top_k", 0) or 0), 0), n=int(pick("n", 1)),
                                  max_new_tokens=int(meta.get("response_length", rollout.get("response_length", 64))),
                                  greedy=greedy, seed=seed)
        except ValueError as err:
            raise WorkerConfigError(f"rollout sampling: {err}") from None

    @register(dispatch=MESH_DP_MERGE)
    def generate_sequences(self, batch: Batch) -> Batch:
        """Sample ``n`` responses per prompt with the native engine (meta_info may override ``n``,
        ``temperature``, ``top_p``, ``top_k``, ``greedy``, ``seed``, ``response_length``;
        ``validate=True`` uses ``rollout.val``). Samples of a prompt are adjacent."""
        self._require_model("generate_sequences")
        if not self.has_actor:
            raise RuntimeError("role 'ref' has no rollout; use role 'actor_rollout[_ref]'")
        if jax.process_count() > 1:
            raise NotImplementedError("generate_sequences with several processes per worker group is not "
                                      "supported by the native engine yet; use 1 process with several devices")
        for key in ("prompts", "prompt_mask"):
            if key not in batch:
                raise KeyError(f"generate_sequences: Batch has no {key!r}; columns: {batch.keys()}")
        sampling = self._sampling(batch.meta_info)
        self._gen_calls += 1
        prompts, prompt_mask = np.asarray(batch["prompts"]), np.asarray(batch["prompt_mask"])
        lists = [row[m.astype(bool)].tolist() for row, m in zip(prompts, prompt_mask)]
        start = time.perf_counter()
        out = self.engine.generate(lists, sampling)
        elapsed = time.perf_counter() - start
        n = sampling.n
        expanded = batch.repeat(n, interleave=True)
        if "uid" not in batch:
            uid = self.mesh_coords().dp_rank * len(batch) + np.arange(len(batch))
            expanded = expanded.union(Batch.from_dict({"uid": np.repeat(uid, n).astype(object)}))
        responses = out.response_ids.astype(np.int32)
        response_mask = out.response_mask.astype(np.int32)
        attention_mask = np.concatenate([np.repeat(prompt_mask, n, axis=0).astype(np.int32), response_mask], axis=1)
        generated = Batch.from_dict({
            "responses": responses, "response_mask": response_mask,
            "input_ids": np.concatenate([np.repeat(prompts, n, axis=0).astype(np.int32), responses], axis=1),
            "attention_mask": attention_mask,
            "position_ids": np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0).astype(np.int32),
            "rollout_log_probs": out.log_probs.astype(np.float32),
        })
        meta = {k: v for k, v in batch.meta_info.items() if k != PAD_ROWS_KEY}
        meta.update(gen_timing_s=elapsed, num_generated_tokens=int(response_mask.sum()))
        merged = expanded.union(generated)
        return Batch(merged.arrays, merged.objects, meta)

    # ------------------------------------------------------------------------------ log-probs
    def _log_probs(self, params: Any, batch: Batch, temperature: float) -> tuple[np.ndarray, np.ndarray]:
        for key in LOG_PROB_INPUTS:
            if key not in batch:
                raise KeyError(f"log-prob computation: Batch has no {key!r}; columns: {batch.keys()}")
        per_device = int(get(self.config, "actor.log_prob_micro_batch_size_per_device",
                             get(self.config, "actor.ppo_micro_batch_size_per_device", 4)))
        chunk = per_device * self.dp_devices // self.dp_processes
        program = functools.partial(_log_probs_program, log_prob_fn=self.log_prob_fn)
        logp, ent = chunked_apply(program, params, {k: batch[k] for k in LOG_PROB_INPUTS}, chunk, self.mesh,
                                  self.dp_processes, jnp.float32(temperature))
        if "response_mask" in batch:
            valid = np.asarray(batch["response_mask"]) != 0
            logp, ent = logp * valid, ent * valid
        return logp.astype(np.float32), ent.astype(np.float32)

    def _temperature(self, meta: Mapping[str, Any]) -> float:
        return float(meta.get("temperature", get(self.config, "rollout.temperature", 1.0)))

    @register(dispatch=Dispatch.MESH_DP)
    def compute_log_prob(self, batch: Batch) -> Batch:
        """``old_log_probs`` and ``entropys`` ``[B, R]`` of the current actor (log-softmax(logits / T),
        T = rollout temperature), 0 outside ``response_mask``."""
        self._require_model("compute_log_prob")
        if not self.has_actor:
            raise RuntimeError("role 'ref' has no actor; call compute_ref_log_prob")
        logp, ent = self._log_probs(self.state.params, batch, self._temperature(batch.meta_info))
        return Batch.from_dict({"old_log_probs": logp, "entropys": ent})

    @register(dispatch=Dispatch.MESH_DP)
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """``ref_log_prob`` ``[B, R]`` under the frozen initial policy (same temperature convention)."""
        self._require_model("compute_ref_log_prob")
        if not self.has_ref:
            raise RuntimeError(f"role {self.worker_role!r} holds no reference policy; use 'actor_rollout_ref' or 'ref'")
        logp, _ = self._log_probs(self.ref_params, batch, self._temperature(batch.meta_info))
        return Batch.from_dict({"ref_log_prob": logp})

    # ------------------------------------------------------------------------------ update
    def minibatch_plan(self, rows: int) -> MiniBatchPlan:
        """How this rank's ``rows`` split into mini-batches (optimizer steps) and micro-batches."""
        actor = get(self.config, "actor")
        n = int(get(self.config, "rollout.n", 1))
        return MiniBatchPlan.build(rows, mini_batch_prompts=int(get(actor, "ppo_mini_batch_size")), samples_per_prompt=n,
                                   micro_per_device=int(get(actor, "ppo_micro_batch_size_per_device")),
                                   dp_devices=self.dp_devices, dp_processes=self.dp_processes,
                                   epochs=int(get(actor, "ppo_epochs", 1)), shuffle=bool(get(actor, "shuffle", False)),
                                   where="actor")

    @register(dispatch=Dispatch.MESH_DP)
    def update_actor(self, batch: Batch) -> Batch:
        """``ppo_epochs`` × mini-batches optimizer steps, each accumulating micro-batch gradients with the
        exact mini-batch denominator. Padding rows added by the dispatch get a zero ``response_mask``.
        Returns an empty Batch with ``meta_info["metrics"]`` (``actor/pg_loss``, ``actor/pg_clipfrac``,
        ``actor/pg_clipfrac_lower``, ``actor/ppo_kl``, ``actor/entropy``, ``actor/grad_norm``, ``actor/lr``,
        ``actor/kl_loss`` with a KL loss, ``actor/num_updates``)."""
        self._require_model("update_actor")
        if not self.has_actor:
            raise RuntimeError("role 'ref' cannot update_actor")
        missing = [k for k in self.loss_cfg.required_keys() if k not in batch]
        if missing:
            raise KeyError(f"update_actor: Batch lacks {missing} (needed by this actor config); columns: {batch.keys()}")
        arrays = {k: np.asarray(batch[k]) for k in self.loss_cfg.required_keys()}
        pad = int(batch.meta_info.get(PAD_ROWS_KEY, 0))
        if pad:
            arrays["response_mask"] = arrays["response_mask"].copy()
            arrays["response_mask"][len(batch) - pad:] = 0
        plan = self.minibatch_plan(len(batch))
        seed = [int(get(self.config, "rollout.seed", 0)), self.global_step, self.mesh_coords().dp_rank]
        collected = []
        for micro in iterate_minibatches(arrays, plan, seed):
            placed = {k: to_global(v, self.mesh, self.dp_processes, micro_axis=True) for k, v in micro.items()}
            self.state, metrics = self._train_step(self.state, placed)
            collected.append(metrics)
        self.engine.set_params(self.state.params)
        metrics = mean_metrics(collected, prefix="actor/", last=("lr",))
        return Batch.from_dict({}, meta_info={"metrics": metrics})

    # ------------------------------------------------------------------------------ persistence
    def _checkpoint_tree(self) -> dict[str, Any]:
        return {"train_state": self.state} if self.has_actor else {"ref_params": self.ref_params}

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> str:
        """Atomically write params, optimizer state, update count and the RNG/step counters to ``path``."""
        self._require_model("save_checkpoint")
        meta = {"role": self.worker_role, "global_step": self.global_step, "gen_calls": self._gen_calls,
                "rollout_seed": int(get(self.config, "rollout.seed", 0)), "model_config": self.model.config.to_hf_dict()}
        return ckpt.save_state(path, self._checkpoint_tree(), meta)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        """Restore a checkpoint written by ``save_checkpoint`` onto the current mesh; returns its global step."""
        self._require_model("load_checkpoint")
        tree, meta = ckpt.restore_state(path, self._checkpoint_tree())
        if meta.get("role") != self.worker_role:
            raise ValueError(f"checkpoint {path} was written by role {meta.get('role')!r}, this worker is "
                             f"{self.worker_role!r}")
        if self.has_actor:
            self.state = TrainState(*tree["train_state"])
            self.engine.set_params(self.state.params)
        else:
            self.ref_params = tree["ref_params"]
        self.global_step, self._gen_calls = int(meta["global_step"]), int(meta["gen_calls"])
        return self.global_step

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str) -> str:
        """Write the actor's current weights as an HF safetensors directory (+ tokenizer files), atomically."""
        self._require_model("export_hf")
        params = self.state.params if self.has_actor else self.ref_params
        host = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params) if jax.process_count() == 1 else \
            jax.tree.map(lambda x: np.asarray(jax.experimental.multihost_utils.process_allgather(x, tiled=True)), params)
        path = os.path.abspath(path)
        if jax.process_index() == 0:
            tmp = f"{path}.tmp-export"
            shutil.rmtree(tmp, ignore_errors=True)
            save_hf_dir(tmp, host, self.model.config)
            copy_tokenizer_files(self.model.path, tmp)
            if os.path.exists(path):
                shutil.rmtree(path)
            os.rename(tmp, path)
        return path
