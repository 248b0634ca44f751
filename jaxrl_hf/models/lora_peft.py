"""LoRA export/import: PEFT's adapter format (``adapter_config.json`` + ``adapter_model.safetensors``) and merged HF dirs.

PEFT names a causal LM's adapter tensors ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight``
(``[r, in]``) and ``...lora_B.weight`` (``[out, r]``), the ``nn.Linear`` convention; ours are stacked
``lora_A [layers, *in, r]`` / ``lora_B [layers, r, *out]`` (`jaxrl_hf.models.lora`), so the conversion is a
reshape and a transpose per layer, exact both ways. The written directory loads with
``peft.PeftModel.from_pretrained(transformers_model, path)``; a merged export is an ordinary HF dir
(`jaxrl_hf.models.weights_hf.save_hf_dir` of `merge_lora`), loadable by transformers and vLLM.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.lora import (HF_MODULE_PREFIX, LORA_TARGETS, Adapters, LoraConfig, check_adapters, merge_lora,
                                  target_kernel)
from jaxrl_hf.models.weights_hf import save_hf_dir

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_key(layer: int, module: str, which: str) -> str:
    """PEFT's tensor name, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return f"base_model.model.model.layers.{layer}.{HF_MODULE_PREFIX[module]}.{module}.{which}.weight"


def adapters_to_peft_state_dict(adapters: Adapters) -> dict[str, np.ndarray]:
    """PEFT-named float32 tensors (``lora_A [r, in]``, ``lora_B [out, r]``) from the stacked adapter tree."""
    host = jax.device_get(adapters)
    state: dict[str, np.ndarray] = {}
    for module, pair in host.items():
        a, b = np.asarray(pair["lora_A"], np.float32), np.asarray(pair["lora_B"], np.float32)
        layers, rank = a.shape[0], a.shape[-1]
        for i in range(layers):
            state[peft_key(i, module, "lora_A")] = np.ascontiguousarray(a[i].reshape(-1, rank).T)
            state[peft_key(i, module, "lora_B")] = np.ascontiguousarray(b[i].reshape(rank, -1).T)
    return state


def peft_adapter_config(lora_cfg: LoraConfig, base_model_name_or_path: str | None = None) -> dict[str, Any]:
    """PEFT ``LoraConfig`` fields for a plain LoRA on a causal LM (no dropout, no bias, no rsLoRA)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": int(lora_cfg.rank), "lora_alpha": lora_cfg.alpha,
        "target_modules": list(lora_cfg.target_modules), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "inference_mode": True, "base_model_name_or_path": base_model_name_or_path,
    }


def save_peft_adapter(path: str | os.PathLike, adapters: Adapters, lora_cfg: LoraConfig,
                      base_model_name_or_path: str | None = None) -> str:
    """Write the adapter-only export (PEFT format) into directory ``path``; returns ``path``."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_file(adapters_to_peft_state_dict(adapters), os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_adapter_config(lora_cfg, base_model_name_or_path), f, indent=2)
    return path


def load_peft_adapter(path: str | os.PathLike, base: Mapping[str, Any],
                      config: DecoderConfig) -> tuple[Adapters, LoraConfig]:
    """Read a PEFT LoRA directory back into ``(adapters, LoraConfig)`` for ``base``; shape or name mismatches raise
    ``ValueError`` naming the file and tensor."""
    path = os.fspath(path)
    cfg_path, weights_path = os.path.join(path, ADAPTER_CONFIG), os.path.join(path, ADAPTER_WEIGHTS)
    for p in (cfg_path, weights_path):
        if not os.path.isfile(p):
            raise ValueError(f"{p}: missing (a PEFT adapter dir has {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    with open(cfg_path) as f:
        meta = json.load(f)
    if meta.get("peft_type") != "LORA" or meta.get("use_dora") or meta.get("use_rslora"):
        raise ValueError(f"{cfg_path}: only plain LoRA is supported (peft_type=LORA, no DoRA/rsLoRA)")
    lora_cfg = LoraConfig(int(meta["r"]), float(meta["lora_alpha"]), tuple(meta["target_modules"]))
    state = load_file(weights_path)
    kernel_shapes = {m: _kernel_shape(base, m) for m in lora_cfg.target_modules}
    adapters: Adapters = {}
    for module, shape in kernel_shapes.items():
        n_in = LORA_TARGETS[module][1]
        ins, outs = shape[1:1 + n_in], shape[1 + n_in:]
        a_layers, b_layers = [], []
        for i in range(config.num_hidden_layers):
            ka, kb = peft_key(i, module, "lora_A"), peft_key(i, module, "lora_B")
            for k in (ka, kb):
                if k not in state:
                    raise ValueError(f"{weights_path}: tensor {k} is missing")
            a_layers.append(state.pop(ka).T.reshape(*ins, lora_cfg.rank))
            b_layers.append(state.pop(kb).T.reshape(lora_cfg.rank, *outs))
        adapters[module] = {"lora_A": np.stack(a_layers).astype(np.float32),
                            "lora_B": np.stack(b_layers).astype(np.float32)}
    if state:
        raise ValueError(f"{weights_path}: unexpected tensors {sorted(state)[:5]}")
    check_adapters(adapters, dict(base), lora_cfg, weights_path)
    return adapters, lora_cfg


def _kernel_shape(base: Mapping[str, Any], module: str) -> tuple[int, ...]:
    return tuple(target_kernel(dict(base), module).shape)


def save_merged_hf_dir(path: str | os.PathLike, base: Any, adapters: Adapters, lora_cfg: LoraConfig,
                       config: DecoderConfig, extra_files: Mapping[str, str] | None = None) -> str:
    """Write base + adapters merged (``W + (alpha/r) B A``) as an ordinary HF dir (`save_hf_dir`)."""
    save_hf_dir(path, jax.device_get(merge_lora(base, adapters, lora_cfg)), config, extra_files)
    return os.fspath(path)
