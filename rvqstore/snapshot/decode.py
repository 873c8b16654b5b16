"""``.rvq`` layer maps + sections -> caches (the inverse of :mod:`.encode`)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .. import device_memory, device_upload
from ..cache import RVQKVCache
from ..codec import DTYPE_BY_NAME, scales_pass
from ..errors import InvalidScaleError, RVQError
from ..format import MalformedSectionError
from ..rotating_cache import RVQRotatingKVCache


def _sides(a: dict) -> dict:
    return {side: (a[f"{side}.scales"], a[f"{side}.codes1"], a.get(f"{side}.codes2")) for side in ("keys", "values")}


def _codec_settings(key_codec, mode: str, use_kernels: bool) -> dict:
    return dict(bits=key_codec.bits, seed=key_codec.seed,
                residual=key_codec.residual if key_codec.bits2 else "conditional", mode=mode, use_kernels=use_kernels)


def decode_layer(f, layer, *, mode: str, opts: dict, use_kernels: bool, arrays: dict | None = None,
                 scales_checked: bool = False) -> Any:
    """The cache of one layer map (a list child is given as its LayerInfo); ``arrays``: the layers'
    sections read already (:func:`read_arrays`); ``scales_checked``: their scales passed already
    (:func:`_scales_pass`)."""
    from mlx_lm.models import cache as lm

    where = f"{f.path}: layer {layer.index if layer.parent is None else f'{layer.parent}, child {layer.index}'}"
    if layer.kind == "list":
        return lm.CacheList(*(decode_layer(f, ch, mode=mode, opts=opts, use_kernels=use_kernels, arrays=arrays,
                                           scales_checked=scales_checked) for ch in layer.children))
    a = arrays[layer_key(layer)] if arrays is not None else f.layer_arrays(layer, as_mx=True)
    if layer.kind == "arrays":
        c = lm.ArraysCache(layer.n_arrays)
        for k, arr in ((int(kind.split(".", 1)[1]), arr) for kind, arr in a.items() if kind.startswith("state.")):
            c[k] = arr
        return c
    if layer.kind not in ("rvq", "rvq-rotating"):
        raise RVQError(f"{where} is {layer.kind!r}; this version loads rvq, rvq-rotating, arrays and list layers")
    kc, vc = f.codec_for(layer, "keys", use_kernels=use_kernels), f.codec_for(layer, "values", use_kernels=use_kernels)
    if (kc.dim, vc.dim) != (layer.head_dim, layer.value_head_dim):
        raise RVQError(f"{where}: head dims {(layer.head_dim, layer.value_head_dim)} != quantizer dims "
                       f"{(kc.dim, vc.dim)}")
    sides = _sides(a)
    common = dict(keys=sides["keys"], values=sides["values"], dtype=DTYPE_BY_NAME[layer.key_dtype],
                  head_dims=(layer.head_dim, layer.value_head_dim), key_codec=kc, value_codec=vc,
                  check_scales=not scales_checked, **_codec_settings(kc, mode, use_kernels))
    try:  # from_packed checks every scale (NaN or decodable finite in the dtype) unless the file's check did
        if layer.kind == "rvq":
            return RVQKVCache.from_packed(dense_keys=a.get("keys.dense"), dense_values=a.get("values.dense"),
                                          dense_window=opts["dense_window"], flush_block=opts["flush_block"],
                                          **_codec_state(f, where, layer, a), **common)
        return RVQRotatingKVCache.from_packed(offset=layer.offset, max_size=layer.max_size, keep=layer.keep, **common)
    except InvalidScaleError:
        _raise_scale_error(f, where, sides, kc, vc, DTYPE_BY_NAME[layer.key_dtype])
        raise
    except RVQError as e:
        if layer.kind == "rvq":
            raise
        raise type(e)(f"{where}: {e}") from None


def _codec_state(f, where: str, layer, a: dict) -> dict:
    """from_packed's codec-state arguments (format 1.2); the header checked presence, dtypes and shapes,
    the mean's values are checked here (spec 8.2: finite) so a tampered one is the file's typed error."""
    mean = a.get("keys.mean")
    if mean is not None and not bool(mx.all(mx.isfinite(mean)).item()):
        raise MalformedSectionError(f.path, f"{where[len(f.path) + 2:]}: keys.mean holds NaN or Inf")
    sink = (a["keys.sink"], a["values.sink"]) if "keys.sink" in a else None
    return dict(sink=sink, key_mean=mean, sink_tokens=layer.sink_tokens, center_keys=layer.center_keys)


def _raise_scale_error(f, where: str, sides: dict, kc, vc, dtype) -> None:
    """The file's typed error for a refused scale, naming the layer and side (only on failure)."""
    for side, codec in (("keys", kc), ("values", vc)):
        try:
            codec.check_scales(sides[side][0], dtype)
        except InvalidScaleError as e:
            raise MalformedSectionError(f.path, f"{where[len(f.path) + 2:]} {side}: {e}") from None


def _leaves(f) -> list:
    """The file's layers with list layers replaced by their children, in order."""
    out = []

    def visit(layer):
        if layer.kind == "list":
            for ch in layer.children:
                visit(ch)
        else:
            out.append(layer)

    for layer in f.layers:
        visit(layer)
    return out


def _scales_pass(f, arrays: dict, use_kernels: bool) -> bool:
    """Whether every rvq layer side's scales pass their codec's check (:func:`rvqstore.codec.scales_pass`: one
    reduction for the file). False on any doubt; each layer then checks its own and raises its typed error."""
    checks = []
    try:
        for layer in _leaves(f):
            if layer.kind in ("rvq", "rvq-rotating"):
                a, dtype = arrays[layer_key(layer)], DTYPE_BY_NAME[layer.key_dtype]
                for side in ("keys", "values"):
                    checks.append((f.codec_for(layer, side, use_kernels=use_kernels), a[f"{side}.scales"], dtype))
    except (RVQError, KeyError):
        return False
    return scales_pass(checks)


def layer_key(layer) -> tuple:
    """How :func:`read_arrays` keys a layer (or a list child): ``(parent, index)``."""
    return (layer.parent, layer.index)


def read_arrays(f) -> dict:
    """Every layer's (and list child's) sections, checked and copied into MLX (side by side on a few
    threads: :meth:`RVQFile.read_sections`), then evaluated at once: the scale check that follows
    (:func:`_scales_pass`) then finds its inputs ready instead of waiting for each layer's copies in turn."""
    leaves = _leaves(f)
    names = [name for layer in leaves for name in layer.sections.values()]
    # on CUDA through the pinned ring straight into device memory; else side by side where the source
    # allows, on CUDA each copied into device memory as it comes
    got = device_upload.read_sections(f, names)
    arrays = iter(got if got is not None else f.read_sections(names, as_mx=True, then=device_memory.onto_device()))
    out = {layer_key(layer): {kind: next(arrays) for kind in layer.sections} for layer in leaves}
    mx.eval([list(a.values()) for a in out.values()])
    return out


def decode_snapshot(f, *, mode: str, opts: dict, use_kernels: bool) -> list:
    arrays = read_arrays(f)
    checked = _scales_pass(f, arrays, use_kernels)
    return [decode_layer(f, layer, mode=mode, opts=opts, use_kernels=use_kernels, arrays=arrays, scales_checked=checked)
            for layer in f.layers]
