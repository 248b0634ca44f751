"""Sparse mixture-of-experts block (Qwen3-MoE): top-k softmax routing and dropless grouped-matmul experts.

For the ``N`` tokens ``x_n`` of a layer, with router ``W_r [embed, experts]`` and ``k = num_experts_per_tok``
(transformers' ``Qwen3MoeSparseMoeBlock``)::

    z_n = x_n W_r                                   router logits  [N, experts]
    p_n = softmax(z_n)                              in float32
    (w_n, e_n) = top_k(p_n, k)                      the k largest probabilities and their experts
    w_n <- w_n / sum(w_n)                           only with norm_topk_prob
    y_n = sum_j w_nj · down_e(silu(gate_e(x_n)) * up_e(x_n)),  e = e_nj

Dropless: every (token, choice) pair is computed, none dropped for capacity. The ``N·k`` pairs are sorted by
expert, so each expert's rows are contiguous, and each projection is one grouped matmul over the experts
(``jax.lax.ragged_dot``: rows ``[offset_e, offset_e + count_e)`` times expert ``e``'s matrix; XLA compiles it on
CPU and GPU); the results are unsorted and summed over the ``k`` choices. `moe_block` returns the router logits
and the chosen experts and weights as well (`Routing`), for routing replay and a load-balancing loss.

Routing replay (`route`'s ``given``): the experts ``e_n`` are given (recorded by an earlier pass or by the rollout
engine) and only their weights come from this pass's ``p_n``: ``w_nj = p_n[e_nj]`` (renormalised as above).

Parameter tree of `MoEBlock` (logical axes; stacked over ``layers`` by the decoder's scan)::

  router/kernel     [embed, expert]
  gate_proj/kernel  [expert, embed, mlp];  up_proj/kernel [expert, embed, mlp]
  down_proj/kernel  [expert, mlp, embed]
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.expert_parallel import expert_mesh_axes, expert_parallel_block
from jaxrl_hf.models.stored_dtype import from_bits

Array = jnp.ndarray


class Routing(NamedTuple):
    """One MoE layer's routing of its ``N`` tokens (flattened ``[B, T]``)."""

    logits: Array  # [N, experts] float32: the router's logits
    experts: Array  # [N, k] int32: the chosen experts, most probable first
    weights: Array  # [N, k]: their weights (renormalised with norm_topk_prob), in the compute dtype


def route(x: Array, router: Array, top_k: int, norm_topk_prob: bool, given: Array | None = None) -> Routing:
    """Top-``k`` softmax routing of ``x [N, embed]`` by ``router [embed, experts]`` (module docstring).

    ``given [N, k]`` (routing replay): the experts are these instead of the top ``k``; their weights are still
    ``p_n`` at those experts (renormalised with norm_topk_prob), so the router's gradient flows as without."""
    logits = jnp.dot(x, router.astype(x.dtype), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if given is None:
        weights, experts = jax.lax.top_k(probs, top_k)
    else:
        experts = given.reshape(-1, top_k).astype(jnp.int32)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(logits, experts.astype(jnp.int32), weights.astype(x.dtype))


def grouped_experts(x: Array, experts: Array, weights: Array, gate: Array, up: Array, down: Array,
                    drops: bool = False) -> Array:
    """``sum_j weights[n, j] · expert_{experts[n, j]}(x[n])`` for ``x [N, embed]``, each expert SwiGLU
    ``down(silu(x gate) * (x up))`` with ``gate``/``up`` ``[E, embed, mlp]`` and ``down`` ``[E, mlp, embed]``:
    the ``N·k`` (token, choice) rows sorted by expert, three `jax.lax.ragged_dot` products, unsorted. ``drops``:
    a choice of expert ``E`` (one past the last) is dropped: it sorts last, outside every group, and adds 0
    (`jaxrl_hf.models.expert_parallel`: the choices of another device's experts)."""
    n, k = experts.shape
    num_experts = gate.shape[0]
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert, in token order within an expert
    rows = jnp.take(x, order // k, axis=0)  # [N·k, embed]
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    dt, f32 = x.dtype, jnp.float32

    def grouped(lhs: Array, rhs: Array) -> Array:
        return jax.lax.ragged_dot(lhs, rhs.astype(dt), sizes, preferred_element_type=f32).astype(dt)

    hidden = nn.silu(grouped(rows, gate)) * grouped(rows, up)
    out = grouped(hidden, down) * jnp.take(weights.reshape(-1), order)[:, None].astype(dt)
    if drops:  # rows past every group: ragged_dot leaves them unset
        out = jnp.where((jnp.take(flat, order) < num_experts)[:, None], out, 0)
    unsorted = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # back to (token, choice) order
    return jnp.sum(unsorted.reshape(n, k, -1).astype(f32), axis=1).astype(dt)


def moe_block(x: Array, router: Array, gate: Array, up: Array, down: Array, top_k: int,
              norm_topk_prob: bool, given: Array | None = None, experts_fn: Any = None) -> tuple[Array, Routing]:
    """``(y, routing)`` of the MoE block over ``x [B, T, embed]`` (``y`` shaped as ``x``; ``given``: `route`'s;
    ``experts_fn(grouped_experts, x, experts, weights, gate, up, down)``: the experts computed another way, e.g.
    `jaxrl_hf.models.expert_parallel.expert_parallel_block`)."""
    flat = x.reshape(-1, x.shape[-1])
    routing = route(flat, router, top_k, norm_topk_prob, given)
    if experts_fn is not None:
        return experts_fn(grouped_experts, x, routing.experts, routing.weights, gate, up, down), routing
    y = grouped_experts(flat, routing.experts, routing.weights, gate, up, down)
    return y.reshape(x.shape), routing


class MoEBlock(nn.Module):
    """The flax module of `moe_block` (parameters in the module docstring); ``__call__`` returns ``(y, routing)``."""

    config: DecoderConfig
    mesh: Any = None
    rules: Any = None

    @nn.compact
    def __call__(self, x: Array, given: Array | None = None) -> tuple[Array, Routing]:
        c = self.config
        dt, pdt = jnp.dtype(c.dtype), jnp.dtype(c.param_dtype)
        e, m, n = c.hidden_size, c.moe_intermediate_size, c.num_experts
        router = _Kernel((e, n), ("embed", "expert"), e, pdt, name="router")()
        gate = _Kernel((n, e, m), ("expert", "embed", "mlp"), e, pdt, name="gate_proj")()
        up = _Kernel((n, e, m), ("expert", "embed", "mlp"), e, pdt, name="up_proj")()
        down = _Kernel((n, m, e), ("expert", "mlp", "embed"), m, pdt, name="down_proj")()
        to = lambda w: from_bits(w, dt)  # noqa: E731  (uint16 bit patterns of decode weights)
        axes = expert_mesh_axes(self.rules) if self.mesh is not None else ()
        experts_fn = functools.partial(expert_parallel_block, mesh=self.mesh, rules=self.rules, axes=axes) \
            if axes else None
        return moe_block(x.astype(dt), to(router), to(gate), to(up), to(down), c.num_experts_per_tok,
                         c.norm_topk_prob, given, experts_fn)


class _Kernel(nn.Module):
    """One ``kernel`` parameter of ``shape`` with logical ``axes`` (normal(0, fan_in^-1/2) init)."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    fan_in: int
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> Array:
        init = nn.with_logical_partitioning(nn.initializers.normal(stddev=self.fan_in ** -0.5), self.axes)
        return self.param("kernel", init, self.shape, self.param_dtype)
