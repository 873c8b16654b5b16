"""Bridges to mlx-lm's cache classes: which ones rvqstore can take, and their dense contents."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .errors import RVQError


class UnsupportedCacheError(RVQError, TypeError):
    """A cache kind rvqstore cannot hold (rotating windows, recurrent/SSM state, ...)."""


def dense_keys_values(cache: Any) -> tuple[mx.array, mx.array] | None:
    """Keys and values (B, H, T, D) of the used part of an mlx-lm KVCache / QuantizedKVCache.

    Returns None for an empty cache; raises UnsupportedCacheError for any other cache kind, because a
    rotating window's order or a recurrent state cannot be replayed as plain per-token keys/values.
    """
    from mlx_lm.models import cache as lm

    name = type(cache).__name__
    if type(cache) is lm.KVCache:
        if cache.keys is None or cache.offset == 0:
            return None
        return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
    if type(cache) is lm.QuantizedKVCache:
        if cache.keys is None or cache.offset == 0:
            return None
        n = cache.offset

        def deq(q):
            w, s, b = (a[..., :n, :] for a in q)
            return mx.dequantize(w, s, b, group_size=cache.group_size, bits=cache.bits)

        return deq(cache.keys), deq(cache.values)
    raise UnsupportedCacheError(
        f"cannot convert a {name}: rvqstore holds plain causal KV caches (mlx-lm KVCache, QuantizedKVCache); "
        f"rotating-window and recurrent (SSM/Arrays) caches are not supported")
