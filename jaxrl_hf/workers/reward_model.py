"""`RewardModelWorker` / `CostModelWorker`: value-head scorers of finished sequences (HybridFlow's reward
and cost model classes; Safe-RLHF uses both).

The model is a directory written by ``jaxrl_hf.rewards.save_reward_model`` / ``launch/train_rm.py`` (HF
``...ForSequenceClassification`` names) or by transformers' ``save_pretrained`` of a ``Llama``/``Qwen2``
``ForSequenceClassification`` with ``num_labels=1`` (`jaxrl_hf.rewards.rm_io.load_reward_model`), or ``"tiny-random"`` (a random decoder + random head from
``model.tiny`` / the role's ``seed``, for smoke tests). ``compute_rm_score`` reads the value head at the
last valid token of ``attention_mask`` (prompt + response) and writes it at the last valid response token
of a ``[B, R]`` float32 matrix: ``rm_scores`` for role ``"reward"``, ``cost_scores`` for role ``"cost"``.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf import mesh as meshlib
from jaxrl_hf.config.schema import RunConfig, ScoringModelConfig
from jaxrl_hf.controller import Batch, Dispatch, Worker, register
from jaxrl_hf.models import init_value_params, value_forward, value_param_logical_axes
from jaxrl_hf.workers.common import (TINY_RANDOM, WorkerConfigError, chunked_apply, param_shardings,
                                     tiny_decoder_config, train_parallel, worker_run_config)

ROLES = {"reward": ("reward_model", "rm_scores"), "cost": ("cost_model", "cost_scores")}
SCORE_INPUTS = ("input_ids", "attention_mask", "position_ids")


@functools.partial(jax.jit, static_argnames=("config", "mesh", "rules"))
def _last_token_scores(params: Any, micro: Mapping[str, jax.Array], *, config: Any, mesh: Any, rules: Any) -> jax.Array:
    values = value_forward(params, config, micro["input_ids"], micro["attention_mask"], micro["position_ids"],
                           mesh, rules)
    positions = jnp.arange(values.shape[1], dtype=jnp.int32)
    last = jnp.max(jnp.where(micro["attention_mask"] > 0, positions, -1), axis=1)
    return jnp.take_along_axis(values, jnp.maximum(last, 0)[:, None], axis=1)[:, 0]


class RewardModelWorker(Worker):
    """Scores sequences with a value-head model; ``role`` picks the config section and output key:
    ``"reward"`` -> ``reward_model``, ``rm_scores``; ``"cost"`` -> ``cost_model``, ``cost_scores``. Section
    keys (`ScoringModelConfig`): ``path`` (RM directory or ``"tiny-random"``), ``seed``,
    ``micro_batch_size_per_device``, ``dtype``. ``config``: the run's `RunConfig` or a plain nested mapping
    (`worker_run_config`)."""

    default_role = "reward"

    def __init__(self, config: RunConfig | Mapping[str, Any], role: str | None = None):
        role = role or self.default_role
        if role not in ROLES:
            raise WorkerConfigError(f"{type(self).__name__} role={role!r}; valid: {sorted(ROLES)}")
        self.config, self.score_role = worker_run_config(config), role
        self.section_name, self.output_key = ROLES[role]
        self.section: ScoringModelConfig = getattr(self.config, self.section_name)
        self.train = train_parallel(self.config.placement)
        self.mesh = meshlib.build_train_mesh(self.train, meshlib.ordered_devices())
        self.params: Any = None

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict[str, Any]:
        """Load the scorer (``<section>.path``) and place it on the mesh."""
        path = self.section.path
        if path is None:
            raise WorkerConfigError(f"{self.section_name}.path is not set: a reward-model directory or {TINY_RANDOM!r}")
        dtype = self.section.dtype or self.config.model.dtype
        if path == TINY_RANDOM:
            self.model_config = tiny_decoder_config(self.config.model.tiny, dtype, "none",
                                                    attn_implementation=self.config.model.attn_implementation)
            params = init_value_params(self.model_config, self.section.seed)
        else:
            from jaxrl_hf.rewards.rm_io import load_reward_model

            try:
                rm = load_reward_model(path, dtype=dtype, attn_implementation=self.config.model.attn_implementation)
            except (FileNotFoundError, ValueError, KeyError) as err:
                raise WorkerConfigError(f"{self.section_name}.path={path!r}: {err}") from err
            self.model_config, params = rm.config, rm.params
        shardings = param_shardings(params, value_param_logical_axes(self.model_config), self.mesh)
        self.params = jax.device_put(params, shardings)
        return {"role": self.score_role, "path": path, "vocab_size": self.model_config.vocab_size}

    @register(dispatch=Dispatch.MESH_DP)
    def compute_rm_score(self, batch: Batch) -> Batch:
        """``rm_scores`` (or ``cost_scores``) ``[B, R]``: the sequence score at the last valid response token."""
        if self.params is None:
            raise RuntimeError(f"{type(self).__name__}.compute_rm_score: call init_model() first")
        missing = [k for k in SCORE_INPUTS + ("response_mask",) if k not in batch]
        if missing:
            raise KeyError(f"compute_rm_score: Batch lacks {missing}; columns: {batch.keys()}")
        ids = np.asarray(batch["input_ids"])
        if ids.size and (ids.min() < 0 or ids.max() >= self.model_config.vocab_size):
            raise ValueError(f"compute_rm_score ({self.score_role}): token ids outside the scorer's vocabulary "
                             f"[0, {self.model_config.vocab_size}): min {ids.min()}, max {ids.max()}")
        dp_processes = self.mesh_coords().dp_size
        chunk = self.section.micro_batch_size_per_device * int(self.mesh.shape["dp"]) // dp_processes
        program = functools.partial(_last_token_scores, config=self.model_config, mesh=self.mesh,
                                    rules=meshlib.train_activation_rules())
        (scores,) = chunked_apply(program, self.params, {k: batch[k] for k in SCORE_INPUTS}, chunk, self.mesh,
                                  dp_processes)
        mask = np.asarray(batch["response_mask"])
        out = np.zeros(mask.shape, np.float32)
        lengths = mask.sum(axis=1).astype(np.int64)
        rows = np.flatnonzero(lengths > 0)
        out[rows, lengths[rows] - 1] = scores[rows]
        return Batch.from_dict({self.output_key: out})


class CostModelWorker(RewardModelWorker):
    """`RewardModelWorker` with role ``"cost"`` (Safe-RLHF's cost model): ``config["cost_model"]``,
    output ``cost_scores``."""

    default_role = "cost"
