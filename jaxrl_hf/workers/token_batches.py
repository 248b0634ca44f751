"""How a worker pass forms its micro-batches: by rows (the padded default), by a token budget (verl's
``use_dynamic_bsz`` + ``*_max_token_len_per_gpu``) and/or packed (``model.use_remove_padding``).

`MicroBatching` is the config view of one pass (actor update, actor/ref log-probs, critic update/values), read
from verl's keys by `actor_micro_batching` / `critic_micro_batching`. When it is ``active`` the worker hands the
pass's rows to it instead of the padded path:

* update (`MicroBatching.update_micro_batches`): one mini-batch's rows -> the ``[M, ...]`` micro-batch stack of
  `jaxrl_hf.workers.train_step` (``M`` rounded up to a power of two with empty micro-batches, which the step skips
  through ``live_fn`` = `has_response_tokens` and which count in no denominator: their ``response_mask`` is 0);
* forward passes (`MicroBatching.apply`): one jitted call per micro-batch, outputs scattered back to row order.

Static shapes: packed micro-batches are ``[D, L]`` with ``L`` the token budget (by tokens) or
`packing.static_length` of the micro-batch's largest load (by rows: 4 lengths per doubling, at most ``rows·T``); the
rows per device ``r``
are bucketed to a power of two. With several processes the counts are agreed (maximum over processes), since
every micro-batch is one SPMD program over all of them. Rows whose ``response_mask`` is all 0 (the dispatch's
padding rows, overlong-filtered samples) are left out: their loss, gradient and outputs are 0 either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf.config.schema import ModelConfig, RunConfig
from jaxrl_hf.workers import packing
from jaxrl_hf.workers.common import PER_TOKEN_COLUMNS, WorkerConfigError, chunked_apply, to_global
from jaxrl_hf.workers.minibatch import MiniBatchPlan

TOKEN_KEYS = ("input_ids", "attention_mask", "position_ids")


def has_response_tokens(micro: Mapping[str, jax.Array]) -> jax.Array:
    """``live_fn`` of `jaxrl_hf.workers.train_step`: whether a micro-batch has any scored token."""
    return jnp.any(micro["response_mask"] != 0)


def agree_max(*values: int) -> tuple[int, ...]:
    """The element-wise maximum of ``values`` over the JAX processes (all of them call it in lockstep)."""
    if jax.process_count() == 1:
        return tuple(int(v) for v in values)
    from jax.experimental import multihost_utils

    gathered = np.asarray(multihost_utils.process_allgather(np.asarray(values, np.int64)))
    return tuple(int(v) for v in gathered.reshape(-1, len(values)).max(axis=0))


@dataclasses.dataclass
class MicroBatching:
    """One pass's micro-batching: ``dynamic`` (by ``max_token_len`` valid tokens per device, the key named
    ``budget_key``) or ``rows_per_device`` rows; ``remove_padding``: packed. ``valid_tokens`` /
    ``computed_tokens`` count the update micro-batches built since the last `padding_metrics`."""

    remove_padding: bool
    dynamic: bool
    max_token_len: int | None
    rows_per_device: int
    budget_key: str
    valid_tokens: int = 0
    computed_tokens: int = 0

    @property
    def active(self) -> bool:
        return self.remove_padding or self.dynamic

    def __post_init__(self) -> None:
        if self.dynamic and (self.max_token_len is None or self.max_token_len < 1):
            switch = self.budget_key.rsplit(".", 1)[0]
            raise WorkerConfigError(f"{self.budget_key}={self.max_token_len!r}: use_dynamic_bsz in {switch} needs "
                                    "a token budget >= 1 (valid tokens per device per micro-batch)")

    # ---------------------------------------------------------------------------------------- layout
    def minibatch_plan(self, rows: int, *, mini_batch_prompts: int, samples_per_prompt: int, dp_devices: int,
                       dp_processes: int, epochs: int, shuffle: bool, where: str) -> MiniBatchPlan:
        """By rows: `MiniBatchPlan.build`. By tokens: whole mini-batches (split later by tokens), which need
        only split evenly over the processes."""
        if not self.dynamic:
            return MiniBatchPlan.build(rows, mini_batch_prompts=mini_batch_prompts,
                                       samples_per_prompt=samples_per_prompt, micro_per_device=self.rows_per_device,
                                       dp_devices=dp_devices, dp_processes=dp_processes, epochs=epochs,
                                       shuffle=shuffle, where=where)
        sequences = mini_batch_prompts * samples_per_prompt
        if mini_batch_prompts < 1 or epochs < 1 or sequences % dp_processes or rows % (sequences // dp_processes):
            raise WorkerConfigError(
                f"{where}: a mini-batch of {where}.ppo_mini_batch_size·rollout.n = {mini_batch_prompts}·"
                f"{samples_per_prompt} sequences (ppo_epochs={epochs}) must split evenly over {dp_processes} "
                f"processes and divide this rank's {rows} sequences")
        per_rank = sequences // dp_processes
        return MiniBatchPlan(rows, per_rank, per_rank, 1, epochs, shuffle)

    def _slots(self, lengths: np.ndarray, skip: np.ndarray | None, devices: int) -> np.ndarray:
        if self.dynamic:
            return packing.partition_by_tokens(lengths, self.max_token_len, devices, key=self.budget_key, skip=skip)
        return packing.partition_by_rows(len(lengths), self.rows_per_device, devices, skip)

    def micro_batches(self, arrays: Mapping[str, np.ndarray], devices: int,
                      pad_count: bool) -> tuple[dict[str, np.ndarray], np.ndarray, tuple[int, int]]:
        """``arrays`` (rows ``[N, ...]``, with ``input_ids``/``attention_mask``/``position_ids``/``responses``)
        as ``[M, ...]`` micro-batches over ``devices`` local devices, their ``slots [M, D, r]`` (packed:
        `packing.PACKED_KEYS` replace the token arrays; else padded rows; ``pad_count`` buckets ``M``) and
        ``(valid tokens, computed token slots)`` of the micro-batches holding rows."""
        mask = np.asarray(arrays["attention_mask"])
        lengths = packing.valid_lengths(mask)
        skip = ~(np.asarray(arrays["response_mask"]) != 0).any(axis=1) if "response_mask" in arrays else None
        slots = self._slots(lengths, skip, devices)
        count, _, width = slots.shape
        full = mask.shape[1]
        length = full
        if self.remove_padding:
            length = self.max_token_len if self.dynamic else packing.static_length(
                int(packing.packed_loads(lengths, slots).max()), width * full)
        count, width, length = agree_max(packing.bucket(count) if pad_count else count,
                                         packing.bucket(width) if self.dynamic else width, length)
        slots = packing.pad_slots(slots, count, width)
        packed_keys = (*TOKEN_KEYS, *PER_TOKEN_COLUMNS) if self.remove_padding else ()  # per-token: pack_<key>
        out = packing.gather_rows({k: v for k, v in arrays.items() if k not in packed_keys}, slots)
        if self.remove_padding:
            out.update(packing.pack_tokens(arrays["input_ids"], mask, arrays["position_ids"], slots, length,
                                           np.asarray(arrays["responses"]).shape[1]))
            out.update({f"pack_{k}": packing.pack_per_token(arrays[k], mask, slots, out["pack_rows"], length)
                        for k in PER_TOKEN_COLUMNS if k in arrays})
        live = int((slots != packing.EMPTY).any(axis=(1, 2)).sum())
        per_micro = devices * (length if self.remove_padding else width * full)
        return out, slots, (int(packing.packed_loads(lengths, slots).sum()), live * per_micro)

    def update_micro_batches(self, mini: Mapping[str, np.ndarray], devices: int) -> dict[str, np.ndarray]:
        """One mini-batch from `iterate_minibatches` (``[num_micro, micro_rows, ...]``) as the train step's
        micro-batch stack (unchanged by rows and padded, when not ``active``)."""
        if not self.active:
            return dict(mini)
        flat = {k: np.asarray(v).reshape(-1, *np.shape(v)[2:]) for k, v in mini.items()}
        micro, _, (valid, computed) = self.micro_batches(flat, devices, pad_count=self.dynamic)
        self.valid_tokens, self.computed_tokens = self.valid_tokens + valid, self.computed_tokens + computed
        return micro

    def count_tokens(self, valid: int, computed: int) -> None:
        """Count an update micro-batch stack laid out elsewhere (packed group rows) in `padding_metrics`."""
        self.valid_tokens, self.computed_tokens = self.valid_tokens + valid, self.computed_tokens + computed

    def padding_metrics(self, prefix: str) -> dict[str, float]:
        """``{prefix}padding_ratio``: the share of computed token slots (``[D, L]`` per live packed micro-batch,
        ``[D·r, T]`` padded) holding no row's token, since the last call; resets the counts ({} if not ``active``)."""
        if not self.active:
            return {}
        ratio = 1.0 - self.valid_tokens / max(self.computed_tokens, 1)
        self.valid_tokens = self.computed_tokens = 0
        return {f"{prefix}padding_ratio": ratio}

    # ---------------------------------------------------------------------------------------- forward passes
    def apply(self, program: Any, params: Any, arrays: Mapping[str, np.ndarray], mesh: jax.sharding.Mesh,
              dp_processes: int, *extra: Any) -> tuple[np.ndarray, ...]:
        """``program(params, micro, *extra)`` per micro-batch, its ``[D·r, ...]`` outputs back in the order of this
        process's rows (rows left out: 0). Not ``active``: `chunked_apply` of ``rows_per_device`` rows per device
        (``response_mask`` is then not passed on)."""
        from jaxrl_hf.controller import process_local_rows

        devices = int(mesh.shape["dp"]) // dp_processes
        if not self.active:
            inputs = {k: v for k, v in arrays.items() if k != "response_mask"}
            return chunked_apply(program, params, inputs, self.rows_per_device * devices, mesh, dp_processes, *extra)
        rows = len(arrays["attention_mask"])
        micro, slots, _ = self.micro_batches(arrays, devices, pad_count=False)
        pieces = []
        for m in range(slots.shape[0]):
            out = program(params, {k: to_global(v[m], mesh, dp_processes) for k, v in micro.items()}, *extra)
            pieces.append(tuple(process_local_rows(o) for o in (out if isinstance(out, tuple) else (out,))))
        return tuple(packing.scatter_rows(np.stack(col), slots, rows) for col in zip(*pieces))


