"""The masks mlx-lm hands to attention, brought to one form for attention on codes.

mlx-lm passes ``None`` (one query, or no mask wanted), the string ``"causal"``, or an array
broadcastable to ``(B, n_heads, L, T)``: boolean (True = may attend) or additive (added to the
scores), e.g. ``create_causal_mask(..., window_size=w)`` for sliding-window layers. The queries are
the last ``L`` of the ``T`` positions held.
"""

from __future__ import annotations

import mlx.core as mx

from ..errors import InputShapeError


def is_causal(mask) -> bool:
    return isinstance(mask, str) and mask == "causal"


def check(mask) -> None:
    """Reject what mlx-lm never passes, with a typed error (not a crash deep inside a kernel)."""
    if mask is None or is_causal(mask) or isinstance(mask, mx.array):
        return
    raise InputShapeError(f"attention mask must be None, 'causal' or an mx.array, got {mask!r}")


def causal_bool(n_queries: int, n_keys: int) -> mx.array:
    """``(L, T)`` boolean: query ``l`` (position ``T - L + l``) sees keys at positions <= its own."""
    q = mx.arange(n_keys - n_queries, n_keys)[:, None]
    return q >= mx.arange(n_keys)[None]


def grouped(mask: mx.array, n_kv_heads: int, group: int) -> mx.array:
    """An array mask over ``(B, n_heads, L, T)`` reshaped to the grouped scores ``(B, Hkv, G, L, T)``."""
    if mask.ndim > 4:
        raise InputShapeError(f"attention mask has {mask.ndim} axes, at most 4 expected")
    m = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    b, h, l, t = m.shape
    if h == 1:
        return m[:, :, None]
    if h != n_kv_heads * group:
        raise InputShapeError(f"attention mask has {h} heads, the queries {n_kv_heads * group}")
    return m.reshape(b, n_kv_heads, group, l, t)


def apply(scores: mx.array, mask) -> mx.array:
    """``scores`` ``(B, Hkv, G, L, T)`` float32 with the mask applied (masked entries -> -inf)."""
    if mask is None:
        return scores
    l, t = scores.shape[-2:]
    if is_causal(mask):
        if l == 1:
            return scores
        return mx.where(causal_bool(l, t), scores, -mx.inf)
    m = grouped(mask, scores.shape[1], scores.shape[2])
    if m.shape[-2:] != (l, t) and not (m.shape[-2] in (1, l) and m.shape[-1] == t):
        raise InputShapeError(f"attention mask of shape {tuple(mask.shape)} does not fit {l} queries x {t} keys")
    if m.dtype == mx.bool_:
        return mx.where(m, scores, -mx.inf)
    return scores + m.astype(mx.float32)
