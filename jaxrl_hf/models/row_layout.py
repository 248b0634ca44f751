"""What one row of a decoder's input holds: one value (`RowLayout`, ``DecoderConfig.row_layout``) naming one
registered entry of `ROW_LAYOUTS`, with the static sizes the entry needs.

Projections, norms and the MLP see tokens and never the layout; self-attention without a KV cache is the one
place it matters, and there the decoder calls the entry:
``entry(q, k, v, segments, positions, shape, attend, scale, window, softcap) -> out`` with ``q [B, T, kv_heads,
groups, head_dim]``, ``k, v [B, T, kv_heads, head_dim]``, ``segments`` (the row's integer mask, 0 = padding) and
``positions [B, T]``, and ``attend(q, k, v, segments)`` the configured attention implementation
(`attention.self_attention`). The built-in layouts:

=================  ====================================  ==========================================================
name               ``shape``                             a row holds / attention
=================  ====================================  ==========================================================
``padded``         ``()``                                one sequence, or packed sequences told apart by segment
                                                         id: ``attend`` under the segment mask
``packed``         ``(rows, width)``                     at most ``rows`` packed sequences of at most ``width``
                                                         tokens: attention one sequence at a time
                                                         (`packed_attention.per_row_attention`)
``shared_prompt``  ``(P, n, R)``                         one prompt of ``P`` tokens and ``n`` responses of ``R``
                                                         (`shared_prompt_attention.shared_prompt_attention`)
``shared_prefix``  ``()`` or ``(groups, width, stride)`` a prompt (segment 1) and its samples (2, 3, ...) without
                                                         padding, or several such groups
                                                         (`shared_prompt_attention.shared_prefix_attention`)
=================  ====================================  ==========================================================

A new layout is one entry: ``@ROW_LAYOUTS.register("mine", shapes=(("a", "b"),))`` over a function of the
signature above, then ``DecoderConfig(..., row_layout=RowLayout("mine", (a, b)))``. This module imports no JAX:
the entries import their attention code when first traced, so a config can be checked without building a model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxrl_hf.registry import Registry

ROW_LAYOUTS: Registry = Registry("row layout", metadata={"shapes": ((),)})
"""Row layouts by name. ``shapes``: the accepted ``RowLayout.shape`` forms, each a tuple naming its entries (all
positive ints), e.g. ``((), ("groups", "width", "stride"))`` for a layout whose sizes are optional."""


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """A registered row layout (``name``, an entry of `ROW_LAYOUTS`) and its static sizes (``shape``), checked
    against the entry's accepted forms. Frozen and hashable: a field of ``DecoderConfig``, a static argument of
    ``jax.jit``."""

    name: str = "padded"
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        forms = ROW_LAYOUTS.info(self.name)["shapes"]  # unknown names raise with the valid list
        if not any(len(form) == len(self.shape) for form in forms) or any(
                not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.shape):
            spelled = " or ".join("()" if not form else "(" + ", ".join(form) + ")" for form in forms)
            raise ValueError(f"row layout {self.name!r}: shape={self.shape!r} must be {spelled}, positive ints")

    def attention(self, q: Any, k: Any, v: Any, segments: Any, positions: Any, attend: Callable[..., Any],
                  scale: float, window: Any = None, softcap: float | None = None) -> Any:
        """Self-attention of rows of this layout (the registered entry; see the module docstring)."""
        return ROW_LAYOUTS.get(self.name)(q, k, v, segments, positions, self.shape, attend, scale, window, softcap)


@ROW_LAYOUTS.register("padded")
def padded_rows(q: Any, k: Any, v: Any, segments: Any, positions: Any, shape: tuple[int, ...],
                attend: Callable[..., Any], scale: float, window: Any = None, softcap: float | None = None) -> Any:
    """``attend`` under the segment mask (a token sees the earlier tokens of its own segment)."""
    return attend(q, k, v, segments)


@ROW_LAYOUTS.register("packed", shapes=(("rows", "width"),))
def packed_rows(q: Any, k: Any, v: Any, segments: Any, positions: Any, shape: tuple[int, ...],
                attend: Callable[..., Any], scale: float, window: Any = None, softcap: float | None = None) -> Any:
    """Packed sequences (segments ``1 .. rows``, each at most ``width`` tokens), attended one at a time."""
    from jaxrl_hf.models.packed_attention import per_row_attention

    return per_row_attention(q, k, v, segments, *shape, attend)


@ROW_LAYOUTS.register("shared_prompt", shapes=(("prompt length", "samples", "response length"),))
def shared_prompt_rows(q: Any, k: Any, v: Any, segments: Any, positions: Any, shape: tuple[int, ...],
                       attend: Callable[..., Any], scale: float, window: Any = None,
                       softcap: float | None = None) -> Any:
    """One prompt and its responses per row, each response attending to the prompt and causally to itself."""
    from jaxrl_hf.models.shared_prompt_attention import shared_prompt_attention

    return shared_prompt_attention(q, k, v, segments, shape, attend, scale, window, softcap)


@ROW_LAYOUTS.register("shared_prefix", shapes=((), ("groups per row", "longest group", "segments per group")))
def shared_prefix_rows(q: Any, k: Any, v: Any, segments: Any, positions: Any, shape: tuple[int, ...],
                       attend: Callable[..., Any], scale: float, window: Any = None,
                       softcap: float | None = None) -> Any:
    """A prompt and its samples packed without padding (or ``groups`` such groups one after another)."""
    from jaxrl_hf.models.shared_prompt_attention import shared_prefix_attention

    return shared_prefix_attention(q, k, v, segments, positions, scale, window, softcap, shape)
