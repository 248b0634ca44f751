"""Named logical-axis rule sets, declared as data and looked up by name (verl's ``actor.strategy``).

A rule set says where every logical axis of the model goes on the training mesh ``('pp','tp','dp')`` (``+ 'sp'``
with sequence parallelism): ``params`` for the parameters (and so for their gradients and Adam moments, which
follow them) and ``activations`` for the ``flax`` activation constraints. Each is a tuple of ``(logical_axis,
mesh_axes)`` pairs in priority order, resolved by the one resolver `jaxrl_hf.mesh.rules.logical_to_spec`.
Activations carry the names ``batch``, ``length``, ``embed``, ... and, inside attention (around the score and
value products), ``attn_length``, ``attn_heads``, ``attn_kv_heads``.

Declared here (`RULE_SETS`, `get_rule_set`):

* ``megatron``: tensor dims (vocab, heads, kv_heads, mlp) over ``tp``, layers over ``pp``, ``embed``
  filling whichever of ``pp``/``tp`` is still free; replicated over ``dp``.
* ``fsdp`` (alias ``fsdp2``): ZeRO-3: layers over ``pp``, ``embed`` (every Llama param has it) over ``dp``;
  tensor dims replicated. On a mesh with ``tp > 1`` the name resolves to ``fsdp_tp`` (`RuleSet.tp_variant`,
  `rule_set_for_strategy`): replicating the params over ``tp`` would only repeat the same work there.
* ``fsdp_tp``: ``megatron`` plus ``dp`` on the ``embed`` axis (dp minor-most, so each device's shard is a
  slice of its megatron shard).
* ``fsdp_tp_ep``: ``fsdp_tp`` with a mixture of experts' ``expert`` axis over ``tp`` (expert parallelism: whole
  experts per device instead of each expert split over ``tp``; the same as ``fsdp_tp`` for a dense model).
* ``sp``, ``fsdp_sp``, ``fsdp_tp_sp``: the sequence-parallel (Ulysses) variants of the three, which the
  names above resolve to on a training mesh with an ``sp`` axis (`RuleSet.sp_variant`), derived by
  `sequence_parallel`: the data-parallel world is ``dp × sp``, so params over ``dp`` go over ``('dp','sp')``
  (ZeRO-3 over the whole world, as verl's FSDP with Ulysses) and params replicated over ``dp`` stay
  replicated over ``sp``; rows (``batch``) stay over ``dp``, while `SEQUENCE_PARALLEL_DIMS` also go over
  ``sp``: the sequence (``length``) outside attention, the heads (``attn_heads``, ``attn_kv_heads``) inside it,
  where the sequence is whole (``attn_length``). The switch between the two is an all-to-all within each
  ``sp`` group, which XLA's SPMD partitioner emits from the constraints alone.

The generation layout of the 3D-HybridEngine is derived from a rule set by data, not by a second
resolver: `RuleSet.for_transition` orders the multi-axis ``pp``/``tp`` rule for a train -> generation
transition, `RuleSet.on_generation_mesh` renames ``pp``/``tp`` to ``pp_g``/``tp_g``, drops ``dp`` and
``sp`` from the params (replicated over the micro-DP and DP groups) and ``sp`` from the activations (generation
does not split the sequence), and spreads the activations' batch over the micro-DP axes and ``dp`` (the whole
data-parallel world).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from jaxrl_hf.mesh.topology import GenParallel
from jaxrl_hf.registry import Registry

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]


class NamedRules(tuple):
    """A `Rules` tuple that knows which rule set it came from (the resolver names it in its errors)."""

    name: str

    def __new__(cls, rules: Sequence[tuple[str, MeshAxes]], name: str) -> "NamedRules":
        self = super().__new__(cls, tuple((str(n), _normalized(a)) for n, a in rules))
        self.name = name
        return self

    def __reduce__(self) -> tuple:
        return (NamedRules, (tuple(self), self.name))


def _normalized(axes: MeshAxes) -> MeshAxes:
    """``None``, one axis name, or a tuple of at least two names (one-name tuples become the name)."""
    if axes is None or isinstance(axes, str):
        return axes
    axes = tuple(axes)
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _axis_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def rename_mesh_axes(rules: Rules, mapping: Mapping[str, tuple[str, ...]], name: str) -> NamedRules:
    """``rules`` with each mesh axis replaced by the axes ``mapping`` gives it (``()`` drops it; unmapped
    axes stay). A rule left without axes is dropped; a logical axis left without any rule is replicated."""
    out: list[tuple[str, MeshAxes]] = []
    for logical, axes in rules:
        if axes is None:
            out.append((logical, None))
            continue
        renamed = tuple(m for a in _axis_tuple(axes) for m in mapping.get(a, (a,)))
        if renamed:
            out.append((logical, renamed))
    covered = {logical for logical, _ in out}
    for logical in dict.fromkeys(n for n, _ in rules):
        if logical not in covered:
            out.append((logical, None))
    return NamedRules(out, name)


def one_dim_embed_order(gen: GenParallel | None) -> tuple[str, str] | None:
    """Major order ('pp','tp') or ('tp','pp') of a dimension split over both, such that the generation
    block contains the training block: pp-major works iff ``p/p_g = 1`` or ``t_g = 1``; tp-major iff
    ``t/t_g = 1`` or ``p_g = 1``; otherwise (needs p, t >= 4) there is none (``None``)."""
    if gen is None or gen.pp_stride == 1 or gen.tp == 1:
        return ("pp", "tp")
    if gen.tp_stride == 1 or gen.pp == 1:
        return ("tp", "pp")
    return None


def _oriented(rules: Rules, order: tuple[str, str] | None, name: str) -> NamedRules:
    """Rules over both ``pp`` and ``tp`` take ``order`` for those two (other axes keep their place), or are
    dropped when ``order`` is ``None``."""
    out: list[tuple[str, MeshAxes]] = []
    for logical, axes in rules:
        names = _axis_tuple(axes)
        if {"pp", "tp"} <= set(names):
            if order is None:
                continue
            swap = iter(order)
            axes = tuple(next(swap) if a in ("pp", "tp") else a for a in names)
        out.append((logical, axes))
    return NamedRules(out, name)


@dataclasses.dataclass(frozen=True)
class RuleSet:
    """One named layout: ``params`` and ``activations`` rules (see the module docstring).

    ``tp_variant``: the rule set this one stands for on a training mesh with ``tp > 1`` (``None``: itself);
    ``sp_variant``: the one it stands for on a training mesh with an ``sp`` axis (``None``: none; such a rule set
    cannot train with sequence parallelism unless it names ``sp`` itself).
    """

    name: str
    params: Rules
    activations: Rules
    summary: str
    tp_variant: str | None = None
    sp_variant: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", NamedRules(self.params, f"{self.name!r} params"))
        object.__setattr__(self, "activations", NamedRules(self.activations, f"{self.name!r} activations"))

    def mesh_axes(self) -> frozenset[str]:
        """Every mesh axis name the rules use (the mesh must have them)."""
        return self.param_mesh_axes() | frozenset(a for _, axes in self.activations for a in _axis_tuple(axes))

    def param_mesh_axes(self) -> frozenset[str]:
        """The mesh axes the params are sharded over (``dp`` among them: ZeRO-3)."""
        return frozenset(a for _, axes in self.params for a in _axis_tuple(axes))

    def for_transition(self, gen: GenParallel | None) -> "RuleSet":
        """The training layout of a train -> ``gen`` transition: the rule set with its ``pp``×``tp`` rules
        ordered by `one_dim_embed_order` (``gen = None``: no transition, the rules as declared)."""
        if gen is None:
            return self
        return dataclasses.replace(self, params=_oriented(self.params, one_dim_embed_order(gen), self.name))

    def on_generation_mesh(self, dg_axes: Sequence[str] = ("dg",)) -> "RuleSet":
        """The generation layout on ``('pp_g','tp_g', *dg_axes, 'dp')``: params over ``pp_g``/``tp_g`` only
        (replicated over micro-DP and DP), activations' batch over ``dg_axes + ('dp',)``."""
        base = {"pp": ("pp_g",), "tp": ("tp_g",), "sp": ()}
        name = f"{self.name}@generation"
        return RuleSet(name, rename_mesh_axes(self.params, {**base, "dp": ()}, name),
                       rename_mesh_axes(self.activations, {**base, "dp": (*dg_axes, "dp")}, name),
                       f"generation layout of {self.name!r}")


