"""The optimizer update of `optim.make_optimizer` (global-norm clip + AdamW) in one pass per parameter, on a CPU.

XLA:CPU runs optax's ``clip_by_global_norm`` + ``adamw`` + ``apply_updates`` as four fusions per parameter: the
clipped gradient is written out (its division is not duplicated into its two readers), the first and second
moments are written and read back by the parameter's fusion: ~56 bytes of memory traffic a parameter. The
kernel (``backends/cpu/csrc/clip_adamw.cc``) reads ``g, p, m, v`` once and writes ``p, m, v`` in place (28 bytes).
Same formula, float32 throughout; the scalar divisions are
multiplications by reciprocals and the products' sums fused multiply-adds, so a value may differ from optax's by
float32 rounding: both stay within 1.5 float32 roundings of the terms they sum of AdamW in float64
(`tests/test_workers_fused_adamw.py`).

`FusedClipAdamW` is what `train_step.apply_update` runs in place of ``optimizer.update`` + ``apply_updates`` where
`fused_update_for` says it can: every parameter float32, the train state on one CPU device, the CPU kernels
available (`backends.cpu.ffi.available`; ``model.cpu_backend: off`` turns them off). The optimizer state keeps
optax's structure, counts and injected learning rate, so checkpoints and `optim.set_learning_rate` see no difference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_hf.backends.cpu import ffi
from jaxrl_hf.backends.cpu.layer_unrolled import split_layers, stack_layers
from jaxrl_hf.config.schema import OptimConfig

TARGET = "jaxrl_hf_clip_adamw"


@dataclasses.dataclass(frozen=True)
class FusedClipAdamW:
    """The update ``make_optimizer(optim, grad_clip)`` describes (``grad_clip`` None or ≤ 0: no clipping).

    ``layers`` > 1: the params hold ``model/layers`` stacked ``[layers, ...]`` and the forward runs those layers
    unrolled; the train step then differentiates the `split` params (each layer's weights its own leaves) and
    hands the kernel every layer's gradient as it was made, with no ``[layers, ...]`` concatenation per stacked
    weight (~0.85 GB of memory traffic an update of SmolLM2-135M)."""

    optim: OptimConfig
    grad_clip: float | None
    layers: int = 0

    def split(self, params: Any) -> Any:
        """The tree the train step differentiates: ``params`` itself, or `layer_unrolled.split_layers` of it."""
        return split_layers(params, self.layers) if self.layers > 1 else params

    def join(self, split: Any) -> Any:
        """`split` inverted (a concatenation of one buffer's slices, which XLA folds back into the buffer)."""
        return stack_layers(split) if self.layers > 1 else split

    def gradient_pieces(self, grads: Any, params: Any) -> list[list[jax.Array]]:
        """Per leaf of ``params`` (flattened order), its gradient as pieces in element order: ``grads`` in the
        `split` structure."""
        if self.layers <= 1:
            return [[g] for g in jax.tree.leaves(grads)]
        rest, layers = grads
        stacked = jax.tree.map(lambda *pieces: _Pieces(pieces), *layers)
        tree = {**rest, "model": {**rest["model"], "layers": stacked}}
        if jax.tree.structure(tree, is_leaf=lambda x: isinstance(x, _Pieces)) != jax.tree.structure(params):
            raise ValueError("fused AdamW: the split gradients do not match the params' tree")
        return [list(x.arrays) if isinstance(x, _Pieces) else [x]
                for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, _Pieces))]

    def __call__(self, grads: Any, opt_state: Any, params: Any,
                 grad_norm: jax.Array | None = None) -> tuple[Any, Any]:
        """``(new params, new optimizer state)``: what optax's ``optimizer.update(grads, opt_state, params)`` then
        ``apply_updates`` give, to float32 rounding, at the learning rate ``opt_state`` holds
        (`optim.set_learning_rate`); ``grads`` in the `split` structure; ``grad_norm``: the gradients' global norm
        where the caller has it."""
        clip = self.grad_clip is not None and self.grad_clip > 0
        inject = opt_state[1] if clip else opt_state
        adam = inject.inner_state[0]
        if not isinstance(adam, optax.ScaleByAdamState):
            raise ValueError(f"fused AdamW: expected optax's AdamW state, got {type(adam).__name__}")
        b1, b2 = (float(b) for b in self.optim.betas)
        count = optax.safe_increment(adam.count)
        scale = jnp.float32(1.0)
        if clip:  # optax clips unless ‖g‖ < max_norm
            norm = optax.tree.norm(grads) if grad_norm is None else grad_norm
            scale = jnp.where(norm < self.grad_clip, 1.0, self.grad_clip / norm).astype(jnp.float32)
        f32 = lambda x: jnp.float32(np.float32(x))  # noqa: E731  (Python floats rounded once, as optax's are)
        hyper = jnp.stack([  # the kernel's Hyper order
            scale, f32(1 - b1), f32(b1), f32(1 - b2), f32(b2),
            1 / (1 - b1 ** count).astype(jnp.float32), 1 / (1 - b2 ** count).astype(jnp.float32),  # 1 / bias corr.
            f32(self.optim.eps), f32(self.optim.weight_decay),
            -inject.hyperparams["learning_rate"].astype(jnp.float32)])  # optax.scale_by_learning_rate
        leaves, treedef = jax.tree.flatten(params)
        new_p, new_m, new_v = clip_adamw(self.gradient_pieces(grads, params), leaves, jax.tree.leaves(adam.mu),
                                         jax.tree.leaves(adam.nu), hyper)
        new_adam = adam._replace(count=count, mu=treedef.unflatten(new_m), nu=treedef.unflatten(new_v))
        new_inject = inject._replace(count=optax.safe_increment(inject.count),
                                     inner_state=(new_adam, *inject.inner_state[1:]))
        return treedef.unflatten(new_p), ((opt_state[0], new_inject) if clip else new_inject)


