"""Which mlx-lm cache kind becomes which rvqstore cache, layer by layer.

- ``KVCache`` / ``QuantizedKVCache`` -> :class:`RVQKVCache`
- ``RotatingKVCache`` (sliding window) -> :class:`RVQRotatingKVCache` (same max_size, keep)
- ``ArraysCache`` and subclasses (recurrent / conv state) -> kept as they are, full precision
- ``CacheList`` -> a ``CacheList`` of its converted children
- anything else (``ChunkedKVCache``, ``ConcatenateKVCache``, the batch caches ``BatchKVCache`` /
  ``BatchRotatingKVCache``, unknown classes) -> :class:`UnsupportedCacheError` naming the kind and the
  layer. Batched generation is refused: a snapshot holds one prompt.
"""

from __future__ import annotations

from typing import Any, Sequence

from .cache import RVQKVCache
from .compat import UnsupportedCacheError
from .errors import CodecConfigError
from .rotating_cache import RVQRotatingKVCache

# settings a rotating layer takes from make_prompt_cache's keyword arguments (no dense window there)
_ROTATING_KWARGS = ("mode", "use_kernels", "step", "value_step")


def _lm():
    from mlx_lm.models import cache as lm

    return lm


def is_arrays_cache(c: Any) -> bool:
    return isinstance(c, _lm().ArraysCache)


def _refuse(c: Any, where: str) -> UnsupportedCacheError:
    return UnsupportedCacheError(
        f"{where} uses a {type(c).__name__}, which rvqstore does not hold (supported: KVCache, QuantizedKVCache, "
        f"RotatingKVCache, ArraysCache, CacheList of these)")


def _rotating_kwargs(codec: dict, kwargs: dict, where: str) -> dict:
    if kwargs.get("dense_window", 0):
        raise CodecConfigError(f"{where} is a sliding-window layer: dense_window is not supported there; "
                               f"use dense_window=0 with this model")
    return {**codec, **{k: v for k, v in kwargs.items() if k in _ROTATING_KWARGS}}


def fresh_cache(template: Any, codec: dict, kwargs: dict, where: str) -> Any:
    """An empty rvqstore cache for the layer whose mlx-lm cache is ``template`` (from ``make_cache()``)."""
    lm = _lm()
    t = type(template)
    if t in (lm.KVCache, lm.QuantizedKVCache):
        return RVQKVCache(**codec, **kwargs)
    if t is lm.RotatingKVCache:
        return RVQRotatingKVCache(template.max_size, template.keep, **_rotating_kwargs(codec, kwargs, where))
    if isinstance(template, lm.ArraysCache):
        return template
    if t is lm.CacheList:
        return lm.CacheList(*(fresh_cache(c, codec, kwargs, f"{where}, child {j}")
                              for j, c in enumerate(template.caches)))
    raise _refuse(template, where)


def convert_cache(c: Any, codec: dict, kwargs: dict, where: str) -> Any:
    """The rvqstore form of a filled cache: mlx-lm KV/rotating caches encoded, rvqstore caches and
    recurrent state as they are."""
    lm = _lm()
    t = type(c)
    if isinstance(c, (RVQKVCache, RVQRotatingKVCache)) or isinstance(c, lm.ArraysCache):
        return c
    if t in (lm.KVCache, lm.QuantizedKVCache):
        return RVQKVCache.from_kv_cache(c, **codec, **kwargs)
    if t is lm.RotatingKVCache:
        return RVQRotatingKVCache.from_rotating_cache(c, **_rotating_kwargs(codec, kwargs, where))
    if t is lm.CacheList:
        return lm.CacheList(*(convert_cache(x, codec, kwargs, f"{where}, child {j}") for j, x in enumerate(c.caches)))
    raise _refuse(c, where)


# Models whose code reads or writes a cache's raw ``keys``/``values`` arrays (not through
# update_and_fetch): their sparse-attention indexer does, on child 1 of every layer's CacheList.
_RAW_ARRAY_MODELS = {"deepseek_v32": "layer 0, child 1", "minimax_m3_vl": "layer 0, child 1"}


def _model_type(model: Any) -> str | None:
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) or getattr(model, "model_type", None)


def make_caches(model: Any, codec: dict, kwargs: dict) -> list:
    """One rvqstore cache per cache the model makes (``model.make_cache()``, else one per layer)."""
    mt = _model_type(model)
    if mt in _RAW_ARRAY_MODELS:
        raise UnsupportedCacheError(
            f"{_RAW_ARRAY_MODELS[mt]} of a {mt} model is a KVCache whose keys/values arrays the model's indexer "
            f"reads and writes directly; rvqstore caches hold codes, so this model is not supported")
    if hasattr(model, "make_cache"):
        return [fresh_cache(t, codec, kwargs, f"layer {i}") for i, t in enumerate(model.make_cache())]
    return [RVQKVCache(**codec, **kwargs) for _ in range(len(model.layers))]


def convert_caches(cache: Sequence[Any], codec: dict, kwargs: dict) -> list:
    return [convert_cache(c, codec, kwargs, f"layer {i}") for i, c in enumerate(cache)]


def expected_layer_count(model: Any) -> int:
    """How many caches the model takes: ``len(model.make_cache())`` where it builds its own (models
    that share one layer's keys/values with others make fewer), else its layer count."""
    if hasattr(model, "make_cache"):
        return len(model.make_cache())
    return len(model.layers)