RULE_SETS: Registry = Registry("sharding rule set")


def register_rule_set(rule_set: RuleSet, *, name: str | None = None, override: bool = False) -> RuleSet:
    """Register ``rule_set`` under its own name (or ``name``, e.g. an alias); a taken name is an error unless
    ``override`` (so a typo cannot silently replace a built-in layout)."""
    return RULE_SETS.register(name or rule_set.name, override=override)(rule_set)


def get_rule_set(name: str) -> RuleSet:
    """The rule set registered as ``name``; an unknown name raises ``ValueError`` listing the valid ones."""
    return RULE_SETS.get(name)


def rule_set_for_strategy(name: str, tp: int = 1, sp: int = 1) -> RuleSet:
    """The rule set a strategy name selects on a training mesh with ``tp`` tensor shards (`RuleSet.tp_variant`)
    and ``sp``-way sequence parallelism (`RuleSet.sp_variant`, taken after the tp variant)."""
    rule_set = get_rule_set(name)
    if tp > 1 and rule_set.tp_variant is not None:
        rule_set = get_rule_set(rule_set.tp_variant)
    if sp > 1 and rule_set.sp_variant is not None:
        rule_set = get_rule_set(rule_set.sp_variant)
    return rule_set


SEQUENCE_PARALLEL_DIMS = ("length", "attn_heads", "attn_kv_heads")
"""Activation axes a sequence-parallel variant also splits over ``sp``: the sequence outside attention, the heads
inside it (DeepSpeed-Ulysses, Jacobs et al. 2023, §3: all-to-all from sequence- to head-sharded and back)."""


