"""LoRA for the actor worker: frozen (sharded, possibly bf16) base + trainable adapters, merged on demand.

With ``model.lora_rank > 0`` the actor's `TrainState.params` holds only the adapters (`jaxrl_hf.models.lora`), so
the optimizer, its state, the gradients and the checkpoint cover only them; the base stays in `LoraPolicy.base`
with the rule set's param shardings and is passed to the train step as its ``frozen`` argument
(`jaxrl_hf.workers.train_step.make_train_step`, ``combine``). Adapters are laid out by the same rule set's params
rules plus `jaxrl_hf.models.lora.LORA_PARAM_RULES` (their ``in``/``out`` dims follow the base kernel's axes, the rank
is replicated). Everything that needs the policy's weights — log-probs, the rollout engine's weight sync (native
engine, with or without a generation layout, and vLLM's converted-weights path), HF export — gets
`LoraPolicy.merged`: ``W + (alpha/r) B A`` in the base's layout and dtype, a fresh copy each time (the base is
never written).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxrl_hf import mesh as meshlib
from jaxrl_hf.models import param_logical_axes
from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.lora import (LoraConfig, adapter_logical_axes, adapter_rules, combine, init_lora,
                                  lora_config_from_model, merge_lora)
from jaxrl_hf.workers.common import WorkerConfigError


class LoraPolicy:
    """The frozen base, the adapters' shardings and the jitted merge/init for one actor."""

    def __init__(self, lora_cfg: LoraConfig, config: DecoderConfig, base: Any, base_shardings: Any,
                 mesh: jax.sharding.Mesh, param_rules: Any):
        self.cfg, self.base = lora_cfg, base
        axes = adapter_logical_axes(param_logical_axes(config), lora_cfg)
        shapes = jax.eval_shape(lambda b: init_lora(b, lora_cfg, 0), base)
        try:
            self.adapter_shardings = meshlib.logical_to_shardings(axes, mesh, adapter_rules(param_rules), shapes=shapes)
        except ValueError as err:
            raise WorkerConfigError(f"model.lora_rank={lora_cfg.rank}: adapters cannot be laid out: {err}") from None
        self._merge = jax.jit(lambda b, a: merge_lora(b, a, lora_cfg), out_shardings=base_shardings)

    @classmethod
    def from_config(cls, model_cfg: Any, config: DecoderConfig, base: Any, base_shardings: Any,
                    mesh: jax.sharding.Mesh, param_rules: Any) -> "LoraPolicy | None":
        """``None`` when ``model.lora_rank == 0``; bad LoRA keys raise `WorkerConfigError` naming them."""
        try:
            lora_cfg = lora_config_from_model(model_cfg)
        except ValueError as err:
            raise WorkerConfigError(str(err)) from None
        return None if lora_cfg is None else cls(lora_cfg, config, base, base_shardings, mesh, param_rules)

    def init_adapters(self, seed: int) -> Any:
        """Fresh adapters (B = 0, so the first policy equals the base) placed with `adapter_shardings`."""
        return jax.jit(lambda b: init_lora(b, self.cfg, seed), out_shardings=self.adapter_shardings)(self.base)

    def merged(self, adapters: Any) -> Any:
        """The policy's full weights ``W + (alpha/r) B A`` (base layout and dtype)."""
        return self._merge(self.base, adapters)

    def combine(self, adapters: Any, frozen: Any) -> Any:
        """`jaxrl_hf.models.lora.combine` with this config (the train step's ``combine``)."""
        return combine(adapters, frozen, self.cfg)

    def save_adapter(self, path: str, adapters: Any, base_model: str | None = None) -> str:
        """The adapters alone in PEFT's format (`jaxrl_hf.models.lora_peft.save_peft_adapter`)."""
        from jaxrl_hf.models.lora_peft import save_peft_adapter
        return save_peft_adapter(path, jax.device_get(adapters), self.cfg, base_model)
