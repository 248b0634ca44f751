"""Export a saved actor checkpoint as an HF model directory, offline: in this process, on CPU, without Ray or
workers (``launch/export_hf.py``, console script ``jaxrl-hf-export-hf``).

``CHECKPOINT_DIR`` may be a run directory (its newest checkpoint whose files match their completion marker), a
checkpoint directory holding ``global_step_N/`` folders, one ``global_step_N/`` or its ``actor/`` part. Only the
params are read from the orbax state (`jaxrl_hf.workers.checkpoint.read_params`); a LoRA checkpoint (adapters
only) is merged into its base model (``model.path`` of the run's ``config.yaml``) first, and the adapters alone
also go to ``OUT/lora_adapter`` in PEFT's format. The output is what ``trainer.export_hf`` writes at the end of a
run (`jaxrl_hf.models.hf_export`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

from jaxrl_hf.errors import ExitCode, RunError
from jaxrl_hf.trainer.checkpointing import MARKER_FILE, STATE_FILE, CheckpointManager, verify
from jaxrl_hf.workers import checkpoint as worker_ckpt

ACTOR_PART = "actor"
ACTOR_ROLES = ("actor_rollout_ref", "actor_rollout", "ref")  # jaxrl_hf.workers.actor.ROLES: a decoder's params
CONFIG_FILE = "config.yaml"


class ExportError(RunError):
    """The path given to the export is not a usable actor checkpoint."""

    exit_code = ExitCode.CHECKPOINT


def _is_worker_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, worker_ckpt.META_FILE)) and \
        os.path.isdir(os.path.join(path, worker_ckpt.STATE_DIR))


def _is_step_dir(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in (MARKER_FILE, STATE_FILE)) or \
        _is_worker_dir(os.path.join(path, ACTOR_PART))


def resolve_actor_checkpoint(path: str) -> str:
    """The actor worker checkpoint (``.../global_step_N/actor``) that ``path`` names; an `ExportError` naming
    ``path`` when it is none of: a run dir, a checkpoints dir, a ``global_step_N`` dir, an ``actor/`` part."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise ExportError(f"{path}: no such checkpoint directory")
    if _is_worker_dir(path):
        return path
    if _is_step_dir(path):
        problem = verify(path)
        if problem is not None:
            raise ExportError(f"{path} is not a usable checkpoint: {problem}")
        step = path
    else:
        ckpt_dir = next((d for d in (os.path.join(path, "checkpoints"), path)
                         if os.path.isdir(d) and any(n.startswith("global_step_") for n in os.listdir(d))), None)
        if ckpt_dir is None:
            raise ExportError(f"{path} is not a checkpoint: expected a run directory (checkpoints/global_step_N/), a "
                              f"directory of global_step_N/ checkpoints, or one global_step_N/ directory")
        try:
            step = CheckpointManager(ckpt_dir).newest_usable()
        except RunError as err:
            raise ExportError(f"{path}: {err}") from None
        if step is None:
            raise ExportError(f"{ckpt_dir} holds no complete checkpoint")
    actor = os.path.join(step, ACTOR_PART)
    if not _is_worker_dir(actor):
        raise ExportError(f"{step} has no actor checkpoint ({ACTOR_PART}/{worker_ckpt.META_FILE} and "
                          f"{ACTOR_PART}/{worker_ckpt.STATE_DIR}/)")
    return actor


def run_config_of(actor_dir: str) -> Any:
    """The `RunConfig` of the run that wrote ``RUN_DIR/checkpoints/global_step_N/actor`` (its ``config.yaml``, typed
    but not re-validated: the export reads only ``model``), or None when there is none beside the checkpoint."""
    from pathlib import Path

    from jaxrl_hf.config.build import build_dataclass
    from jaxrl_hf.config.loader import read_yaml
    from jaxrl_hf.config.schema import RunConfig

    file = Path(actor_dir).parents[2] / CONFIG_FILE
    if not file.is_file():
        return None
    try:
        return build_dataclass(RunConfig, read_yaml(file))
    except (ValueError, KeyError, TypeError) as err:  # ConfigError is a ValueError
        print(f"jaxrl-hf-export-hf: ignoring {file} ({err})", file=sys.stderr)
        return None


