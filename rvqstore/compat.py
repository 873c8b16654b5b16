"""Bridges to mlx-lm's cache classes: which ones rvqstore can take, and their dense contents."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .errors import RVQError


class UnsupportedCacheError(RVQError, TypeError):
    """A cache kind rvqstore cannot hold (ChunkedKVCache, batch caches, ...; see rvqstore.cache_kinds).
    The message names the kind and the layer."""


def dense_keys_values(cache: Any) -> tuple[mx.array, mx.array] | None:
    """Keys and values (B, H, T, D) of the used part of an mlx-lm KVCache / QuantizedKVCache.

    Returns None for an empty cache; raises UnsupportedCacheError for any other cache kind (rotating
    windows and recurrent state have rooms of their own: rvqstore.rotating_cache, rvqstore.cache_kinds).
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
        f"cannot read a {name} as plain per-token keys/values (only KVCache, QuantizedKVCache)")