def _batching(model: ModelConfig, dynamic: bool, budget: int | None, rows: int, key: str) -> MicroBatching:
    return MicroBatching(bool(model.use_remove_padding), bool(dynamic), budget, int(rows), key)


def actor_micro_batching(config: RunConfig) -> dict[str, MicroBatching]:
    """``update`` (``actor.use_dynamic_bsz``/``ppo_max_token_len_per_gpu``), ``log_prob``
    (``rollout.log_prob_*``) and ``ref`` (``ref.log_prob_*``) passes of the actor worker; packed with
    ``model.use_remove_padding``."""
    a, r, ref, model = config.actor, config.rollout, config.ref, config.model
    rows = a.log_prob_micro_batch_size_per_device or a.ppo_micro_batch_size_per_device
    return {"update": _batching(model, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu,
                                a.ppo_micro_batch_size_per_device, "actor.ppo_max_token_len_per_gpu"),
            "log_prob": _batching(model, r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu, rows,
                                  "rollout.log_prob_max_token_len_per_gpu"),
            "ref": _batching(model, ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu, rows,
                             "ref.log_prob_max_token_len_per_gpu")}


def critic_micro_batching(config: RunConfig) -> dict[str, MicroBatching]:
    """``update`` (``critic.ppo_max_token_len_per_gpu``) and ``values`` (``critic.forward_max_token_len_per_gpu``)
    passes of the critic, both under ``critic.use_dynamic_bsz``; packed with ``critic.model.use_remove_padding``
    (``model``'s when the critic has no model section of its own)."""
    c = config.critic
    model = c.model or config.model
    return {"update": _batching(model, c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu,
                                c.ppo_micro_batch_size_per_device, "critic.ppo_max_token_len_per_gpu"),
            "values": _batching(model, c.use_dynamic_bsz, c.forward_max_token_len_per_gpu,
                                c.ppo_micro_batch_size_per_device, "critic.forward_max_token_len_per_gpu")}