def _merge_lora_base(adapters: Any, run_config: Any, actor_dir: str) -> tuple[Any, Callable[[str], str]]:
    """Base params (``model.path`` of the run) with the LoRA delta ``W + (alpha/r) B A`` of ``adapters`` merged, and
    the writer of the adapters alone in PEFT's format (`jaxrl_hf.models.lora_peft.save_peft_adapter`)."""
    import jax
    import numpy as np

    from jaxrl_hf.models.lora import lora_config_from_model, merge_lora
    from jaxrl_hf.models.lora_peft import save_peft_adapter
    from jaxrl_hf.workers.common import load_model

    if run_config is None or lora_config_from_model(run_config.model) is None:
        raise ExportError(f"{actor_dir} holds LoRA adapters, but no {CONFIG_FILE} with model.lora_rank > 0 was found "
                          f"three levels up (the run directory) to name the base model")
    lora_cfg, base = lora_config_from_model(run_config.model), load_model(run_config.model)
    merged = jax.tree.map(np.asarray, merge_lora(base.params, adapters, lora_cfg))
    return merged, lambda path: save_peft_adapter(path, adapters, lora_cfg, base.path)  # base.path: as the worker


def export_checkpoint(checkpoint: str, out: str, dtype: str = "bfloat16", max_shard_size: int | str = "5GB") -> str:
    """Export the actor of ``checkpoint`` (see `resolve_actor_checkpoint`) to the HF directory ``out``."""
    from jaxrl_hf.models.config import DecoderConfig

    actor = resolve_actor_checkpoint(checkpoint)
    try:
        params, meta = worker_ckpt.read_params(actor)
    except (FileNotFoundError, ValueError) as err:
        raise ExportError(f"{actor}: {err}") from None
    if meta.get("role") not in ACTOR_ROLES or "model_config" not in meta:
        raise ExportError(f"{os.path.join(actor, worker_ckpt.META_FILE)}: role {meta.get('role')!r} is not an actor "
                          f"checkpoint (roles {list(ACTOR_ROLES)}, with a model_config)")
    run_config = run_config_of(actor)
    model_path = meta.get("model_path") or (run_config.model.path if run_config is not None else None)
    tokenizer_dir = None
    if model_path:
        from jaxrl_hf.models.pretrained import tokenizer_dir as tokenizer_dir_of

        try:
            tokenizer_dir = tokenizer_dir_of(model_path)
        except (ValueError, FileNotFoundError, RuntimeError) as err:
            raise ExportError(f"{actor}: the tokenizer files come from the run's model.path={model_path!r}, which "
                              f"cannot be found now ({err})") from None
    save_adapters = None
    if "model" not in params:  # a LoRA checkpoint: adapters only
        params, save_adapters = _merge_lora_base(params, run_config, actor)
    config = DecoderConfig.from_hf_dict(meta["model_config"])
    return worker_ckpt.export_hf_dir(out, params, config, tokenizer_dir, save_adapters, dtype=dtype,
                                     max_shard_size=max_shard_size)


def main(argv: list[str] | None = None) -> int:
    """``jaxrl-hf-export-hf CHECKPOINT_DIR OUT [--dtype ...] [--max-shard-size ...]``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                        help="run dir (its newest complete checkpoint), a global_step_N dir, or its actor/ part")
    parser.add_argument("out", metavar="OUT", help="output HF model directory (replaced if it exists)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB, 2GiB")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    try:
        out = export_checkpoint(args.checkpoint, args.out, args.dtype, args.max_shard_size)
    except (RunError, ValueError) as err:
        print(f"jaxrl-hf-export-hf: {err}", file=sys.stderr)
        return int(getattr(err, "exit_code", ExitCode.CONFIG))
    print(out)
    return 0
