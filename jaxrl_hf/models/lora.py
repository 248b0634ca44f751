"""Low-rank adapters (LoRA, Hu et al. 2021) on the decoder's projections: init, merge, freeze split, sharding.

A targeted projection ``y = W x`` (``W``: HF ``[out, in]``) becomes, Hu et al. 2021 eq. (3),

    y = W x + (alpha / r) · B A x,      A: [r, in] (random),  B: [out, r] (zeros, so step 0 equals the base)

with only ``A`` and ``B`` trained. Here kernels are ``[in, *out]`` with heads split out and the layers stacked
(`jaxrl_hf.models.weights_hf`), so the adapters are stored in the same orientation, stacked over layers:
``lora_A [layers, *in, r]`` and ``lora_B [layers, r, *out]``; ``W_kernel + (alpha/r) · lora_A @ lora_B`` is
``(W + (alpha/r) B A)^T``. ``A`` starts as PEFT's default, Kaiming-uniform with ``a = sqrt(5)`` (``U(±1/sqrt(in))``),
``B`` as zeros. Adapters are float32 whatever the base dtype (a bf16 base stays bf16; the merge adds in
float32 and casts back to the kernel's dtype).

The adapter tree (`init_lora`) is ``{hf_module_name: {"lora_A": ..., "lora_B": ...}}``, e.g. ``{"q_proj": ...}``.
Targets are HF module names (``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``) or ``all-linear``
(all seven; the LM head is never adapted, as in PEFT's ``all-linear``), verl's ``model.target_modules``.

The forward is the ordinary decoder on merged weights (`merge_lora`): exact, jit-able, and the same weights
the rollout engine receives at each sync. Under ``jax.grad`` the merge's transpose gives the adapters' gradients;
the base is a constant, so neither gradients nor optimizer state exist for it.

Hook for any trainer (RL actor, SFT, DPO)::

    trainable, frozen = lora.trainable_split(params, lora_cfg)   # (adapters, base); adapters fresh via init_lora
    opt_state = optimizer.init(trainable)                        # the optimizer sees only the adapters
    loss = lambda a: loss_fn(lora.combine(a, frozen, lora_cfg))  # combine = merge into the base's layout
    grads = jax.grad(loss)(trainable)

Sharding (rules as data): adapters keep the base kernel's logical axes on their ``in``/``out`` dims plus
``lora_rank`` (replicated, `LORA_PARAM_RULES`); `adapter_rules` appends those to any rule set's params rules, so a
base sharded by ``fsdp``/``megatron`` keeps its specs and the adapters follow the same mesh axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

Params = dict[str, Any]
Adapters = dict[str, dict[str, Any]]

# HF module name -> (path under params["model"]["layers"], number of leading kernel dims that are the input)
LORA_TARGETS: dict[str, tuple[tuple[str, ...], int]] = {
    "q_proj": (("self_attn", "q_proj", "kernel"), 1),
    "k_proj": (("self_attn", "k_proj", "kernel"), 1),
    "v_proj": (("self_attn", "v_proj", "kernel"), 1),
    "o_proj": (("self_attn", "o_proj", "kernel"), 2),
    "gate_proj": (("mlp", "gate_proj", "kernel"), 1),
    "up_proj": (("mlp", "up_proj", "kernel"), 1),
    "down_proj": (("mlp", "down_proj", "kernel"), 1),
}
HF_MODULE_PREFIX = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
LORA_RANK_AXIS = "lora_rank"
LORA_PARAM_RULES: tuple[tuple[str, Any], ...] = ((LORA_RANK_AXIS, None),)
"""Rules for the adapter-only logical axis: the rank is never split (it is tiny)."""


def resolve_target_modules(spec: str | Sequence[str], key: str = "model.target_modules") -> tuple[str, ...]:
    """``all-linear`` or a list / comma-separated string of HF module names -> ordered tuple of targets."""
    if isinstance(spec, str):
        if spec.strip() == "all-linear":
            return tuple(LORA_TARGETS)
        spec = [s.strip() for s in spec.strip("[]").split(",") if s.strip()]
    names = list(spec)
    if not names:
        raise ValueError(f"{key} is empty; give 'all-linear' or HF module names from {sorted(LORA_TARGETS)}")
    unknown = [n for n in names if n not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"{key}: unknown module(s) {unknown}; known: 'all-linear' or {sorted(LORA_TARGETS)}")
    return tuple(n for n in LORA_TARGETS if n in names)


@dataclass(frozen=True)
class LoraConfig:
    """Rank ``r``, ``alpha`` (scaling ``alpha / r``) and targeted HF module names (verl's ``model.lora_rank``,
    ``model.lora_alpha``, ``model.target_modules``)."""

    rank: int
    alpha: float = 16.0
    target_modules: tuple[str, ...] = tuple(LORA_TARGETS)

    def __post_init__(self) -> None:
        if int(self.rank) <= 0:
            raise ValueError(f"model.lora_rank must be > 0 for LoRA, got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"model.lora_alpha must be > 0, got {self.alpha}")
        object.__setattr__(self, "target_modules", resolve_target_modules(self.target_modules))

    @property
    def scaling(self) -> float:
        """``alpha / r`` (Hu et al. 2021 §4.1)."""
        return float(self.alpha) / int(self.rank)


def lora_config_from_model(model_cfg: Any) -> LoraConfig | None:
    """The `LoraConfig` of a ``ModelConfig`` (``lora_rank == 0``: LoRA off -> ``None``)."""
    rank = int(getattr(model_cfg, "lora_rank", 0) or 0)
    if rank == 0:
        return None
    return LoraConfig(rank, float(model_cfg.lora_alpha), resolve_target_modules(model_cfg.target_modules))


def target_kernel(base: Params, name: str) -> Any:
    """The stacked kernel ``[layers, *in, *out]`` of HF module ``name`` in ``base`` (a params or axes tree)."""
    node = base["model"]["layers"]
    for key in LORA_TARGETS[name][0]:
        node = node[key]
    return node


def _split_dims(kernel_shape: Sequence[int], name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(``in`` dims, ``out`` dims) of a stacked kernel ``[layers, *in, *out]``."""
    n_in = LORA_TARGETS[name][1]
    return tuple(kernel_shape[1:1 + n_in]), tuple(kernel_shape[1 + n_in:])


