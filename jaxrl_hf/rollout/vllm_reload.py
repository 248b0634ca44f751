"""The worker-side half of an in-place weight reload into vLLM (`jaxrl_hf.rollout.vllm_engine`): functions run in
vLLM's worker through ``collective_rpc``, and the filter for the reload warnings that are expected."""

from __future__ import annotations

import logging
from typing import Any


def reprocess_tied_lm_head(worker: Any) -> bool:
    """Worker-side (``collective_rpc``): re-run the LM head's post-load processing after a reload.

    With tied embeddings the head shares the embedding's Parameter, so vLLM's layerwise reload writes the new
    values into it but never re-processes the head layer itself ("ParallelLMHead: Failed to load weights").
    On CPU that processing packs the weight for oneDNN into a separate buffer (``layer.cpu_linear``), so the
    head would keep computing logits with the old (dummy) weights. A model with no ``lm_head`` at all (vLLM's
    Gemma 2 computes logits with ``model.embed_tokens`` itself, which the reload processes as a loaded layer)
    needs nothing. Returns whether the output layer is the embedding."""
    model = worker.model_runner.get_model()
    head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is None:
        return False
    if head is None:
        return True
    if head.weight is not embed.weight:
        return False
    head.quant_method.process_weights_after_loading(head)
    return True


def repack_cpu_moe_experts(worker: Any) -> int:
    """Worker-side (``collective_rpc``): re-pack the CPU fused-MoE experts' weights after a reload.

    vLLM's CPU experts keep ``w13_weight`` / ``w2_weight`` in a packed grouped-GEMM layout made by their own
    ``process_weights_after_loading`` (``cpu_prepack_moe_weight``). On a weight *update* vLLM 0.32's unquantized
    MoE method copies the new values into the kernel's tensors but skips that step (it runs only when the kernel
    is first built), so the experts would compute with the unpacked values as if packed. This packs them in
    place, as the first load did. GPU experts read the plain layout and need nothing (0). Returns the number of
    MoE layers re-packed."""
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    repacked = 0
    for layer in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        for name in ("w13_weight", "w2_weight"):
            weight = getattr(layer, name)
            weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))
        repacked += 1
    return repacked


def _copy_presharded_vocab(param: Any, loaded_weight: Any) -> None:
    """Loader of a vocab-parallel embedding / LM head fed its rank's shard already padded to vLLM's rows."""
    if tuple(param.data.shape) != tuple(loaded_weight.shape):
        raise ValueError(f"vLLM TP weight sync: a vocab-parallel shard of shape {tuple(loaded_weight.shape)} for a "
                         f"parameter of shape {tuple(param.data.shape)}")
    param.data.copy_(loaded_weight)


def _copy_presharded_expert(param: Any, loaded_weight: Any, weight_name: str = "", shard_id: str = "",
                            expert_id: int = 0, return_success: bool = False) -> bool | None:
    """Loader of a fused-experts parameter (``w13_weight [experts, 2·I/tp, E]``, ``w2_weight [experts, E, I/tp]``)
    fed one expert's TP shard in HF layout: ``w1`` (gate) / ``w3`` (up) into the first / second half of the
    expert's ``w13`` rows, ``w2`` (down) into its ``w2``. The expert index is the global one (no expert
    parallelism: every rank holds every expert)."""
    slot = param.data[int(expert_id)]
    if shard_id in ("w1", "w3"):
        half = slot.shape[0] // 2
        slot = slot.narrow(0, 0 if shard_id == "w1" else half, half)
    elif shard_id != "w2":
        raise ValueError(f"vLLM TP weight sync: expert shard id {shard_id!r} for {weight_name!r}")
    if tuple(slot.shape) != tuple(loaded_weight.shape):
        raise ValueError(f"vLLM TP weight sync: expert {expert_id}'s {shard_id} shard of {weight_name!r} has shape "
                         f"{tuple(loaded_weight.shape)}; this rank's slot is {tuple(slot.shape)}")
    slot.copy_(loaded_weight)
    return True if return_success else None


