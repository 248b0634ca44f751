"""The policy forward with each prompt computed once for its ``n`` samples (``actor.share_prompt_forward``).

GRPO-style rollouts put the ``n`` samples of a prompt in adjacent rows: their first ``P`` columns (the left-padded
prompt, its mask and positions) are equal, so the decoder's activations there are equal too (a causal model's
prompt positions never see the response). For rows in whole groups of ``n`` equal prompts this forward runs

    prompt pass:    hidden_p, (K_p, V_p) = decoder(prompt tokens)                 one row per group  [G, P]
    response pass:  hidden_r = decoder(response tokens | cache = (K_p, V_p) of its group)            [G·n, R]
    log π(y_t):     LM head on [hidden_p[P-1], hidden_r[0 .. R-2]]  (the positions predicting y_0 .. y_{R-1})

The response queries attend over the prompt's keys/values (a full cache of ``P`` slots) and, causally, their own
(the decoder's chunk-over-cache attention, `jaxrl_hf.models.attention.cached_attention`, with ``[R, P + R]`` scores:
the response rows of the padded forward's ``[T, T]`` ones): the same keys with the same positions and masks as the
padded ``[G·n, P + R]`` forward, so log-probs and entropies equal it up to float summation order, and so do the
gradients (the prompt pass's activations receive the sum over the group's samples, which is what backpropagation
through ``n`` equal copies computes). The decoder then processes ``G·P + G·n·R`` token positions instead of
``G·n·(P + R)``: about half at GRPO's usual prompt/response shapes.

Rows that are not whole groups of equal prompts take the padded forward (`groups_share_prompts` decides, on the
host, per pass), and so do widths at which the padded forward would not attend eagerly (blockwise or cuDNN
attention: that eager response pass would hold scores the kernels never materialise).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf.models.attention import resolve_implementation
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.forward import lm_head_kernel, make_module
from jaxrl_hf.models.llama import CausalLM, init_kv_cache, kv_head_repeats
from jaxrl_hf.models.logprobs import log_probs_and_entropy_from_hidden
from jaxrl_hf.workers.losses import LogProbFn, whole_rows

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


def _repeat_per_sample(x: Array, group: int, axis: int = 0) -> Array:
    """Each entry along ``axis`` ``group`` times in a row (a broadcast and a reshape: local on a batch-sharded axis)."""
    x = jnp.expand_dims(x, axis + 1)
    shape = list(x.shape)
    shape[axis + 1] = group
    x = jnp.broadcast_to(x, shape)
    return x.reshape(*shape[:axis], shape[axis] * group, *shape[axis + 2:])


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
    module = make_module(config, mesh, rules)
    variables = {"params": params}
    prompt = [_first_of_group(x[:, :prompt_len], group) for x in (input_ids, attention_mask, position_ids)]
    empty = init_kv_cache(config, rows // group, prompt_len)  # cache index 0: never read, only shapes new_kv
    hidden_p, prompt_kv = module.apply(variables, prompt[0], prompt[2], prompt[1], empty, 0,
                                       method=CausalLM.hidden_states_and_new_kv)
    # the responses after a full cache of their prompt's P slots: scores [R, P + R], the padded forward's rows
    cache = {name: _repeat_per_sample(kv, group, axis=1).swapaxes(2, 3) for name, kv in prompt_kv.items()}
    hidden_r, _ = module.apply(variables, input_ids[:, prompt_len:], position_ids[:, prompt_len:], attention_mask,
                               cache, prompt_len, method=CausalLM.hidden_states_and_new_kv)
    last_prompt = _repeat_per_sample(hidden_p[:, -1:], group)
    h = jnp.concatenate([last_prompt, hidden_r[:, :-1]], axis=1)
    kernel = lm_head_kernel(params, config).astype(jnp.dtype(config.dtype))
    log_prob, entropy = log_probs_and_entropy_from_hidden(h, kernel, input_ids[:, prompt_len:], temperature,
                                                          chunk_size, with_entropy, config.final_logit_softcapping)
    return whole_rows(log_prob, mesh, rules), whole_rows(entropy, mesh, rules)


def shared_prompt_log_prob_fn(model_config: DecoderConfig, group: int, mesh: Any = None, rules: Any = None,
                              chunk_size: int = 128) -> LogProbFn:
    """``fn(params, micro, temperature) -> (log_prob, entropy)`` of `shared_prompt_log_probs` on a rollout
    micro-batch whose rows come in groups of ``group`` equal prompts (the caller checks: `groups_share_prompts`)."""
    def fn(params: Any, micro: Mapping[str, Array], temperature: float) -> tuple[Array, Array]:
        return shared_prompt_log_probs(params, model_config, micro["input_ids"], micro["attention_mask"],
                                       micro["position_ids"], micro["responses"].shape[1], group, temperature,
                                       with_entropy=True, chunk_size=chunk_size, mesh=mesh, rules=rules)
    return fn


class SharedPromptForward:
    """The actor worker's choice between the padded forward and `shared_prompt_log_prob_fn`: the shared one
    exists when ``actor.share_prompt_forward`` is on, ``rollout.n`` > 1, no sequence parallelism and no kv-head
    repeats (its attention reads a KV cache); a pass takes it when its rows pass `groups_share_prompts`."""

    def __init__(self, model_config: DecoderConfig, enabled: bool, group: int, sequence_parallel: int,
                 mesh: Any = None, rules: Any = None) -> None:
        self.group, self.model_config = int(group), model_config
        usable = (enabled and self.group > 1 and sequence_parallel == 1
                  and kv_head_repeats(model_config.num_key_value_heads, mesh, rules) == 1)
        self.log_prob_fn = shared_prompt_log_prob_fn(model_config, self.group, mesh, rules) if usable else None

    def applies(self, arrays: Mapping[str, np.ndarray], rows_per_device: int) -> bool:
        """Whether a padded pass over ``arrays`` (``input_ids``, ``attention_mask``, ``responses``) in chunks of
        ``rows_per_device`` rows per device can share its prompts: grouped rows, and a width at which the padded
        forward's attention is eager too (the response pass's ``[R, P + R]`` scores are then a part of its
        ``[T, T]`` ones; a blockwise or cuDNN padded pass keeps its kernel)."""
        width = np.shape(arrays["input_ids"])[1]
        c = self.model_config
        eager = resolve_implementation(c.attn_implementation, width, jnp.dtype(c.dtype), c.head_dim,
                                       c.layer_windows is not None, bool(c.attn_logit_softcapping)) == "eager"
        return self.log_prob_fn is not None and eager and groups_share_prompts(
            arrays["input_ids"], arrays["attention_mask"], np.shape(arrays["responses"])[1], self.group,
            int(rows_per_device), arrays.get("position_ids"))