def init_lora(base: Params, lora_cfg: LoraConfig, rng: jax.Array | int = 0) -> Adapters:
    """Fresh float32 adapters for ``base``: ``lora_A ~ U(±1/sqrt(in))`` (Kaiming-uniform, a=sqrt(5)), ``lora_B = 0``."""
    rng = jax.random.PRNGKey(rng) if isinstance(rng, int) else rng
    adapters: Adapters = {}
    for i, name in enumerate(lora_cfg.target_modules):
        shape = target_kernel(base, name).shape
        ins, outs = _split_dims(shape, name)
        fan_in = math.prod(ins)
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(jax.random.fold_in(rng, i), (shape[0], *ins, lora_cfg.rank), jnp.float32,
                               -bound, bound)
        adapters[name] = {"lora_A": a, "lora_B": jnp.zeros((shape[0], lora_cfg.rank, *outs), jnp.float32)}
    return adapters


def lora_delta(adapters: Adapters, name: str, kernel_shape: Sequence[int], scaling: float) -> jax.Array:
    """``(alpha/r) · lora_A @ lora_B`` in the kernel's layout ``[layers, *in, *out]``, float32."""
    a, b = adapters[name]["lora_A"], adapters[name]["lora_B"]
    layers, rank = a.shape[0], a.shape[-1]
    a2 = a.astype(jnp.float32).reshape(layers, -1, rank)
    b2 = b.astype(jnp.float32).reshape(layers, rank, -1)
    return (scaling * jnp.einsum("lir,lro->lio", a2, b2)).reshape(tuple(kernel_shape))


