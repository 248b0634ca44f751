"""The pure training step: micro-batch gradient accumulation, exact global denominators, one optimizer update.

``make_train_step(loss_fn, optim, optimizer=..., ...)`` returns
``step(state, micro_batches, schedule_step=None) -> (state, metrics)``:

* ``micro_batches`` is a dict of arrays shaped ``[M, b, ...]`` (``M`` micro-batches of ``b`` rows; the
  ``b`` axis may be sharded over data-parallel devices).
* ``denominator_fn(micro_batches)`` is evaluated once on the *whole* mini-batch (e.g. the total number of
  valid tokens from ``algos.agg_loss_denominator``) and handed to every ``loss_fn`` call. A loss written
  as ``Σ_micro numerator / global_denominator`` then sums to exactly the mini-batch loss, so the
  accumulated gradient equals the gradient of one big batch (DAPO eq.10's token-mean stays a *global*
  token mean under accumulation; averaging per-micro-batch means would not).
* ``loss_fn(params, micro, denominators) -> (loss_share, aux)``; gradients and ``loss_share`` are summed
  over ``M`` with ``lax.scan`` (one micro-batch's activations live at a time); ``aux`` scalars named in
  ``summed_aux`` (other loss shares) are summed, the rest (ratios such as clip fractions) averaged.
* ``live_fn(micro) -> bool`` (optional) marks the micro-batches that hold data: the others (empty micro-batches
  padding the count to a static size, `jaxrl_hf.workers.packing`) are skipped with ``lax.cond`` (no forward or
  backward pass; zero loss, gradient and aux) and left out of the averaged ``aux``.
* The update: global-norm clipping + AdamW (``optim.make_optimizer``) at the learning rate of schedule step
  ``schedule_step`` (`optim.learning_rate`). The workers pass the index of the training step, so every update
  of one ``update_actor`` / ``update_critic`` call uses that step's lr (verl steps its scheduler once per call);
  left out, it is ``state.step`` (one schedule step per update). A non-finite gradient norm skips the update
  (params, optimizer state and step count unchanged) and is reported as ``skipped = 1``.
* ``state`` is donated: the old parameter and optimizer buffers are reused for the new ones.
* ``combine(params, frozen) -> full params`` (optional; LoRA, `jaxrl_hf.workers.lora_policy`): ``state.params`` are
  then only the trainable part and the step takes the frozen rest as its ``frozen`` argument; the loss sees
  ``combine(params, frozen)``, gradients and optimizer state exist only for ``params``.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxrl_hf.backends.cpu.fused_adamw import FusedClipAdamW
from jaxrl_hf.config.schema import OptimConfig
from jaxrl_hf.workers.optim import learning_rate, set_learning_rate

LossFn = Callable[[Any, Mapping[str, jax.Array], Any], tuple[jax.Array, Mapping[str, jax.Array]]]


class TrainState(NamedTuple):
    """Parameters, optimizer state and the number of optimizer updates applied (int32 scalar)."""

    params: Any
    opt_state: Any
    step: jax.Array


def init_train_state(params: Any, optimizer: optax.GradientTransformation) -> TrainState:
    """A fresh state (step 0) for ``params``; the optimizer state inherits the params' shardings."""
    return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def train_state_shardings(params: Any, param_shardings: Any, optimizer: optax.GradientTransformation,
                          mesh: jax.sharding.Mesh) -> TrainState:
    """Shardings of a `TrainState`: Adam moments follow their parameter, scalars are replicated."""
    from jaxrl_hf import mesh as meshlib

    opt_shapes = jax.eval_shape(optimizer.init, params)
    opt = meshlib.optimizer_state_shardings(opt_shapes, params, param_shardings, mesh)
    return TrainState(param_shardings, opt, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def accumulate_gradients(loss_fn: LossFn, params: Any, micro_batches: Mapping[str, jax.Array],
                         denominators: Any, summed_aux: tuple[str, ...] = (), grad_shardings: Any = None,
                         live_fn: Callable[[Mapping[str, jax.Array]], jax.Array] | None = None,
                         ) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """``(Σ loss shares, Σ grads, aux)`` over the leading micro-batch axis of ``micro_batches``; ``aux``
    entries named in ``summed_aux`` are summed, the others averaged over the micro-batches. ``grad_shardings``
    (the params' shardings) pins each micro-batch's gradients and their sum to the param layout, so under a
    layout sharded over ``dp`` (``fsdp``) the gradients are reduced straight into their shards (a reduce-scatter
    where the backend forms one; XLA's CPU backend emits an all-reduce and keeps only the shard). ``live_fn``:
    see the module docstring."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    first = jax.tree.map(lambda x: x[0], micro_batches)
    aux_shape = jax.eval_shape(lambda: loss_fn(params, first, denominators)[1])
    pin = (lambda tree: jax.lax.with_sharding_constraint(tree, grad_shardings)) if grad_shardings is not None \
        else (lambda tree: tree)
    zero_grads = pin(jax.tree.map(jnp.zeros_like, params))
    zero_aux = {k: jnp.zeros((), jnp.float32) for k in aux_shape}

    def grads_of(micro):
        (loss, aux), grads = grad_fn(params, micro, denominators)
        return jnp.asarray(loss, jnp.float32), pin(grads), {k: jnp.asarray(aux[k], jnp.float32) for k in zero_aux}

    def body(carry, micro):
        loss_sum, grad_sum, aux_sum, live_sum = carry
        if live_fn is None:
            live = jnp.ones((), jnp.float32)
            loss, grads, aux = grads_of(micro)
        else:
            live = jnp.asarray(live_fn(micro), bool)
            loss, grads, aux = jax.lax.cond(live, grads_of, lambda _: (jnp.zeros((), jnp.float32), zero_grads,
                                                                      zero_aux), micro)
            live = live.astype(jnp.float32)
        grad_sum = pin(jax.tree.map(jnp.add, grad_sum, pin(grads)))
        aux_sum = {k: aux_sum[k] + aux[k] for k in aux_sum}
        return (loss_sum + loss, grad_sum, aux_sum, live_sum + live), None

    start = (jnp.zeros((), jnp.float32), zero_grads, zero_aux, jnp.zeros((), jnp.float32))
    (loss, grads, aux, count), _ = jax.lax.scan(body, start, micro_batches)
    count = jnp.maximum(count, 1.0)
    return loss, grads, {k: v if k in summed_aux else v / count for k, v in aux.items()}


def apply_update(state: TrainState, grads: Any, optimizer: optax.GradientTransformation,
                 optim: OptimConfig, schedule_step: Any = None,
                 fused: FusedClipAdamW | None = None) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from summed gradients at the lr of ``schedule_step`` (default ``state.step``);
    skipped (state unchanged) when ‖g‖ is not finite. ``fused`` (`fused_adamw.fused_update_for`): the same update
    in one pass per parameter on a CPU, in place of ``optimizer.update`` + ``apply_updates``."""
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(grad_norm)
    lr = learning_rate(optim, state.step if schedule_step is None else schedule_step)
    # the update runs under a device-side branch: a non-finite update leaves the state as it was, with no
    # select of new against old over every parameter and moment (bit-identical to the select)

    def update(state: TrainState) -> TrainState:
        opt_state = set_learning_rate(state.opt_state, lr)
        if fused is not None:
            return TrainState(*fused(grads, opt_state, state.params, grad_norm), state.step + 1)
        updates, new_opt = optimizer.update(grads, opt_state, state.params)
        return TrainState(optax.apply_updates(state.params, updates), new_opt, state.step + 1)

    new_state = jax.lax.cond(finite, update, lambda unchanged: unchanged, state)
    return new_state, {"grad_norm": grad_norm, "lr": lr, "skipped": 1.0 - finite.astype(jnp.float32)}


def make_train_step(loss_fn: LossFn, optim: OptimConfig, *, optimizer: optax.GradientTransformation,
                    denominator_fn: Callable[[Mapping[str, jax.Array]], Any] | None = None,
                    summed_aux: tuple[str, ...] = (), donate: bool = True,
                    state_shardings: Any = None, jit: bool = True,
                    live_fn: Callable[[Mapping[str, jax.Array]], jax.Array] | None = None,
                    combine: Callable[[Any, Any], Any] | None = None,
                    fused: FusedClipAdamW | None = None) -> Callable:
    """The jitted ``step(state, micro_batches, schedule_step=None) -> (state, metrics)`` of the module docstring.

    ``metrics``: ``loss`` (exact mini-batch loss), ``grad_norm`` (before clipping), ``lr`` (used for this
    update), ``skipped``, and the averaged ``aux`` entries of ``loss_fn``. ``state_shardings`` (a
    ``TrainState`` of shardings) pins the output layout to the input layout so donation can reuse buffers.
    ``fused``: `apply_update`'s; with ``fused.layers`` the loss is differentiated in ``fused.split`` form.
    """
    def step(state: TrainState, micro_batches: Mapping[str, jax.Array],
             schedule_step: Any = None, frozen: Any = None) -> tuple[TrainState, dict[str, jax.Array]]:
        denominators = denominator_fn(micro_batches) if denominator_fn is not None else None
        grad_shardings = state_shardings.params if state_shardings is not None else None
        fn = loss_fn if combine is None else (lambda p, micro, d: loss_fn(combine(p, frozen), micro, d))
        differentiated = state.params
        if fused is not None and fused.layers > 1:  # per-layer gradients (`FusedClipAdamW.split`; one device)
            differentiated, grad_shardings = fused.split(state.params), None
            fn = (lambda inner: lambda p, micro, d: inner(fused.join(p), micro, d))(fn)
        loss, grads, aux = accumulate_gradients(fn, differentiated, micro_batches, denominators, summed_aux,
                                                grad_shardings, live_fn)
        new_state, update_metrics = apply_update(state, grads, optimizer, optim, schedule_step, fused)
        return new_state, {"loss": loss, **update_metrics, **aux}

    if not jit:
        return step
    kwargs: dict[str, Any] = {"donate_argnums": (0,) if donate else ()}
    if state_shardings is not None:
        kwargs["out_shardings"] = (state_shardings, None)
    return jax.jit(step, **kwargs)
