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


__all__ = ["DropExpectedReloadWarnings", "RELOAD_WARNINGS_EXPECTED", "reprocess_tied_lm_head", "worker_device"]
