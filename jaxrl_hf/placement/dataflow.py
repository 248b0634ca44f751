"""RL dataflows as the placement search sees them: models, stages and per-stage workloads.

HybridFlow §2.6: the input to the auto-mapping algorithm is the dataflow D — the models with their
sizes and architectures, and per stage the operations (train / infer / generate) with their input and
output shapes.  Stages are barriers: the next stage starts when every operation of the previous one
has finished (PPO: generation → preparation → training).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

OpKind = Literal["train", "infer", "generate"]
OP_KINDS: tuple[str, ...] = ("train", "infer", "generate")


@dataclasses.dataclass(frozen=True)
class ModelArch:
    """A decoder-only transformer (Llama/Qwen2/Qwen3/Mistral/Gemma families). `value_head` replaces the LM head by a
    scalar head (critic, reward and cost models)."""

    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab: int
    tied_embeddings: bool = False
    value_head: bool = False

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelArch.{field} must be positive, got {getattr(self, field)}")
        if self.hidden % self.num_heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} not divisible by num_kv_heads={self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer: q,o (h×h), k,v (h×g·hd), SwiGLU (3·h·f), two RMSNorms."""
        h, kv = self.hidden, self.num_kv_heads * self.head_dim
        return 2 * h * h + 2 * h * kv + 3 * h * self.ffn_hidden + 2 * h

    @property
    def head_params(self) -> int:
        """Output head: the LM head (h×V, shared with the embedding when tied) or a value head (h)."""
        if self.value_head:
            return self.hidden
        return 0 if self.tied_embeddings else self.hidden * self.vocab

    @property
    def num_params(self) -> int:
        """Total parameter count: embedding + layers + final norm + head."""
        return self.vocab * self.hidden + self.num_layers * self.layer_params + self.hidden + self.head_params

    @property
    def head_width(self) -> int:
        """Output width of the head: the vocabulary, or 1 for a value head."""
        return 1 if self.value_head else self.vocab

    def forward_flops_per_token(self, context: int) -> float:
        """Matmul FLOPs of one token's forward pass attending to `context` positions (dense
        attention): 2·(layer weights) + 4·L·h·context (QKᵀ and AV) + 2·h·head_width."""
        weights = self.num_layers * (self.layer_params - 2 * self.hidden)
        return 2.0 * weights + 4.0 * self.num_layers * self.hidden * context + 2.0 * self.hidden * self.head_width

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes per token over all layers: 2 (K and V) · L · g · hd · bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def with_value_head(self) -> "ModelArch":
        return dataclasses.replace(self, value_head=True)


# Published architectures (Llama-2 7B/13B/70B, CodeLlama-34B, Qwen2.5-7B/32B, SmolLM2-135M).
ARCHS: dict[str, ModelArch] = {
    "7b": ModelArch(32, 4096, 32, 32, 11008, 32000),
    "13b": ModelArch(40, 5120, 40, 40, 13824, 32000),
    "34b": ModelArch(48, 8192, 64, 8, 22016, 32000),
    "70b": ModelArch(80, 8192, 64, 8, 28672, 32000),
    "qwen2.5-7b": ModelArch(28, 3584, 28, 4, 18944, 152064),
    "qwen2.5-32b": ModelArch(64, 5120, 40, 8, 27648, 152064),
    "smollm2-135m": ModelArch(30, 576, 9, 3, 1536, 49152, tied_embeddings=True),
}