def _set_loader(tensor: Any, loader: Any) -> None:
    """Set a tensor's weight loader (vLLM's own parameter classes keep it in ``_weight_loader``)."""
    tensor.__dict__["_weight_loader" if "_weight_loader" in tensor.__dict__ else "weight_loader"] = loader


def mark_tp_presharded(worker: Any) -> dict[str, Any]:
    """Worker-side (``collective_rpc``): make every tensor-parallel parameter take its rank's shard as given.

    Linear layers (column / row / qkv / merged column parallel): ``is_sharded_weight = True`` with the layer's
    ``weight_loader`` (the loader that reads that flag as "do not narrow"; vLLM's newer per-parameter loaders
    always narrow). Vocab-parallel embedding and LM head: a loader that copies the padded shard. Fused experts
    (no expert parallelism): a loader that copies each expert's shard into its slot (vLLM's always narrows).
    Set on the live parameters and on the metadata vLLM's layerwise reload rebuilds each layer from (whose
    references to the layer are held as vLLM holds them there, bound to its placeholder), so they hold for every
    later reload. Returns what was marked (the fused-expert layers too) and this rank's vocabulary rows (for the
    caller to check against its own)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.sanitize import layer_ref_sentinel

    model = worker.model_runner.get_model()
    linear = vocab = moe = 0
    rows = None
    for layer in model.modules():
        if isinstance(layer, RoutedExperts) and layer.moe_config.moe_parallel_config.tp_size > 1:
            if layer.moe_config.moe_parallel_config.use_ep:
                raise ValueError("vLLM TP weight sync: expert parallelism inside vLLM (enable_expert_parallel) is "
                                 "not supported; the experts are fed as TP shards")
            moe += 1
            live = meta = _copy_presharded_expert
            flags = {}
            names = ("w13_weight", "w2_weight")
        elif isinstance(layer, LinearBase) and getattr(layer, "tp_size", 1) > 1:
            linear += 1
            loader = type(layer).weight_loader
            live, meta = loader.__get__(layer), loader.__get__(layer_ref_sentinel)
            flags = {"is_sharded_weight": True}
            names = ("weight", "bias")
        elif isinstance(layer, VocabParallelEmbedding) and layer.tp_size > 1:
            vocab, rows = vocab + 1, int(layer.num_embeddings_per_partition)
            live = meta = _copy_presharded_vocab
            flags = {}
            names = ("weight", "bias")
        else:
            continue
        restore = get_layerwise_info(layer).restore_metadata[0]
        for tensors, bound in ((dict(layer.named_parameters(recurse=False)), live), (restore, meta)):
            for name in names:
                tensor = tensors.get(name)
                if tensor is None:
                    continue
                _set_loader(tensor, bound)
                tensor.__dict__.update(flags)
    return {"linear_layers": linear, "vocab_layers": vocab, "moe_layers": moe, "vocab_rows_per_rank": rows}


def worker_device(worker: Any) -> str:
    """Worker-side (``collective_rpc``): the torch device vLLM's model runs on (``cpu`` / ``cuda:N``)."""
    return str(worker.device)


RELOAD_WARNINGS_EXPECTED = ("RotaryEmbedding", "ParallelLMHead", "Gemma2Model", "Gemma3Model")
"""Layers vLLM says 'failed to load' on every reload, harmlessly: RotaryEmbedding (only a derived cos/sin
cache, put back), a tied ParallelLMHead (handled by `reprocess_tied_lm_head`), and the Gemma models' own
``normalizer`` buffer (the constant sqrt(hidden_size) embedding scale, put back)."""


class DropExpectedReloadWarnings(logging.Filter):
    """Drops vLLM's 'Failed to load weights' records of the layers in `RELOAD_WARNINGS_EXPECTED`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args
                    and record.args[0] in RELOAD_WARNINGS_EXPECTED)


__all__ = ["DropExpectedReloadWarnings", "RELOAD_WARNINGS_EXPECTED", "mark_tp_presharded", "repack_cpu_moe_experts",
           "reprocess_tied_lm_head", "worker_device"]