def merge_lora(base: Params, adapters: Adapters, lora_cfg: LoraConfig) -> Params:
    """Base params with each targeted kernel replaced by ``W + (alpha/r) B A`` (kernel layout), same dtypes.

    Pure and jit-able; untargeted leaves are the base's own arrays (no copy)."""
    layers = dict(base["model"]["layers"])
    for name in lora_cfg.target_modules:
        if name not in adapters:
            raise ValueError(f"LoRA adapters lack module {name!r} (have {sorted(adapters)})")
        path = LORA_TARGETS[name][0]
        kernel = target_kernel(base, name)
        merged = (kernel.astype(jnp.float32) + lora_delta(adapters, name, kernel.shape, lora_cfg.scaling))
        group = dict(layers[path[0]])
        group[path[1]] = {**group[path[1]], path[2]: merged.astype(kernel.dtype)}
        layers[path[0]] = group
    return {**base, "model": {**base["model"], "layers": layers}}


def trainable_split(params: Params, lora_cfg: LoraConfig, rng: jax.Array | int = 0,
                    adapters: Adapters | None = None) -> tuple[Adapters, Params]:
    """``(trainable, frozen)`` = (adapters — ``adapters`` if given, else fresh `init_lora`, base params)."""
    return (adapters if adapters is not None else init_lora(params, lora_cfg, rng)), params


def combine(trainable: Adapters, frozen: Params, lora_cfg: LoraConfig) -> Params:
    """Full params for the ordinary forward from a `trainable_split`: `merge_lora` (the frozen base under
    ``stop_gradient``, so only the adapters get gradients)."""
    return merge_lora(jax.lax.stop_gradient(frozen), trainable, lora_cfg)


def adapter_logical_axes(base_axes: Params, lora_cfg: LoraConfig) -> Adapters:
    """Logical axes of the adapter tree from the base's (`jaxrl_hf.models.forward.param_logical_axes`):
    ``lora_A (layers, *in, lora_rank)``, ``lora_B (layers, lora_rank, *out)``."""
    out: Adapters = {}
    for name in lora_cfg.target_modules:
        axes = tuple(target_kernel(base_axes, name))
        n_in = LORA_TARGETS[name][1]
        out[name] = {"lora_A": jax.sharding.PartitionSpec(*axes[:1 + n_in], LORA_RANK_AXIS),
                     "lora_B": jax.sharding.PartitionSpec(axes[0], LORA_RANK_AXIS, *axes[1 + n_in:])}
    return out


def adapter_rules(param_rules: Sequence[tuple[str, Any]]) -> tuple[tuple[str, Any], ...]:
    """A params rule set extended by `LORA_PARAM_RULES` (the base's rules are unchanged)."""
    return (*tuple(param_rules), *LORA_PARAM_RULES)


def adapter_param_count(adapters: Adapters) -> int:
    """Number of trainable scalars."""
    return sum(int(x.size) for x in jax.tree.leaves(adapters))


def check_adapters(adapters: Mapping[str, Any], base: Params, lora_cfg: LoraConfig, source: str) -> None:
    """Raise ``ValueError`` naming ``source`` unless ``adapters`` has exactly the configured modules and shapes."""
    if set(adapters) != set(lora_cfg.target_modules):
        raise ValueError(f"{source}: adapter modules {sorted(adapters)} != configured target_modules "
                         f"{sorted(lora_cfg.target_modules)}")
    for name in lora_cfg.target_modules:
        shape = target_kernel(base, name).shape
        ins, outs = _split_dims(shape, name)
        want = {"lora_A": (shape[0], *ins, lora_cfg.rank), "lora_B": (shape[0], lora_cfg.rank, *outs)}
        for key, expected in want.items():
            got = tuple(adapters[name][key].shape)
            if got != expected:
                raise ValueError(f"{source}: {name}.{key} has shape {got}, expected {expected} (rank "
                                 f"{lora_cfg.rank})")

