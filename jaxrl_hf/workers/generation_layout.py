"""The actor's generation layout: the 3D-HybridEngine reshard around each rollout (HybridFlow §2.5).

The actor trains with ``p-t-d`` (``placement.train``) and may generate with a smaller model-parallel
group ``p_g-t_g`` (``placement.generate``) on the same devices, the spare factor ``d_g = p·t/(p_g·t_g)``
becoming micro data parallelism (§2.5.1). Before a rollout `GenerationLayout.to_generation` turns the
training params into generation-layout params with `mesh.HybridEngine`: all-gathers inside the micro-DP
groups (and over ``dp`` too when the training rule set shards the params there: ``actor.strategy=fsdp``);
every device's generation shard contains its training shard (§2.5.3), so the training buffers are consumed
and nothing is held twice. The reshard runs leaf by leaf and ``layers_per_group`` stacked layers at a time
(`jaxrl_hf.mesh.chunked_reshard`), so the peak parameter memory is about the generation shard rather than
training + generation shard. After the rollout `to_training` slices the training shards back out (no
communication, bit-identical) and frees the generation copy, so the training memory is what it was before
the rollout.

`generation_parallel` reads and validates ``placement.generate``; ``None`` means the layouts are equal
and the actor generates on its training mesh (no reshard).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxrl_hf import mesh as meshlib
from jaxrl_hf.config.schema import PlacementConfig
from jaxrl_hf.workers.common import WorkerConfigError


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def jax_generation_placement(placement: PlacementConfig, rollout_name: str) -> PlacementConfig:
    """The placement whose ``generate`` sizes lay out JAX's generation: as given for the native engine; for vLLM
    without ``generate.tp``, which is vLLM's own TP size (`jaxrl_hf.rollout.vllm_tp`), not a JAX layout."""
    if rollout_name != "vllm":
        return placement
    return dataclasses.replace(placement, generate=dataclasses.replace(placement.generate, tp=None))


def generation_parallel(placement: PlacementConfig, train: meshlib.TrainParallel, where: str = "placement",
                        rule_set: meshlib.RuleSet = meshlib.MEGATRON) -> meshlib.GenParallel | None:
    """``placement.generate.{pp,tp}`` as a `mesh.GenParallel` over ``train``, or ``None`` when equal to the
    training pp/tp and the training ``rule_set`` keeps the params whole over ``dp`` (no reshard; an unset size
    means the training one). A rule set sharding them over ``dp`` (``fsdp``) always gets a layout (``d_g = 1``
    when equal): each rollout gathers the params over ``dp`` and frees them after, instead of the engine holding
    a second, gathered copy. So does sequence-parallel training (``train.sp > 1``): generation does not split
    sequences, and its mesh spreads the rows over the whole data-parallel world (``dp·sp`` devices). Each
    generation size must divide the training size (the paper's grouping takes generation groups at the integral
    strides ``p/p_g``, ``t/t_g``); errors name the key and list the valid values."""
    sizes = {}
    for name, train_size in (("pp", train.pp), ("tp", train.tp)):
        value = getattr(placement.generate, name)
        if value is None:
            value = train_size
        valid = _divisors(train_size)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value not in valid:
            raise WorkerConfigError(
                f"{where}.generate.{name}={value!r}: must divide {where}.train.{name}={train_size} "
                f"(3D-HybridEngine, HybridFlow §2.5); valid: {valid}")
        sizes[name] = int(value)
    if (sizes["pp"], sizes["tp"]) == (train.pp, train.tp) and "dp" not in rule_set.param_mesh_axes() \
            and train.sp == 1:
        return None
    return meshlib.GenParallel(train, sizes["pp"], sizes["tp"])


