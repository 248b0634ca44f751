"""The model an SFT / DPO run trains: loading (``tiny`` | known name | HF dir | .gguf), optional LoRA, AdamW with a
warm-up + cosine schedule, the train state, the data order, checkpoints and the HF export.

* ``--model tiny``: a 2-layer random decoder over SmolLM2's tokenizer (smoke runs, CI), as ``launch/train_rm.py``.
* LoRA (``lora_rank > 0``, Hu et al. 2021 via `jaxrl_hf.models.lora`): the base is frozen (no gradients, no
  optimizer state), only the adapters train; the export merges them into the base weights and also writes the
  adapters alone in PEFT's format as ``OUT/hf/lora_adapter`` (as the RL actor's export does).
* Checkpoint (``OUT/checkpoint``): orbax state ``{step, trainable, opt_state}`` + ``worker.json``, written to a
  temporary directory and renamed into place (`jaxrl_hf.workers.checkpoint.save_state`).
* Export (``OUT/hf``): ``config.json`` + ``model.safetensors`` + tokenizer files, the layout
  `jaxrl_hf.models.pretrained.load_pretrained` and ``transformers`` read, so it can be the RL actor's
  ``model.path``; also atomic (`jaxrl_hf.workers.checkpoint.export_hf_dir`). ``OUT/hf/lora_adapter``
  (``adapter_config.json`` + ``adapter_model.safetensors``, `jaxrl_hf.models.lora_peft`) loads with
  ``peft.PeftModel.from_pretrained(base, OUT/hf/lora_adapter)`` on the base model the run started from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_hf.models import DecoderConfig, Tokenizer, init_params, load_pretrained
from jaxrl_hf.models import lora
from jaxrl_hf.models.lora_peft import save_peft_adapter
from jaxrl_hf.models.pretrained import resolve_hf_dir
from jaxrl_hf.workers.checkpoint import export_hf_dir, read_metadata, restore_state, save_state

TOKENIZER_MODEL = "smollm2-135m-instruct"
CHECKPOINT_DIR = "checkpoint"
EXPORT_DIR = "hf"


@dataclass
class Policy:
    """Decoder config, float32 params, tokenizer, the directory its tokenizer files come from, and the HF directory
    holding exactly these base weights (``None``: random ``tiny``, or layers cut by ``num_layers``)."""

    name: str
    config: DecoderConfig
    params: Any
    tokenizer: Tokenizer
    tokenizer_dir: str
    base_dir: str | None = None

    @property
    def eos_id(self) -> int:
        if self.tokenizer.eos_token_id is None:
            raise ValueError(f"tokenizer at {self.tokenizer_dir} defines no eos_token")
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.eos_id if pad is None else int(pad)


def tiny_config(vocab_size: int, eos_id: int, pad_id: int, dtype: str) -> DecoderConfig:
    """A 2-layer random decoder over a real tokenizer's vocabulary (smoke tests, CI)."""
    return DecoderConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                         max_position_embeddings=2048, tie_word_embeddings=True, eos_token_ids=(eos_id,),
                         pad_token_id=pad_id, dtype=dtype)


def load_policy(model: str, seed: int = 0, dtype: str = "float32", remat: str = "full",
                num_layers: int | None = None) -> Policy:
    """``tiny`` (random, module docstring) or anything `load_pretrained` accepts; ``num_layers`` keeps the first K
    decoder layers (fast CPU runs)."""
    if model == "tiny":
        tok_dir = resolve_hf_dir(TOKENIZER_MODEL)
        tokenizer = Tokenizer.from_dir(tok_dir)
        config = tiny_config(tokenizer.vocab_size, tokenizer.eos_token_id, tokenizer.pad_token_id, dtype)
        policy = Policy("tiny", config, init_params(config, seed), tokenizer, tok_dir)
    else:
        lm = load_pretrained(model, dtype=dtype, remat=remat)
        policy = Policy(model, lm.config, lm.params, lm.tokenizer, lm.path, base_dir=lm.path)
    if num_layers is not None:
        if not 1 <= num_layers <= policy.config.num_hidden_layers:
            raise ValueError(f"--num-layers {num_layers} must be in 1..{policy.config.num_hidden_layers}")
        body = dict(policy.params["model"])
        body["layers"] = jax.tree.map(lambda x: x[:num_layers], body["layers"])
        policy.params = {**policy.params, "model": body}
        policy.config = policy.config.replace(num_hidden_layers=num_layers)
        policy.base_dir = None  # no directory holds the cut model
    return policy


def lora_config(rank: int, alpha: float, target_modules: str | None = None) -> lora.LoraConfig | None:
    """``None`` for full fine-tuning (``rank == 0``), else adapters on ``target_modules`` (``all-linear`` or HF module
    names, comma-separated; ``None``: every linear projection). Bad values raise ``ValueError`` naming the option."""
    if rank < 0:
        raise ValueError(f"--lora-rank must be >= 0, got {rank}")
    if not rank:
        return None
    if not alpha > 0:
        raise ValueError(f"--lora-alpha must be > 0, got {alpha}")
    if target_modules is None:
        return lora.LoraConfig(rank=rank, alpha=alpha)
    return lora.LoraConfig(rank, alpha, lora.resolve_target_modules(target_modules, "--target-modules"))


