"""The optimizer update of `optim.make_optimizer` (global-norm clip + AdamW) in one pass per parameter, on a CPU.

XLA:CPU runs optax's ``clip_by_global_norm`` + ``adamw`` + ``apply_updates`` as four fusions per parameter: the
clipped gradient is written out (its division is not duplicated into its two readers), the first and second
moments are written and read back by the parameter's fusion: ~56 bytes of memory traffic a parameter, ~0.2 s an
update of SmolLM2-135M's 134.5 M float32 parameters on the 2-core CPU, four times per default DAPO step. The
kernel (``models/kernels/clip_adamw.cc``) reads ``g, p, m, v`` once and writes ``p, m, v`` in place (28 bytes):
~0.05 s (``launch/bench/bench_optimizer_update.py``). Same formula, float32 throughout; the scalar divisions are
multiplications by reciprocals and the products' sums fused multiply-adds, so a value may differ from optax's by
float32 rounding: both stay within 1.5 float32 roundings of the terms they sum of AdamW in float64
(`tests/test_workers_fused_adamw.py`).

`FusedClipAdamW` is what `train_step.apply_update` runs in place of ``optimizer.update`` + ``apply_updates`` where
`fused_update_for` says it can: every parameter float32, the train state on one CPU device, the CPU kernels
available (`models.cpu_kernels.available`; ``JAXRL_HF_CPU_KERNELS=0`` turns them off). The optimizer state keeps
optax's structure, counts and injected learning rate, so checkpoints and `optim.set_learning_rate` see no difference.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_hf.config.schema import OptimConfig
from jaxrl_hf.models import cpu_kernels

TARGET = "jaxrl_hf_clip_adamw"


@dataclasses.dataclass(frozen=True)
class FusedClipAdamW:
    """The update ``make_optimizer(optim, grad_clip)`` describes (``grad_clip`` None or ≤ 0: no clipping)."""

    optim: OptimConfig
    grad_clip: float | None

    def __call__(self, grads: Any, opt_state: Any, params: Any,
                 grad_norm: jax.Array | None = None) -> tuple[Any, Any]:
        """``(new params, new optimizer state)``: what optax's ``optimizer.update(grads, opt_state, params)`` then
        ``apply_updates`` give, to float32 rounding, at the learning rate ``opt_state`` holds
        (`optim.set_learning_rate`); ``grad_norm``: the gradients' global norm where the caller has it."""
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
        new_p, new_m, new_v = clip_adamw(jax.tree.leaves(grads), leaves, jax.tree.leaves(adam.mu),
                                         jax.tree.leaves(adam.nu), hyper)
        new_adam = adam._replace(count=count, mu=treedef.unflatten(new_m), nu=treedef.unflatten(new_v))
        new_inject = inject._replace(count=optax.safe_increment(inject.count),
                                     inner_state=(new_adam, *inject.inner_state[1:]))
        return treedef.unflatten(new_p), ((opt_state[0], new_inject) if clip else new_inject)


def clip_adamw(grads: list, params: list, mu: list, nu: list, hyper: jax.Array) -> tuple[list, list, list]:
    """The kernel over leaf lists (all float32, the lists in the same order): ``(params, mu, nu)`` updated, each
    result aliased to its operand (donate them and XLA updates them in place). ``hyper``: float32 [10] in the
    kernel's ``Hyper`` order (clip scale, 1 - b1, b1, 1 - b2, b2, 1 / bc1, 1 / bc2, eps, weight decay, -lr)."""
    count = len(params)
    if not (len(grads) == len(mu) == len(nu) == count):
        raise ValueError(f"clip_adamw: {len(grads)} gradients, {count} params, {len(mu)} / {len(nu)} moments")
    for name, leaves in (("gradient", grads), ("param", params), ("first moment", mu), ("second moment", nu)):
        bad = [i for i, x in enumerate(leaves) if x.dtype != jnp.float32 or x.shape != params[i].shape]
        if bad:
            raise ValueError(f"clip_adamw: {name} leaf {bad[0]} is {leaves[bad[0]].dtype}{list(leaves[bad[0]].shape)}"
                             f"; needs float32{list(params[bad[0]].shape)}")
    shapes = [jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in params] * 3
    aliases = {1 + count + i: i for i in range(3 * count)}  # operand 0 is hyper, then g, p, m, v
    out = jax.ffi.ffi_call(TARGET, shapes, input_output_aliases=aliases)(hyper, *grads, *params, *mu, *nu)
    return list(out[:count]), list(out[count:2 * count]), list(out[2 * count:])


def fused_update_for(optim: OptimConfig, grad_clip: float | None, params: Any,
                     mesh: jax.sharding.Mesh | None) -> FusedClipAdamW | None:
    """The fused update where it applies (float32 ``params`` — arrays or shapes —, a one-device CPU ``mesh`` or
    none, the kernels available), else ``None`` (the train step keeps optax's update)."""
    devices = mesh.devices.flat if mesh is not None else jax.devices()[:1]
    if (mesh is not None and mesh.size != 1) or any(d.platform != "cpu" for d in devices):
        return None
    if not all(jnp.dtype(x.dtype) == jnp.float32 for x in jax.tree.leaves(params)):
        return None
    return FusedClipAdamW(optim, grad_clip) if cpu_kernels.available() else None