def sequence_parallel(base: RuleSet, name: str, summary: str, tp_variant: str | None = None) -> RuleSet:
    """``base`` on a training mesh ``('pp','tp','dp','sp')`` (module docstring): param rules over ``dp`` go over
    ``('dp','sp')`` (sp minor-most, as on the mesh), activation rules of `SEQUENCE_PARALLEL_DIMS` get ``sp``
    appended (minor to ``tp``: a device's heads inside attention are a slice of its tensor-parallel heads, so the
    all-to-all stays inside its sp group); ``batch`` and everything else as in ``base``."""
    params = rename_mesh_axes(base.params, {"dp": ("dp", "sp")}, name)
    activations = tuple((n, (*_axis_tuple(a), "sp")) if n in SEQUENCE_PARALLEL_DIMS else (n, a)
                        for n, a in base.activations)
    return RuleSet(name, params, activations, summary, tp_variant=tp_variant)


# ---------------------------------------------------------------------------------------------- declarations
_TENSOR_DIMS = ("vocab", "heads", "kv_heads", "mlp")
_ACTIVATION_DIMS = ("length", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab", "layers", "attn_length",
                    "attn_heads", "attn_kv_heads")

MEGATRON = register_rule_set(RuleSet(
    "megatron",
    params=(("layers", "pp"), *((n, "tp") for n in _TENSOR_DIMS),
            ("embed", ("pp", "tp")), ("embed", "pp"), ("embed", "tp"), ("head_dim", None)),
    activations=(("batch", "dp"), ("length", None), ("embed", None), ("heads", "tp"), ("kv_heads", "tp"),
                 ("head_dim", None), ("mlp", "tp"), ("vocab", "tp"), ("layers", None),
                 ("attn_length", None), ("attn_heads", "tp"), ("attn_kv_heads", "tp")),
    summary="Megatron-style tensor parallelism over tp, layers over pp, params replicated over dp",
    sp_variant="sp"))

FSDP_TP = register_rule_set(RuleSet(
    "fsdp_tp",
    params=(("layers", "pp"), *((n, "tp") for n in _TENSOR_DIMS),
            ("embed", ("pp", "tp", "dp")), ("embed", ("pp", "dp")), ("embed", ("tp", "dp")), ("embed", "dp"),
            ("head_dim", None)),
    activations=MEGATRON.activations,
    summary="megatron plus ZeRO-3: params (so grads and Adam moments) also sharded over dp on embed",
    sp_variant="fsdp_tp_sp"))

FSDP = register_rule_set(RuleSet(
    "fsdp",
    params=(("layers", "pp"), *((n, None) for n in _TENSOR_DIMS), ("embed", ("pp", "dp")), ("embed", "dp"),
            ("head_dim", None)),
    activations=(("batch", "dp"), *((n, None) for n in _ACTIVATION_DIMS)),
    summary="ZeRO-3 (verl's fsdp/fsdp2): params sharded over dp on embed, layers over pp, no tensor parallelism",
    tp_variant="fsdp_tp", sp_variant="fsdp_sp"))
register_rule_set(FSDP, name="fsdp2")  # verl's spelling

FSDP_TP_EP = register_rule_set(RuleSet(
    "fsdp_tp_ep",
    params=(("expert", "tp"), *FSDP_TP.params),
    activations=(("expert", "tp"), *MEGATRON.activations),
    summary="fsdp_tp with expert parallelism over tp: each tp device holds E/tp whole experts of every MoE layer "
            "(their other dims ZeRO-3 over dp) and computes them for its tokens (`jaxrl_hf.models.expert_parallel`)"))

SP = register_rule_set(sequence_parallel(
    MEGATRON, "sp", "megatron with Ulysses sequence parallelism: activations' sequence (heads inside attention) "
    "over sp, params replicated over dp and sp"))
FSDP_TP_SP = register_rule_set(sequence_parallel(
    FSDP_TP, "fsdp_tp_sp", "fsdp_tp with Ulysses sequence parallelism: params ZeRO-3 over dp×sp, sequence over sp"))
FSDP_SP = register_rule_set(sequence_parallel(
    FSDP, "fsdp_sp", "fsdp with Ulysses sequence parallelism: params ZeRO-3 over dp×sp (verl's FSDP + Ulysses), "
    "activations' sequence (heads inside attention) over sp", tp_variant="fsdp_tp_sp"))