def split_trainable(params: Any, lora_cfg: lora.LoraConfig | None, seed: int) -> tuple[Any, Any]:
    """``(trainable, frozen)``: all params and nothing, or fresh adapters and the base."""
    if lora_cfg is None:
        return params, {}
    return lora.trainable_split(params, lora_cfg, jax.random.key(seed + 17))


def full_params(trainable: Any, frozen: Any, lora_cfg: lora.LoraConfig | None) -> Any:
    """The decoder's params from a `split_trainable` pair (adapters merged into the stop-gradient base)."""
    return trainable if lora_cfg is None else lora.combine(trainable, frozen, lora_cfg)


def lr_schedule(lr: float, warmup_steps: int, total_steps: int, kind: str = "cosine") -> optax.Schedule:
    """Linear warm-up from 0 to ``lr`` over ``warmup_steps``, then constant or cosine decay to ``0.1·lr`` at
    ``total_steps`` (verl's ``optim.lr_scheduler``: ``constant`` | ``cosine``)."""
    if not lr > 0:
        raise ValueError(f"--lr must be > 0, got {lr}")
    if kind not in ("cosine", "constant"):
        raise ValueError(f"--lr-scheduler must be 'cosine' or 'constant', got {kind!r}")
    warmup = max(0, min(warmup_steps, total_steps - 1))
    after = optax.constant_schedule(lr) if kind == "constant" else \
        optax.cosine_decay_schedule(lr, max(total_steps - warmup, 1), alpha=0.1)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def make_optimizer(schedule: optax.Schedule, weight_decay: float = 0.0,
                   max_grad_norm: float = 1.0) -> optax.GradientTransformation:
    """``clip_by_global_norm`` then AdamW (β = 0.9, 0.95); only matrices (ndim >= 2) are decayed."""
    decay_mask = lambda tree: jax.tree.map(lambda x: x.ndim >= 2, tree)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(max_grad_norm),
                       optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=decay_mask))


class TrainState(NamedTuple):
    """Step counter, the trained params (all, or the LoRA adapters) and the optimizer state."""

    step: jax.Array
    trainable: Any
    opt_state: Any


def init_state(trainable: Any, optimizer: optax.GradientTransformation) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), trainable, optimizer.init(trainable))


LENGTH_GROUP_BATCHES = 32
"""With lengths: each epoch's permutation is cut into chunks of about this many batches, each sorted longest first."""


@lru_cache(maxsize=64)
def _epoch_order(seed: int, epoch: int, n: int, lengths: tuple[int, ...] | None, batch_size: int) -> np.ndarray:
    order = np.random.default_rng([seed, epoch]).permutation(n)
    if lengths is None:
        return order
    size = np.asarray(lengths)
    chunks = np.array_split(order, max(1, n // (LENGTH_GROUP_BATCHES * batch_size)))
    return np.concatenate([chunk[np.argsort(-size[chunk], kind="stable")] for chunk in chunks])


def batch_indices(step: int, batch_size: int, num_items: int, seed: int,
                  lengths: tuple[int, ...] | None = None) -> list[int]:
    """Items of step ``step`` (0-based): positions ``step·B .. step·B + B - 1`` of the stream that visits every item
    once per epoch in the order ``permutation_seed,epoch`` (a pure function of the step, so a resumed run sees
    exactly the batches an uninterrupted one would). With the items' ``lengths`` (``--group-by-length``, as
    HF Trainer's ``group_by_length``), each epoch's order is sorted by length within chunks of
    `LENGTH_GROUP_BATCHES` batches, so a batch holds items of similar length and pads less."""
    out = []
    for k in range(step * batch_size, (step + 1) * batch_size):
        epoch, j = divmod(k, num_items)
        out.append(int(_epoch_order(seed, epoch, num_items, lengths, batch_size)[j]))
    return out


def save_checkpoint(out_dir: str, state: TrainState, metadata: dict[str, Any]) -> str:
    """``OUT/checkpoint`` (atomic, see module docstring)."""
    tree = {"step": state.step, "trainable": state.trainable, "opt_state": state.opt_state}
    return save_state(os.path.join(out_dir, CHECKPOINT_DIR), tree, {"step": int(state.step), **metadata})


def restore_checkpoint(out_dir: str, like: TrainState) -> tuple[TrainState, dict[str, Any]]:
    """The state saved in ``OUT/checkpoint``; a missing or partial one raises ``FileNotFoundError`` naming it."""
    path = os.path.join(out_dir, CHECKPOINT_DIR)
    read_metadata(path)
    tree, meta = restore_state(path, {"step": like.step, "trainable": like.trainable, "opt_state": like.opt_state})
    return TrainState(tree["step"], tree["trainable"], tree["opt_state"]), meta


def export_policy(out_dir: str, state: TrainState, frozen: Any, lora_cfg: lora.LoraConfig | None,
                  policy: Policy) -> str:
    """``OUT/hf``: the trained model (LoRA merged) in float32 as an HF directory with the tokenizer files; with LoRA
    also ``OUT/hf/lora_adapter``, the adapters alone in PEFT's format (module docstring)."""
    params, save_adapters = state.trainable, None
    if lora_cfg is not None:
        params = lora.merge_lora(frozen, state.trainable, lora_cfg)
        save_adapters = lambda path: save_peft_adapter(path, state.trainable, lora_cfg, policy.base_dir)  # noqa: E731
    return export_hf_dir(os.path.join(out_dir, EXPORT_DIR), params, policy.config.replace(dtype="float32"),
                         policy.tokenizer_dir, save_adapters, dtype="float32")  # the next stage's model.path