class _Pieces:
    """A stacked leaf's per-layer gradients (a pytree leaf: `FusedClipAdamW.gradient_pieces`)."""

    def __init__(self, arrays: tuple) -> None:
        self.arrays = arrays


def clip_adamw(grads: list, params: list, mu: list, nu: list, hyper: jax.Array) -> tuple[list, list, list]:
    """The kernel over leaf lists (all float32, the lists in the same order): ``(params, mu, nu)`` updated, each
    result aliased to its operand (donate them and XLA updates them in place). ``grads``: per leaf its gradient,
    or a list of pieces covering the leaf's elements in order (same count, any shapes). ``hyper``: float32 [10] in
    the kernel's ``Hyper`` order (clip scale, 1 - b1, b1, 1 - b2, b2, 1 / bc1, 1 / bc2, eps, weight decay, -lr)."""
    count = len(params)
    pieces = [list(g) if isinstance(g, (list, tuple)) else [g] for g in grads]
    if not (len(pieces) == len(mu) == len(nu) == count):
        raise ValueError(f"clip_adamw: {len(pieces)} gradients, {count} params, {len(mu)} / {len(nu)} moments")
    for name, leaves in (("param", params), ("first moment", mu), ("second moment", nu)):
        bad = [i for i, x in enumerate(leaves) if x.dtype != jnp.float32 or x.shape != params[i].shape]
        if bad:
            raise ValueError(f"clip_adamw: {name} leaf {bad[0]} is {leaves[bad[0]].dtype}{list(leaves[bad[0]].shape)}"
                             f"; needs float32{list(params[bad[0]].shape)}")
    for i, parts in enumerate(pieces):
        if any(g.dtype != jnp.float32 for g in parts) or sum(g.size for g in parts) != params[i].size:
            raise ValueError(f"clip_adamw: gradient leaf {i} is {[f'{g.dtype}{list(g.shape)}' for g in parts]}; "
                             f"needs float32 with {params[i].size} elements in all (param {list(params[i].shape)})")
    flat = [g for parts in pieces for g in parts]
    shapes = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in params] * 3
    aliases = {1 + len(flat) + i: i for i in range(3 * count)}  # operand 0 is hyper, then g pieces, p, m, v
    out = jax.ffi.ffi_call(TARGET, shapes, input_output_aliases=aliases)(
        hyper, *flat, *params, *mu, *nu, pieces=np.asarray([len(parts) for parts in pieces], np.int64))
    return list(out[:count]), list(out[count:2 * count]), list(out[2 * count:])


def fused_update_for(optim: OptimConfig, grad_clip: float | None, params: Any,
                     mesh: jax.sharding.Mesh | None, unrolled_layers: int = 0,
                     cpu_backend: str = "auto") -> FusedClipAdamW | None:
    """The fused update where it applies (``model.cpu_backend`` not ``off``, float32 ``params`` — arrays or
    shapes —, a one-device CPU ``mesh`` or none, the kernels available), else ``None`` (the train step keeps
    optax's update). ``unrolled_layers``: the model's layer count where its forward unrolls the stacked layers
    (``model.scan_layers: false``); the update then takes per-layer gradients (`FusedClipAdamW.layers`) where
    ``params`` hold those stacked layers."""
    if cpu_backend == "off":
        return None
    devices = mesh.devices.flat if mesh is not None else jax.devices()[:1]
    if (mesh is not None and mesh.size != 1) or any(d.platform != "cpu" for d in devices):
        return None
    if not all(jnp.dtype(x.dtype) == jnp.float32 for x in jax.tree.leaves(params)):
        return None
    if not ffi.available():
        return None
    return FusedClipAdamW(optim, grad_clip, unrolled_layers if stacks_layers(params, unrolled_layers) else 0)


def stacks_layers(params: Any, layers: int) -> bool:
    """Whether ``params`` hold ``model/layers`` with every leaf stacked ``[layers, ...]`` (``layers`` > 1)."""
    stacked = params.get("model", {}).get("layers") if isinstance(params, dict) else None
    return layers > 1 and isinstance(stacked, dict) and bool(jax.tree.leaves(stacked)) and all(
        len(x.shape) >= 1 and x.shape[0] == layers for x in jax.tree.leaves(stacked))