@dataclasses.dataclass
class GenerationLayout:
    """The generation mesh, its activation rules and the train<->generation reshard of one actor.

    ``logical_axes``: the decoder's logical-axis tree; ``param_shapes``: matching shapes/dtypes.
    ``train_shardings`` is the layout the actor must keep its params in between rollouts (the actor's
    training rule set, `jaxrl_hf.workers.common.train_rule_set`); the generation layout derives from it.
    """

    gen: meshlib.GenParallel
    engine: meshlib.HybridEngine

    @classmethod
    def build(cls, gen: meshlib.GenParallel, logical_axes: Any, param_shapes: Any,
              devices: Any = None, rule_set: meshlib.RuleSet = meshlib.MEGATRON,
              layers_per_group: int | None = meshlib.DEFAULT_LAYERS_PER_GROUP) -> "GenerationLayout":
        """Meshes and compiled-on-first-use reshard programs for ``gen`` over ``devices`` (rank order), from the
        training layout ``rule_set``; ``layers_per_group`` stacked layers per reshard program (``None``: one
        program for the whole tree, peak = training + generation shard)."""
        return cls(gen, meshlib.HybridEngine(gen, logical_axes, param_shapes, devices, rule_set, layers_per_group))

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """Generation mesh: axes ``('pp_g','tp_g','dg','dp')`` or a permutation/split of ``dg`` (mesh/)."""
        return self.engine.meshes.generation

    @property
    def train_mesh(self) -> jax.sharding.Mesh:
        return self.engine.meshes.train

    @property
    def activation_rules(self) -> meshlib.Rules:
        """Generation activation rules: the ``batch`` logical axis over the data axes ``dg`` (+ split) and ``dp``."""
        return self.engine.rule_set.on_generation_mesh(self.engine.meshes.dg_axes).activations

    @property
    def train_shardings(self) -> Any:
        return self.engine.train_shardings

    @property
    def gen_shardings(self) -> Any:
        return self.engine.gen_shardings

    def check_train_shardings(self, shardings: Any, where: str = "actor params") -> None:
        """Raise unless ``shardings`` equal the reshard's training shardings leaf by leaf (a mismatch would
        make every reshard a full relayout)."""
        mine = jax.tree.leaves(self.train_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
        theirs = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding))
        bad = [i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b]
        if len(mine) != len(theirs) or bad:
            raise AssertionError(f"{where}: training shardings differ from the 3D-HybridEngine's at leaves {bad}")

    def check_process_rows(self, train_mesh: jax.sharding.Mesh, train: meshlib.TrainParallel,
                           gen: meshlib.GenParallel) -> None:
        """Several processes: every process's rows (its training dp shard on ``train_mesh``) must live on the
        generation-mesh batch shards of its own devices (`jaxrl_hf.rollout.multiprocess`); else a clear config
        error now rather than at the first rollout."""
        if jax.process_count() == 1:
            return
        from jaxrl_hf.controller.layout import coords_from_mesh
        from jaxrl_hf.rollout import multiprocess

        slabs = multiprocess.process_batch_slabs(self.mesh, self.activation_rules)
        groups = {p: coords_from_mesh(train_mesh, p).dp_rank for p in slabs}
        try:
            multiprocess.check_row_groups(slabs, groups)
        except ValueError as err:
            sp = (" and each Ulysses group (actor.ulysses_sequence_parallel_size: its devices share rows in training, "
                  "not in generation)" if train.sp > 1 else "")
            raise WorkerConfigError(
                f"placement.num_processes={jax.process_count()} with placement.generate={gen.label()} over "
                f"placement.train={train.label()}: {err}. Keep each training replica's generation micro-DP "
                f"group{sp} inside one process (a placement.generate whose micro-DP groups stay on one process), use "
                "placement.num_processes=1, or leave placement.generate unset") from None

    def to_generation(self, train_params: Any) -> Any:
        """Generation-layout params; ``train_params`` are consumed (their buffers freed)."""
        return self.engine.to_generation(train_params)

    def to_training(self, gen_params: Any) -> Any:
        """Training-layout params sliced out of ``gen_params`` (bit-identical); ``gen_params`` are freed."""
        return self.engine.to_training(gen_params)

    def describe(self) -> dict[str, Any]:
        """Small JSON-able summary: layouts, ``d_g`` and the generation mesh shape."""
        return {"train": self.gen.train.label(), "generate": self.gen.label(), "dg": self.gen.dg,
                "generation_mesh": dict(self.mesh.shape)}
