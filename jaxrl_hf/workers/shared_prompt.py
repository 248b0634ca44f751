"""The policy forward with each prompt computed once for its ``n`` samples (``actor.share_prompt_forward``).

GRPO-style rollouts put the ``n`` samples of a prompt in adjacent rows: their first ``P`` columns (the left-padded
prompt, its mask and positions) are equal, so the decoder's activations there are equal too (a causal model's
prompt positions never see the response). For rows in whole groups of ``n`` equal prompts this forward lays each
group out as one row (`group_rows`) and runs the decoder once over them:

    group row:     [prompt (P) | response 1 (R) | ... | response n (R)]                  [G, P + n·R]
    attention:     the prompt causally; each response over its prompt's keys and, causally, its own
                   (`jaxrl_hf.models.shared_prompt_attention`, row layout ``RowLayout("shared_prompt", (P, n, R))``)
    log π(y_t):    LM head on [hidden(prompt)[P-1], hidden(response)[0 .. R-2]]  (the positions predicting y_0 ..)

Each response's scores are ``[R, P + R]``, the padded forward's response rows, over the same keys with the same
positions and masks, so log-probs and entropies equal it up to float summation order, and so do the gradients (the
prompt's activations receive the sum over the group's samples, which is what backpropagation through ``n`` equal
copies computes). The decoder processes ``G·P + G·n·R`` token positions instead of ``G·n·(P + R)``, about half at
GRPO's usual prompt/response shapes. Every projection is one matmul over all of them, and each weight is read once
forward and once backward: an earlier form ran a prompt pass, then a response pass over its KV cache, which read
every weight twice, ran each matmul at fewer rows, and summed the two passes' weight gradients.

Rows that are not whole groups of equal prompts take the padded forward (`groups_share_prompts` decides, on the
host, per pass), and so do widths at which the padded forward would not attend eagerly (blockwise or cuDNN
attention: that eager response pass would hold scores the kernels never materialise).
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf.models.attention import resolve_implementation
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.forward import lm_head_log_probs, make_module
from jaxrl_hf.models.llama import CausalLM, kv_head_repeats
from jaxrl_hf.models.row_layout import RowLayout
from jaxrl_hf.models.shared_prompt_attention import join_group_rows, repeat_per_sample, split_group_rows
from jaxrl_hf.workers import group_packing
from jaxrl_hf.workers.common import chunked_apply
from jaxrl_hf.workers.losses import LogProbFn, whole_rows
from jaxrl_hf.workers.token_batches import agree_max

Array = jax.Array


def groups_share_prompts(input_ids: np.ndarray, attention_mask: np.ndarray, response_length: int, group: int,
                         chunk_rows: int, position_ids: np.ndarray | None = None) -> bool:
    """Whether every chunk of ``chunk_rows`` consecutive rows (a micro-batch, or one device's share of it) consists
    of whole groups of ``group`` rows whose prompt columns (``[:, :P]``, ``P`` = width - ``response_length``) hold the
    same tokens under the same mask (and the same positions, when given)."""
    rows = len(input_ids)
    if group < 2 or chunk_rows % group or rows % group:
        return False
    width = np.shape(input_ids)[1] - int(response_length)
    if width < 1:
        return False
    columns = [x for x in (input_ids, attention_mask, position_ids) if x is not None]
    for x in columns:
        prompt = np.asarray(x)[:, :width].reshape(rows // group, group, width)
        if not (prompt == prompt[:, :1]).all():
            return False
    return True


def _first_of_group(x: Array, group: int) -> Array:
    return x.reshape(x.shape[0] // group, group, *x.shape[1:])[:, 0]


def group_rows(x: Array, prompt_len: int, group: int) -> Array:
    """Padded rows ``[G·n, P + R]`` (groups of ``n`` equal prompts) -> one row per group ``[G, P + n·R]``: the
    prompt once, then each sample's response (`models.shared_prompt_attention`'s layout)."""
    return join_group_rows(_first_of_group(x[:, :prompt_len], group), x[:, prompt_len:])


def shared_prompt_log_probs(params: Any, config: DecoderConfig, input_ids: Array, attention_mask: Array,
                            position_ids: Array, response_length: int, group: int, temperature: float = 1.0,
                            with_entropy: bool = True, chunk_size: int = 128, mesh: Any = None,
                            rules: Any = None) -> tuple[Array, Array]:
    """``(log π(y_t | x, y_<t), H_t)`` ``[B, R]`` float32 for rows in groups of ``group`` equal prompts (module
    docstring); the same outputs as `jaxrl_hf.workers.losses.response_log_probs` on those rows."""
    rows, width = input_ids.shape
    prompt_len = width - response_length
    if prompt_len < 1:
        raise ValueError(f"input_ids width {width} leaves no prompt before {response_length} response tokens")
    layout = (prompt_len, group, response_length)
    module = make_module(config.replace(row_layout=RowLayout("shared_prompt", layout)), mesh, rules)
    ids, mask, positions = (group_rows(x, prompt_len, group) for x in (input_ids, attention_mask, position_ids))
    hidden, _ = module.apply({"params": params}, ids, positions, mask, method=CausalLM.hidden_states_and_new_kv)
    hidden_p, hidden_r = split_group_rows(hidden, layout)
    h = jnp.concatenate([repeat_per_sample(hidden_p[:, -1:], group), hidden_r[:, :-1]], axis=1)
    log_prob, entropy = lm_head_log_probs(params, config, h, input_ids[:, prompt_len:], temperature, chunk_size,
                                          with_entropy)
    return whole_rows(log_prob, mesh, rules), whole_rows(entropy, mesh, rules)


def packed_group_log_probs(params: Any, config: DecoderConfig, micro: Mapping[str, Array], group: int,
                           temperature: float = 1.0, with_entropy: bool = True, chunk_size: int = 128,
                           mesh: Any = None, rules: Any = None) -> tuple[Array, Array]:
    """`shared_prompt_log_probs` over packed group rows (`jaxrl_hf.workers.group_packing`: ``group_*`` arrays and
    ``responses [G·n, R]``): the decoder over ``[G / k, L]`` real tokens under `shared_prefix_attention`'s mask (one
    group at a time where a row holds ``k`` > 1), the LM head on the ``S`` hidden states of each group that
    ``group_logit_index`` names (the real response tokens), and each response column's output from its
    ``group_score_slot`` (0 for a padding column)."""
    rows, width = micro["responses"].shape
    groups, longest = micro["group_windows"].shape
    packed_rows = micro["group_input_ids"].shape[0]
    per_row = groups // packed_rows
    layout = (per_row, longest, group + 1) if per_row > 1 else ()
    module = make_module(config.replace(row_layout=RowLayout("shared_prefix", layout)), mesh, rules)
    hidden, _ = module.apply({"params": params}, micro["group_input_ids"], micro["group_position_ids"],
                             micro["group_segments"], method=CausalLM.hidden_states_and_new_kv)
    at = jnp.take_along_axis(micro["group_windows"], micro["group_logit_index"], axis=1)  # [G, S] in its row
    h = jnp.take_along_axis(hidden, at.reshape(packed_rows, -1)[..., None], axis=1)  # [G / k, k·S, E]
    scored = lm_head_log_probs(params, config, h.reshape(groups, -1, h.shape[-1]), micro["group_score_targets"],
                               temperature, chunk_size, with_entropy)

    def per_column(x: Array) -> Array:  # [G, S] -> [G·n, R]: a zero slot appended for the padding columns
        x = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
        return whole_rows(jnp.take_along_axis(x, micro["group_score_slot"], axis=1).reshape(rows, width), mesh, rules)
    return per_column(scored[0]), per_column(scored[1])


def shared_prompt_log_prob_fn(model_config: DecoderConfig, group: int, mesh: Any = None, rules: Any = None,
                              chunk_size: int = 128) -> LogProbFn:
    """``fn(params, micro, temperature) -> (log_prob, entropy)`` of `shared_prompt_log_probs` on a rollout
    micro-batch whose rows come in groups of ``group`` equal prompts (the caller checks: `groups_share_prompts`),
    or of `packed_group_log_probs` where the micro-batch holds packed group rows (``group_segments``)."""
    def fn(params: Any, micro: Mapping[str, Array], temperature: float) -> tuple[Array, Array]:
        if "group_segments" in micro:
            return packed_group_log_probs(params, model_config, micro, group, temperature, with_entropy=True,
                                          chunk_size=chunk_size, mesh=mesh, rules=rules)
        return shared_prompt_log_probs(params, model_config, micro["input_ids"], micro["attention_mask"],
                                       micro["position_ids"], micro["responses"].shape[1], group, temperature,
                                       with_entropy=True, chunk_size=chunk_size, mesh=mesh, rules=rules)
    return fn


class SharedPromptForward:
    """The actor worker's choice between the padded forward and `shared_prompt_log_prob_fn`: the shared one
    exists when ``actor.share_prompt_forward`` is on, ``rollout.n`` > 1, no sequence parallelism and no kv-head
    repeats (its attention reads a KV cache); a pass takes it when its rows pass `groups_share_prompts`. With
    ``packed`` (``model.use_remove_padding``) its group rows drop their padding (`jaxrl_hf.workers.group_packing`)
    wherever the rows allow (`group_packing.packable`) and the packed rows' attention is eager too."""

    def __init__(self, model_config: DecoderConfig, enabled: bool, group: int, sequence_parallel: int,
                 mesh: Any = None, rules: Any = None, packed: bool = False) -> None:
        self.group, self.model_config, self.packed = int(group), model_config, bool(packed)
        usable = (enabled and self.group > 1 and sequence_parallel == 1
                  and kv_head_repeats(model_config.num_key_value_heads, mesh, rules) == 1)
        self.log_prob_fn = shared_prompt_log_prob_fn(model_config, self.group, mesh, rules) if usable else None

    def _eager(self, width: int) -> bool:
        c = self.model_config
        return resolve_implementation(c.attn_implementation, width, jnp.dtype(c.dtype), c.head_dim,
                                      c.layer_windows is not None, bool(c.attn_logit_softcapping)) == "eager"

    def applies(self, arrays: Mapping[str, np.ndarray], rows_per_device: int) -> bool:
        """Whether a padded pass over ``arrays`` (``input_ids``, ``attention_mask``, ``responses``) in chunks of
        ``rows_per_device`` rows per device can share its prompts: grouped rows, and a width at which the padded
        forward's attention is eager too (the response pass's ``[R, P + R]`` scores are then a part of its
        ``[T, T]`` ones; a blockwise or cuDNN padded pass keeps its kernel)."""
        return self.log_prob_fn is not None and self._eager(np.shape(arrays["input_ids"])[1]) and groups_share_prompts(
            arrays["input_ids"], arrays["attention_mask"], np.shape(arrays["responses"])[1], self.group,
            int(rows_per_device), arrays.get("position_ids"))

    def packs(self, arrays: Mapping[str, np.ndarray]) -> bool:
        """Whether rows that `applies` to go as packed group rows: ``packed``, `group_packing.packable` rows, and
        an eager width for the longest packed group row."""
        if not self.packed:
            return False
        response = np.shape(arrays["responses"])[1]
        length = group_packing.group_row_length(arrays["attention_mask"], response, self.group)  # in lockstep
        ok = group_packing.packable(arrays["attention_mask"], response) and self._eager(length)
        return not agree_max(int(not ok))[0]  # every process takes the same layout

    def groups_per_row(self, rows: int, devices: int) -> int:
        """``k`` of `group_packing.pack_group_rows` for ``rows`` rows over ``devices`` devices: each device's
        groups in one packed row (they then pad to the fullest device's load, not each to the longest group)."""
        return max(int(rows) // (self.group * int(devices)), 1)

    def pack(self, arrays: Mapping[str, np.ndarray], devices: int = 1) -> dict[str, np.ndarray]:
        """One chunk of rows (``[rows, ...]``, split over ``devices`` devices) as packed group rows at its own
        lengths, each device's groups in one row."""
        response = np.shape(arrays["responses"])[1]
        length = group_packing.group_row_length(arrays["attention_mask"], response, self.group)
        per_row = self.groups_per_row(len(arrays["attention_mask"]), devices)
        return group_packing.pack_group_rows(arrays, response, self.group, length, per_row=per_row)

    def apply(self, program: Any, params: Any, arrays: Mapping[str, np.ndarray], mesh: Any, dp_processes: int,
              *extra: Any, rows_per_device: int) -> tuple[np.ndarray, ...]:
        """``program(params, micro, *extra)`` over rows that `applies` to, in chunks of ``rows_per_device`` rows per
        device (`workers.common.chunked_apply`: whole groups in every chunk), each chunk packed where `packs`."""
        inputs = {k: v for k, v in arrays.items() if k != "response_mask"}
        devices = int(mesh.shape["dp"]) // dp_processes
        chunk = int(rows_per_device) * devices
        return chunked_apply(program, params, inputs, chunk, mesh, dp_processes, *extra,
                             prepare=functools.partial(self.pack, devices=devices) if self.packs(arrays) else None)