def arch_by_name(name: str) -> ModelArch:
    """Look up a preset architecture; the error lists the valid names."""
    key = name.lower()
    if key not in ARCHS:
        raise ValueError(f"unknown model size {name!r}; valid: {sorted(ARCHS)}")
    return ARCHS[key]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model (role) of the dataflow."""

    name: str
    arch: ModelArch
    trainable: bool


@dataclasses.dataclass(frozen=True)
class Workload:
    """One operation of a model in a stage (HybridFlow's W: shapes and the compute operation).

    train: `num_sequences` of length prompt+response, `epochs` passes, `optimizer_steps` updates
    per epoch.  infer: one forward pass over the sequences.  generate: prefill the prompts, then
    decode `response_len` tokens autoregressively.
    """

    kind: OpKind
    num_sequences: int
    prompt_len: int
    response_len: int
    epochs: int = 1
    optimizer_steps: int = 1

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"Workload.kind {self.kind!r} invalid; valid: {list(OP_KINDS)}")
        for field in ("num_sequences", "epochs", "optimizer_steps"):
            if getattr(self, field) < 1:
                raise ValueError(f"Workload.{field} must be >= 1, got {getattr(self, field)}")
        if self.prompt_len < 1 or self.response_len < 0:
            raise ValueError(f"Workload lengths invalid: prompt={self.prompt_len} response={self.response_len}")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len


@dataclasses.dataclass(frozen=True)
class Op:
    model: str
    workload: Workload


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    ops: tuple[Op, ...]


@dataclasses.dataclass(frozen=True)
class Dataflow:
    """Models plus the ordered stages of one RL iteration."""

    algo: str
    models: tuple[ModelSpec, ...]
    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate model names in dataflow {self.algo}: {names}")
        for stage in self.stages:
            for op in stage.ops:
                if op.model not in names:
                    raise ValueError(f"stage {stage.name!r} uses unknown model {op.model!r}; models: {names}")
                if op.workload.kind == "train" and not self.model(op.model).trainable:
                    raise ValueError(f"stage {stage.name!r} trains frozen model {op.model!r}")

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.models)

    def model(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(f"no model {name!r} in dataflow {self.algo}; models: {list(self.model_names)}")

    def ops_of(self, name: str) -> tuple[tuple[str, Workload], ...]:
        """(stage name, workload) of every operation of one model, in dataflow order."""
        return tuple((s.name, op.workload) for s in self.stages for op in s.ops if op.model == name)


@dataclasses.dataclass(frozen=True)
class RolloutShape:
    """The batch shape of one RL iteration.  Defaults (1024 prompts of 1024 tokens, 1024 response
    tokens, 4 PPO mini-batches) are the shape we use for the paper's setting; the seeds do not give
    the exact batch of the HybridFlow evaluation."""

    prompts: int = 1024
    samples_per_prompt: int = 1
    prompt_len: int = 1024
    response_len: int = 1024
    ppo_epochs: int = 1
    mini_batches: int = 4

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 1:
                raise ValueError(f"RolloutShape.{f.name} must be >= 1, got {getattr(self, f.name)}")

    @property
    def sequences(self) -> int:
        return self.prompts * self.samples_per_prompt


ALGOS: tuple[str, ...] = ("ppo", "grpo", "dapo", "remax", "safe_rlhf")


def build_dataflow(algo: str, arch: ModelArch, shape: RolloutShape = RolloutShape(),
                   reward_arch: ModelArch | None = None) -> Dataflow:
    """The dataflow of one iteration of `algo` (HybridFlow Fig. 1/§2.4 control flows).

    ppo: actor generates → critic values, ref log-probs, reward scores → actor and critic update.
    grpo: actor generates n samples → ref log-probs → actor updates (rule reward: no model).
    dapo: actor generates (no KL, rule reward: the actor is the only model) → actor updates.
    remax: actor samples and decodes greedily (baseline) → ref, reward → actor updates.
    safe_rlhf: ppo plus a cost model in preparation and a pretraining (ptx) batch in the update.
    Critic, reward and cost models share the actor's architecture with a value head unless
    `reward_arch` is given (as in the paper's experiments, all models have the same size).
    """
    algo = algo.lower()
    if algo not in ALGOS:
        raise ValueError(f"unknown algo {algo!r}; valid: {list(ALGOS)}")
    value_arch = (reward_arch or arch).with_value_head()
    n, p, r = shape.sequences, shape.prompt_len, shape.response_len
    gen = Workload("generate", n, p, r)
    fwd = Workload("infer", n, p, r)
    upd = Workload("train", n, p, r, epochs=shape.ppo_epochs, optimizer_steps=shape.mini_batches)
    actor = ModelSpec("actor", arch, trainable=True)
    critic = ModelSpec("critic", value_arch, trainable=True)
    ref = ModelSpec("ref", arch, trainable=False)
    reward = ModelSpec("reward", value_arch, trainable=False)
    if algo == "ppo":
        models = (actor, critic, ref, reward)
        stages = (Stage("generation", (Op("actor", gen),)),
                  Stage("preparation", (Op("critic", fwd), Op("ref", fwd), Op("reward", fwd))),
                  Stage("training", (Op("actor", upd), Op("critic", upd))))
    elif algo == "grpo":
        models = (actor, ref)
        stages = (Stage("generation", (Op("actor", gen),)),
                  Stage("preparation", (Op("ref", fwd),)),
                  Stage("training", (Op("actor", upd),)))
    elif algo == "dapo":
        models = (actor,)
        stages = (Stage("generation", (Op("actor", gen),)),
                  Stage("training", (Op("actor", upd),)))
    elif algo == "remax":
        greedy = Workload("generate", shape.prompts, p, r)
        models = (actor, ref, reward)
        stages = (Stage("generation", (Op("actor", gen), Op("actor", greedy))),
                  Stage("preparation", (Op("ref", fwd), Op("reward", fwd),
                                        Op("reward", Workload("infer", shape.prompts, p, r)))),
                  Stage("training", (Op("actor", upd),)))
    else:  # safe_rlhf
        cost = ModelSpec("cost", value_arch, trainable=False)
        ptx = Workload("train", n, p + r, 1, epochs=shape.ppo_epochs, optimizer_steps=shape.mini_batches)
        models = (actor, critic, ref, reward, cost)
        stages = (Stage("generation", (Op("actor", gen),)),
                  Stage("preparation", (Op("critic", fwd), Op("ref", fwd), Op("reward", fwd), Op("cost", fwd))),
                  Stage("training", (Op("actor", upd), Op("actor", ptx), Op("critic", upd))))
    return Dataflow(algo, models, stages)
