"""The cache kinds a model expects, checked against a snapshot's layer maps before anything is decoded."""

from __future__ import annotations

from typing import Any


def expected_kinds(template: Any) -> Any:
    """Layer-map view of one of ``model.make_cache()``'s caches: a kind, with its settings."""
    from mlx_lm.models import cache as lm

    t = type(template)
    if t in (lm.KVCache, lm.QuantizedKVCache):
        return ("rvq",)
    if t is lm.RotatingKVCache:
        return ("rvq-rotating", template.max_size, template.keep)
    if isinstance(template, lm.ArraysCache):
        return ("arrays", len(template.cache))
    if t is lm.CacheList:
        return ("list", tuple(expected_kinds(c) for c in template.caches))
    return (t.__name__,)


def file_kinds(layer: Any) -> Any:
    if layer.kind == "rvq-rotating":
        return ("rvq-rotating", layer.max_size, layer.keep)
    if layer.kind == "arrays":
        return ("arrays", layer.n_arrays)
    if layer.kind == "list":
        return ("list", tuple(file_kinds(c) for c in layer.children))
    return (layer.kind,)


def structure_mismatch(layers: Any, model: Any) -> str | None:
    """None if the file's layers are the kinds ``model`` builds (count, kind, window, slots), else why not."""
    if hasattr(model, "make_cache"):
        want = [expected_kinds(t) for t in model.make_cache()]
    else:
        want = [("rvq",)] * len(model.layers)
    if len(layers) != len(want):
        return f"{len(layers)} layers, but the model has {len(want)}"
    for i, (layer, w) in enumerate(zip(layers, want)):
        got = file_kinds(layer)
        if got != w and not (got == ("dense",) and w == ("rvq",)):
            return f"layer {i} is {got} in the file but {w} in the model"
    return None
