"""`CriticWorker`: the PPO value model (decoder backbone + scalar head), HybridFlow §2.4's critic class.

``compute_values`` adds ``values [B, R]`` (V of the state before each response token); ``update_critic``
reads ``values`` (old), ``returns`` (GAE targets from the trainer) and ``response_mask`` and minimises the
clipped value loss with the same exact micro-batch accumulation as the actor.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import numpy as np

from jaxrl_hf import mesh as meshlib
from jaxrl_hf.backends.cpu import pair_matmul
from jaxrl_hf.backends.cpu.fused_adamw import fused_update_for
from jaxrl_hf.config.schema import RunConfig
from jaxrl_hf.controller import PAD_ROWS_KEY, Batch, Dispatch, Worker, register
from jaxrl_hf.models import value_param_logical_axes, value_params_from_lm
from jaxrl_hf.workers import checkpoint as ckpt
from jaxrl_hf.workers.common import (LoadedModel, WorkerConfigError, check_sequence_parallel_heads, load_model,
                                     pad_sequences_to, param_shardings, to_global, train_parallel, train_rule_set,
                                     worker_run_config)
from jaxrl_hf.workers.losses import (CRITIC_SUMMED_METRICS, critic_loss, critic_loss_config, response_denominator,
                                     value_head_fn)
from jaxrl_hf.workers.memory_metrics import memory_metrics
from jaxrl_hf.workers.minibatch import iterate_minibatches, mean_metrics
from jaxrl_hf.workers.optim import make_optimizer, update_schedule_step
from jaxrl_hf.workers.packed_forward import packed_value_fn
from jaxrl_hf.workers.peak_flops import mfu_summary
from jaxrl_hf.workers.token_batches import critic_micro_batching, has_response_tokens
from jaxrl_hf.workers.train_step import TrainState, init_train_state, make_train_step, train_state_shardings

VALUE_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")
UPDATE_KEYS = VALUE_INPUTS + ("response_mask", "values", "returns")


@functools.partial(jax.jit, static_argnames=("value_fn",))
def _values_program(params: Any, micro: Mapping[str, jax.Array], *, value_fn: Any) -> jax.Array:
    return value_fn(params, micro)


class CriticWorker(Worker):
    """Value model on a ``('pp','tp','dp')`` mesh (``+ 'sp'`` with ``critic.ulysses_sequence_parallel_size > 1``,
    as the actor's). ``config``: the run's `RunConfig` (or a plain nested mapping,
    `worker_run_config`); ``critic`` holds the optimizer/mini-batch keys; the backbone comes from
    ``critic.model`` if given, else ``model`` (the actor's initial weights)."""

    def __init__(self, config: RunConfig | Mapping[str, Any]):
        self.config = worker_run_config(config)
        self.critic_cfg = self.config.critic
        self.train = train_parallel(self.config.placement, sp=self.critic_cfg.ulysses_sequence_parallel_size,
                                    sp_key="critic.ulysses_sequence_parallel_size")
        self.rule_set = train_rule_set(self.config, "critic", self.train)
        self.mesh = meshlib.build_train_mesh(self.train, meshlib.ordered_devices())
        self.model: LoadedModel | None = None
        self.state: TrainState | None = None
        self.batching = critic_micro_batching(self.config)  # update / values: by rows, by tokens and/or packed

    @property
    def dp_processes(self) -> int:
        """Data-parallel shards at process granularity."""
        return self.mesh_coords().dp_size

    def _require_model(self, method: str) -> None:
        if self.model is None:
            raise RuntimeError(f"CriticWorker.{method}: call init_model() first")

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Backbone from the LM weights + a value head (``critic.value_head_init_std``, default 0 so V=0
        at the start), optimizer and train step."""
        model_cfg = self.critic_cfg.model or self.config.model
        self.model = load_model(model_cfg, where="critic.model" if self.critic_cfg.model else "model")
        config = self.model.config
        check_sequence_parallel_heads(config, self.train, "critic.ulysses_sequence_parallel_size")
        params = value_params_from_lm(self.model.params, config, model_cfg.seed + 1,
                                      head_std=self.critic_cfg.value_head_init_std)
        self.model.params = None
        shardings = param_shardings(params, value_param_logical_axes(config), self.mesh, rule_set=self.rule_set)
        params = jax.device_put(params, shardings)
        try:
            self.loss_cfg = critic_loss_config(self.critic_cfg)
        except ValueError as err:
            raise WorkerConfigError(f"critic config: {err}") from None
        self.optim = self.critic_cfg.optim
        optimizer = make_optimizer(self.optim, self.critic_cfg.grad_clip, where="critic.optim")
        state_shardings = train_state_shardings(params, shardings, optimizer, self.mesh)
        self.state = jax.jit(lambda p: init_train_state(p, optimizer), out_shardings=state_shardings)(params)
        cpu_backend = model_cfg.cpu_backend
        train_config = pair_matmul.training_config(config, self.mesh, cpu_backend)
        self.value_fn = value_head_fn(train_config, self.mesh, self.rule_set.activations)
        self.packed_value_fn = packed_value_fn(train_config, self.mesh, self.rule_set.activations)
        update = self.batching["update"]
        loss_fn = functools.partial(critic_loss, value_fn=self._forward_fn(update), cfg=self.loss_cfg)
        self._train_step = make_train_step(loss_fn, self.optim, optimizer=optimizer,
                                           denominator_fn=response_denominator(self.loss_cfg.loss_agg_mode),
                                           summed_aux=CRITIC_SUMMED_METRICS, state_shardings=state_shardings,
                                           live_fn=has_response_tokens if update.dynamic else None,
                                           fused=fused_update_for(self.optim, self.critic_cfg.grad_clip, params,
                                                                  self.mesh, 0 if config.scan_layers
                                                                  else config.num_hidden_layers, cpu_backend))
        self.global_step = 0
        # the MFU inputs (`mfu_summary`): no LM head, so the input embedding is a lookup whatever the tying
        mfu = mfu_summary(config.replace(tie_word_embeddings=False), params, self.config.trainer.peak_flops_per_device,
                          -(-self.config.placement.num_processes // (self.config.trainer.nnodes or 1)))
        return {"num_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(params))), "mesh": dict(self.mesh.shape),
                **mfu}

    def _forward_fn(self, batching: Any) -> Any:
        return self.packed_value_fn if batching.remove_padding else self.value_fn

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def set_step(self, step: int) -> None:
        """Set the global training step (seeds the mini-batch shuffle)."""
        self.global_step = int(step)

    @register(dispatch=Dispatch.MESH_DP)
    def compute_values(self, batch: Batch) -> Batch:
        """``values [B, R]`` float32, 0 outside ``response_mask``."""
        self._require_model("compute_values")
        missing = [k for k in VALUE_INPUTS + ("response_mask",) if k not in batch]
        if missing:
            raise KeyError(f"compute_values: Batch lacks {missing}; columns: {batch.keys()}")
        batching = self.batching["values"]  # by rows, by tokens (critic.forward_max_token_len_per_gpu), packed
        program = functools.partial(_values_program, value_fn=self._forward_fn(batching))
        inputs = pad_sequences_to({k: batch[k] for k in VALUE_INPUTS + ("response_mask",)}, self.train.sp)
        (values,) = batching.apply(program, self.state.params, inputs, self.mesh, self.dp_processes)
        return Batch.from_dict({"values": (values * (np.asarray(batch["response_mask"]) != 0)).astype(np.float32)})

    @register(dispatch=Dispatch.MESH_DP)
    def update_critic(self, batch: Batch) -> Batch:
        """``ppo_epochs`` × mini-batch steps of the clipped value loss; returns an empty Batch with
        ``meta_info["metrics"]``: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``,
        ``critic/grad_norm``, ``critic/lr``, ``critic/loss`` (the optimized loss: verl's name), ``critic/num_updates``."""
        self._require_model("update_critic")
        missing = [k for k in UPDATE_KEYS if k not in batch]
        if missing:
            raise KeyError(f"update_critic: Batch lacks {missing}; columns: {batch.keys()}")
        arrays = {k: np.asarray(batch[k]) for k in UPDATE_KEYS}
        pad = int(batch.meta_info.get(PAD_ROWS_KEY, 0))
        if pad:
            arrays["response_mask"] = arrays["response_mask"].copy()
            arrays["response_mask"][len(batch) - pad:] = 0
        arrays = pad_sequences_to(arrays, self.train.sp)
        c = self.critic_cfg
        update, dp_devices = self.batching["update"], int(self.mesh.shape["dp"])
        plan = update.minibatch_plan(len(batch), mini_batch_prompts=c.ppo_mini_batch_size,
                                     samples_per_prompt=self.config.rollout.n, dp_devices=dp_devices,
                                     dp_processes=self.dp_processes, epochs=c.ppo_epochs, shuffle=c.shuffle,
                                     where="critic")
        collected = []
        seed = [self.config.rollout.seed, self.global_step, self.mesh_coords().dp_rank, 1]
        lr_step = np.int32(update_schedule_step(batch.meta_info, self.global_step))  # one lr for the whole call
        for micro in iterate_minibatches(arrays, plan, seed):
            micro = update.update_micro_batches(micro, dp_devices // self.dp_processes)  # by tokens and/or packed
            placed = {k: to_global(v, self.mesh, self.dp_processes, micro_axis=True) for k, v in micro.items()}
            self.state, metrics = self._train_step(self.state, placed, lr_step)
            collected.append(metrics)
        metrics = {**mean_metrics(collected, prefix="critic/", last=("lr",)), **update.padding_metrics("critic/"),
                   **memory_metrics("critic/")}
        return Batch.from_dict({}, meta_info={"metrics": metrics})

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> str:
        """Atomically write the critic's params, optimizer state and step to ``path``."""
        self._require_model("save_checkpoint")
        return ckpt.save_state(path, {"train_state": self.state},
                               {"role": "critic", "global_step": self.global_step,
                                "model_config": self.model.config.to_hf_dict()})

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> int:
        """Restore a ``save_checkpoint`` directory onto the current mesh; returns its global step."""
        self._require_model("load_checkpoint")
        tree, meta = ckpt.restore_state(path, {"train_state": self.state})
        if meta.get("role") != "critic":
            raise ValueError(f"checkpoint {path} was written by role {meta.get('role')!r}, not 'critic'")
        self.state = TrainState(*tree["train_state"])
        self.global_step = int(meta["global_step"])
        return self.global_step
