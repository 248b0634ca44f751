"""Value-head variant (one scalar per token) for critics, reward models and cost models.

``ValueModel`` = the same ``Decoder`` backbone + ``score``: a bias-free ``[embed, 1]`` projection,
the layout of HF ``LlamaForSequenceClassification(num_labels=1)`` (``score.weight [1, embed]``), so a
trained critic/reward model exports to HF names (``model.*`` + ``score.weight``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_hf.models.config import DecoderConfig
from jaxrl_hf.models.forward import freeze_rules, init_boxed
from jaxrl_hf.models.llama import Decoder, _Proj, default_positions
from jaxrl_hf.models.weights_hf import hf_state_dict_to_params, params_to_hf_state_dict

Params = dict[str, Any]


class ValueModel(nn.Module):
    """Backbone + scalar head; ``__call__`` returns values ``[B, T]`` float32."""

    config: DecoderConfig
    mesh: Any = None
    rules: Any = None

    def setup(self) -> None:
        c = self.config
        self.model = Decoder(c, self.mesh, self.rules)
        self.score = _Proj(c.hidden_size, (1,), ("embed", None), None, jnp.dtype(c.dtype), jnp.dtype(c.param_dtype))

    def __call__(self, input_ids: jnp.ndarray, positions: jnp.ndarray, attention_mask: jnp.ndarray) -> jnp.ndarray:
        hidden, _ = self.model(input_ids, positions, attention_mask)
        return self.score(hidden)[..., 0].astype(jnp.float32)


def _module(config: DecoderConfig, mesh: Any = None, rules: Any = None) -> ValueModel:
    return ValueModel(config, mesh, freeze_rules(rules))


def _init_boxed(config: DecoderConfig, rng: jax.Array) -> Any:
    return init_boxed(_module(config), rng)


def init_value_params(config: DecoderConfig, rng: jax.Array | int = 0) -> Params:
    """Random ``{"model": ..., "score": {"kernel": [embed, 1]}}``."""
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    return nn.unbox(jax.jit(_init_boxed, static_argnums=0)(config, rng))


def value_param_logical_axes(config: DecoderConfig) -> Any:
    """Logical-axis ``PartitionSpec`` tree matching ``init_value_params``."""
    return nn.get_partition_spec(jax.eval_shape(lambda: _init_boxed(config, jax.random.key(0))))


def value_params_from_lm(lm_params: Params, config: DecoderConfig, rng: jax.Array | int = 0,
                         head_std: float = 0.0) -> Params:
    """Critic init from a causal LM: copy the backbone, new ``score`` head (zeros by default, so V=0 at start)."""
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    kernel = head_std * jax.random.normal(rng, (config.hidden_size, 1), jnp.dtype(config.param_dtype))
    return {"model": lm_params["model"], "score": {"kernel": kernel}}


def value_forward(params: Params, config: DecoderConfig, input_ids: jnp.ndarray,
                  attention_mask: jnp.ndarray | None = None, positions: jnp.ndarray | None = None,
                  mesh: Any = None, rules: Any = None) -> jnp.ndarray:
    """Per-token values ``[B, T]`` float32."""
    if attention_mask is None:
        attention_mask = jnp.ones(input_ids.shape, jnp.int32)
    if positions is None:
        positions = default_positions(attention_mask)
    return _module(config, mesh, rules).apply({"params": params}, input_ids, positions, attention_mask)


def value_params_to_hf_state_dict(params: Params, config: DecoderConfig) -> dict[str, np.ndarray]:
    """HF ``LlamaForSequenceClassification`` names: ``model.*`` + ``score.weight [1, embed]``."""
    state = params_to_hf_state_dict({"model": params["model"]}, config.replace(tie_word_embeddings=True))
    state["score.weight"] = np.ascontiguousarray(np.asarray(jax.device_get(params["score"]["kernel"])).T)
    return state


def hf_state_dict_to_value_params(state: dict[str, np.ndarray], config: DecoderConfig,
                                  source: str = "state dict") -> Params:
    """Inverse of ``value_params_to_hf_state_dict``."""
    state = dict(state)
    if "score.weight" not in state:
        raise KeyError(f"{source}: missing tensor 'score.weight' (value head)")
    score = np.asarray(state.pop("score.weight"))
    if score.shape != (1, config.hidden_size):
        raise ValueError(f"{source}: score.weight has shape {score.shape}, expected {(1, config.hidden_size)}")
    backbone = hf_state_dict_to_params(state, config.replace(tie_word_embeddings=True), source=source)
    return {"model": backbone["model"], "score": {"kernel": np.ascontiguousarray(score.T)}}
