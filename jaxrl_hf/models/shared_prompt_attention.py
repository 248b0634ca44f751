"""Attention over rows that each hold one prompt and its ``n`` sampled responses (the ``shared_prompt`` row layout,
`jaxrl_hf.models.row_layout`).

GRPO-style rollouts sample ``n`` responses per prompt. The actor's shared-prompt forward (`jaxrl_hf.workers.
shared_prompt`) lays each group out as one row of ``P + n·R`` tokens:

    [ prompt (P, left-padded) | response 1 (R, right-padded) | ... | response n (R) ]

with the rollout's position ids, so the response tokens of every sample continue the prompt's positions. The
decoder's projections, norms and MLP see the row as ordinary tokens: one matmul per projection over every token
of the micro-batch, each weight read once (in its backward too: one weight gradient, no sum over passes).
Attention is the only place the layout matters. `shared_prompt_attention` computes

    prompt tokens:     causal self-attention over the prompt (the configured implementation)
    response tokens:   one softmax over [the prompt's keys] ++ [their own response's keys, causally]

which is, key for key, what the padded ``[n, P + R]`` forward attends to (the prompt's keys are the same for
every sample), so hidden states equal the padded forward's at the same positions up to float summation order.

Without padding (the ``shared_prefix`` row layout, `jaxrl_hf.workers.group_packing`) a row holds only real tokens:

    [ prompt's tokens (segment 1) | sample 1's tokens (segment 2) | ... | sample n's (segment n + 1) | padding (0) ]

and `shared_prefix_attention` lets each token see the earlier tokens of its own segment and all of segment 1:
the same keys again, now at ``p + Σ r_i`` positions instead of ``P + n·R``. A row may pack several such groups
(the layout's ``(groups, width, stride)``, group ``j``'s segments offset by ``j·s``): the projections then see one
row of ``Σ_j (p_j + Σ r_ji)`` tokens instead of each group padded to the longest, and `grouped_prefix_attention`
runs the attention above one group at a time, in slots of the longest group's length.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp

from jaxrl_hf.models.attention import cached_attention, head_batched_attention
from jaxrl_hf.models.packed_attention import per_row_attention

Array = jnp.ndarray


def check_layout(layout: tuple[int, ...], length: int) -> tuple[int, int, int]:
    """``(P, n, R)`` of ``layout`` (the ``shared_prompt`` row layout's shape), checked against the row ``length``."""
    prompt, samples, response = layout
    if prompt + samples * response != length:
        raise ValueError(f"shared-prompt rows of {length} tokens do not hold a prompt of {prompt} and {samples} "
                         f"responses of {response} tokens ({prompt + samples * response})")
    return prompt, samples, response


def split_group_rows(x: Array, layout: tuple[int, ...]) -> tuple[Array, Array]:
    """``x [G, P + n·R, ...]`` -> ``(prompts [G, P, ...], responses [G·n, R, ...])``."""
    prompt, samples, response = check_layout(layout, x.shape[1])
    return x[:, :prompt], x[:, prompt:].reshape(x.shape[0] * samples, response, *x.shape[2:])


def join_group_rows(prompts: Array, responses: Array) -> Array:
    """`split_group_rows` inverted: ``[G, P, ...]`` and ``[G·n, R, ...]`` -> ``[G, P + n·R, ...]``."""
    groups = prompts.shape[0]
    return jnp.concatenate([prompts, responses.reshape(groups, -1, *responses.shape[2:])], axis=1)


def repeat_per_sample(x: Array, samples: int) -> Array:
    """``x [G, ...]`` -> ``[G·n, ...]``, each entry ``n`` times in a row (a broadcast and a reshape)."""
    return jnp.broadcast_to(x[:, None], (x.shape[0], samples, *x.shape[1:])).reshape(-1, *x.shape[1:])


def shared_prompt_attention(q: Array, k: Array, v: Array, segments: Array, layout: tuple[int, ...],
                            attend: Callable[[Array, Array, Array, Array], Array], scale: float,
                            window: Any = None, softcap: float | None = None) -> Array:
    """Attention of the module docstring. ``q [G, P + n·R, kv_heads, groups, head_dim]``, ``k, v [G, P + n·R,
    kv_heads, head_dim]``, ``segments [G, P + n·R]`` (0 = padding, else 1), ``layout = (P, n, R)``; ``attend(q, k,
    v, segments)``: the configured self-attention for the prompts. Returns the output in ``q``'s layout."""
    prompt, samples, _ = check_layout(layout, q.shape[1])
    (q_p, q_r), (k_p, k_r), (v_p, v_r), (seg_p, seg_r) = (split_group_rows(x, layout) for x in (q, k, v, segments))
    out_p = attend(q_p, k_p, v_p, seg_p)
    # each response after its prompt's P keys, as a KV cache of P slots: {"k", "v"}: [G·n, kv_heads, P, head_dim]
    cache = {name: repeat_per_sample(x, samples).swapaxes(1, 2) for name, x in (("k", k_p), ("v", v_p))}
    row_mask = jnp.concatenate([repeat_per_sample(seg_p, samples), seg_r], axis=1)  # the padded rows' masks
    out_r = cached_attention(q_r, k_r, v_r, cache, row_mask, prompt, scale, window, softcap)
    return join_group_rows(out_p, out_r)


def shared_prefix_mask(segments: Array, positions: Array, window: Any = None) -> Array:
    """``[B, T, T]`` bool for rows packed as in the module docstring: query ``i`` sees key ``j`` iff ``j <= i``,
    ``segments[j] != 0``, ``segments[j]`` is ``segments[i]`` or ``1`` (the prompt) and, for a sliding ``window``
    ``w > 0``, ``positions[j] > positions[i] - w`` (by position: packing moved the tokens, not their distances)."""
    idx = jnp.arange(segments.shape[1])
    q_seg, kv_seg = segments[:, :, None], segments[:, None, :]
    seen = (idx[None, :] <= idx[:, None])[None] & (kv_seg != 0) & ((kv_seg == q_seg) | ((kv_seg == 1) & (q_seg != 0)))
    if window is not None:
        seen = seen & ((window <= 0) | (positions[:, None, :] > positions[:, :, None] - window))
    return seen


def shared_prefix_attention(q: Array, k: Array, v: Array, segments: Array, positions: Array, scale: float,
                            window: Any = None, softcap: float | None = None, groups: tuple[int, ...] = ()) -> Array:
    """Eager attention (Vaswani et al. 2017, eq. 1) under `shared_prefix_mask`: ``softmax(where(mask,
    soft_cap(q kᵀ · scale), -inf)) v`` with ``q [B, T, kv_heads, groups, head_dim]``, ``k, v [B, T, kv_heads,
    head_dim]``, ``segments`` / ``positions [B, T]``. A padding query gets the mean of ``v`` (no key seen).
    ``groups``: the ``shared_prefix`` row layout's ``(groups, width, stride)`` (`grouped_prefix_attention`), if set."""
    if groups:
        return grouped_prefix_attention(q, k, v, segments, positions, *groups, scale, window, softcap)
    return head_batched_attention(q, k, v, shared_prefix_mask(segments, positions, window), scale, softcap)


def grouped_prefix_attention(q: Array, k: Array, v: Array, segments: Array, positions: Array, groups: int,
                             width: int, stride: int, scale: float, window: Any = None,
                             softcap: float | None = None) -> Array:
    """`shared_prefix_attention` of rows packing up to ``groups`` groups, group ``j`` holding segments
    ``j·stride + 1`` (its prompt) .. ``j·stride + stride`` in one run of at most ``width`` tokens: each group is
    moved into a ``width`` slot of its own with its segments renumbered from 1 (`packed_attention.
    per_row_attention`), attends there and its outputs move back. The same result as one mask over the whole row
    (a token sees only its own group's prompt and segment) for ``groups · width²`` scores instead of ``L²``."""
    seg = segments.astype(jnp.int32)
    group_of = jnp.where(seg > 0, (seg - 1) // stride + 1, 0)
    local = jnp.where(seg > 0, (seg - 1) % stride + 1, 0)

    def attend(qs: Array, ks: Array, vs: Array, _valid: Array, local_s: Array, positions_s: Array) -> Array:
        return shared_prefix_attention(qs, ks, vs, local_s, positions_s, scale, window, softcap)
    return per_row_attention(q, k, v, group_of, groups, width, attend, local, positions.astype(jnp.int32))
