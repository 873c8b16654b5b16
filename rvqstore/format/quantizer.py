"""Content-level rules for the header's ``quantizer`` map (spec section "The quantizer map").

The container only requires a map with a string ``name`` and an integer ``version``.  For the
quantizer this library implements, ``"turboquant-rvq"`` version 1 (the map
:meth:`rvqstore.codec.RVQCodec.to_header` writes), every field is checked here in pure Python (no
MLX needed, so ``rvqstore inspect`` stays cheap), together with what it implies for the layers'
code sections.  A map with another name is accepted at open time; only decoding it fails.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import MalformedHeaderError, MalformedSectionError, UnknownFeatureError, UnsupportedVersionError

QUANTIZER_NAME = "turboquant-rvq"
QUANTIZER_VERSION = 1
PRNG_NAME = "splitmix64-msb-sign"
ROTATION_KIND = "randomized-hadamard"
RESIDUALS = ("conditional", "shared")
MAX_DIM = 32768


def supported_dim(dim: int) -> bool:
    """``dim = m * 2^k`` with m in {1, 12, 20, 28}, 2 <= dim <= 32768 (what the rotation supports)."""
    if dim < 2 or dim > MAX_DIM:
        return False
    for m in (1, 12, 20, 28):
        if dim % m == 0:
            p = dim // m
            if p & (p - 1) == 0:
                return True
    return False


def words_per_vector(dim: int, bits: int) -> int:
    per = 32 // bits
    return -(-dim // per)


def _int(q: dict, key: str, lo: int, hi: int, path, where: str = "header.quantizer") -> int:
    v = q.get(key)
    if type(v) is not int:
        raise MalformedHeaderError(path, f"{where}.{key} must be an integer")
    if not lo <= v <= hi:
        raise MalformedHeaderError(path, f"{where}.{key} = {v} is outside {lo}..{hi}")
    return v


def _table(v: Any, shape: tuple[int, ...], key: str, path, where: str = "header.quantizer") -> np.ndarray:
    where = f"{where}.{key}"
    def ok_row(r, n):
        return type(r) is list and len(r) == n and all(type(x) is float for x in r)

    good = ok_row(v, shape[0]) if len(shape) == 1 else (
        type(v) is list and len(v) == shape[0] and all(ok_row(r, shape[1]) for r in v))
    if not good:
        raise MalformedHeaderError(path, f"{where} must be {'x'.join(map(str, shape))} floats")
    a = np.array(v, dtype=np.float64).reshape(shape)
    if not np.all(np.isfinite(a)):
        raise MalformedHeaderError(path, f"{where} holds a non-finite value")
    if shape[-1] > 1 and not np.all(np.diff(a, axis=-1) > 0):
        raise MalformedHeaderError(path, f"{where} is not strictly increasing")
    return a


def check_quantizer_map(q: dict, path, where: str = "header.quantizer") -> tuple[int, int, int] | None:
    """Validate one ``turboquant-rvq`` map; return ``(dim, bits1, bits2)``, or None for another name."""
    if q.get("name") != QUANTIZER_NAME:
        return None
    version = q.get("version")
    if version != QUANTIZER_VERSION:
        raise UnsupportedVersionError(
            path, f"{where}: quantizer {QUANTIZER_NAME!r} version {version} is not supported (this reader knows "
                  f"{QUANTIZER_VERSION})")
    dim = _int(q, "dim", 2, MAX_DIM, path, where)
    if not supported_dim(dim):
        raise MalformedHeaderError(path, f"{where}.dim = {dim} is not m * 2^k with m in 1, 12, 20, 28")
    b1 = _int(q, "bits1", 1, 4, path, where)
    b2 = _int(q, "bits2", 0, 4, path, where)
    residual = q.get("residual")
    if b2 == 0 and residual != "none":
        raise MalformedHeaderError(path, f"{where}.residual must be 'none' when bits2 is 0")
    if b2 and residual not in RESIDUALS:
        raise MalformedHeaderError(path, f"{where}.residual {residual!r} is not one of {RESIDUALS}")
    if q.get("scale_dtype") != "bfloat16":
        raise MalformedHeaderError(path, f"{where}.scale_dtype must be 'bfloat16'")
    rot = q.get("rotation")
    if type(rot) is not dict:
        raise MalformedHeaderError(path, f"{where}.rotation must be a map")
    if rot.get("kind") != ROTATION_KIND:
        raise UnknownFeatureError(path, f"{where}.rotation.kind {rot.get('kind')!r} is not {ROTATION_KIND!r}")
    if rot.get("prng") != PRNG_NAME:
        raise UnknownFeatureError(path, f"{where}.rotation.prng {rot.get('prng')!r} is not {PRNG_NAME!r}")
    seed = rot.get("seed")
    if type(seed) is not int or not 0 <= seed < 1 << 64:
        raise MalformedHeaderError(path, f"{where}.rotation.seed must be an integer in 0..2^64-1")
    signs = rot.get("signs")
    if type(signs) is not bytes or len(signs) != -(-dim // 8):
        raise MalformedHeaderError(path, f"{where}.rotation.signs must be {-(-dim // 8)} bytes (bin)")
    if dim % 8 and signs[-1] >> (dim % 8):
        raise MalformedHeaderError(path, f"{where}.rotation.signs has non-zero bits past dim")
    L1 = 1 << b1
    _table(q.get("centroids1"), (L1,), "centroids1", path, where)
    bd1 = _table(q.get("boundaries1"), (L1 - 1,), "boundaries1", path, where) if L1 > 1 else None
    if b2:
        L2 = 1 << b2
        _table(q.get("centroids2"), (L1, L2), "centroids2", path, where)
        bd2 = _table(q.get("boundaries2"), (L1, L2 - 1), "boundaries2", path, where)
        if residual == "conditional" and bd1 is not None:
            lo = np.concatenate([[-math.inf], bd1])[:, None]
            hi = np.concatenate([bd1, [math.inf]])[:, None]
            if not (np.all(bd2 > lo) and np.all(bd2 < hi)):
                raise MalformedHeaderError(
                    path, f"{where}.boundaries2: conditional thresholds must lie inside their stage-1 cell")
    return dim, b1, b2


def check_quantizer(q, layers, sections, path) -> None:
    """Validate the quantizer map(s) and every coded layer side's code sections against its map.

    ``q`` is the ``quantizer`` map (version 1.0: one map for every coded layer), or the tuple of
    ``quantizers`` (feature quantizer-table: each side names its entry).
    """
    table = (q,) if isinstance(q, dict) else tuple(q)
    where_of = (lambda i: "header.quantizer") if isinstance(q, dict) else (lambda i: f"header.quantizers[{i}]")
    params = [check_quantizer_map(m, path, where_of(i)) for i, m in enumerate(table)]
    by_name = {s.name: s for s in sections}
    for layer in layers:
        for sub in (layer.children or (layer,)):
            if not sub.is_coded:
                continue
            label = f"layer {layer.index}" + (f" child {sub.index}" if sub is not layer else "")
            for side in ("keys", "values"):
                qi = 0 if isinstance(q, dict) else (sub.key_quantizer if side == "keys" else sub.value_quantizer)
                p = params[qi]
                if p is None:
                    continue  # a quantizer this library does not know: only decoding fails
                dim, b1, b2 = p
                if sub.side_head_dim(side) != dim:
                    which = "head_dim" if side == "keys" else "value_head_dim"
                    raise MalformedHeaderError(path, f"{label}: {which} {sub.side_head_dim(side)} differs from "
                                                     f"{where_of(qi)}.dim {dim}")
                w1 = words_per_vector(dim, b1)
                w2 = words_per_vector(dim, b2) if b2 else 0
                s1 = by_name[sub.sections[f"{side}.codes1"]]
                if s1.shape[3] != w1:
                    raise MalformedHeaderError(path, f"section {s1.name!r}: {s1.shape[3]} words per vector, the "
                                                     f"quantizer needs {w1}")
                n2 = sub.sections.get(f"{side}.codes2")
                if b2 and n2 is None:
                    raise MalformedHeaderError(path, f"{label} lacks its {side}.codes2 section (bits2 = {b2})")
                if not b2 and n2 is not None:
                    raise MalformedHeaderError(path, f"section {n2!r}: the quantizer has no stage 2")
                if n2 is not None and by_name[n2].shape[3] != w2:
                    raise MalformedHeaderError(path, f"section {n2!r}: {by_name[n2].shape[3]} words per vector, the "
                                                     f"quantizer needs {w2}")


def unused_bits_mask(dim: int, bits: int) -> np.ndarray:
    """Per-word masks (uint32) of the bits that carry no code; those bits MUST be zero on disk."""
    per = 32 // bits
    words = words_per_vector(dim, bits)
    masks = np.zeros(words, dtype=np.uint32)
    for w in range(words):
        n = min(per, dim - w * per)
        used = (1 << (n * bits)) - 1
        masks[w] = (~used) & 0xFFFFFFFF
    return masks


def check_codes_padding(codes: np.ndarray, dim: int, bits: int, name: str, path) -> None:
    """Unused high bits of every packed word must be zero (spec: packing)."""
    if codes.size == 0:
        return
    masks = unused_bits_mask(dim, bits)
    if np.any(codes & masks):
        raise MalformedSectionError(path, f"section {name!r}: non-zero bits outside any code (unused high bits must be 0)")


def check_scales(bits: np.ndarray, name: str, path) -> None:
    """Scales (bfloat16 bit patterns) must be NaN (a vector that was not finite when encoded) or finite
    and non-negative (+0 included); +-Inf and negative values have no meaning (spec section 10)."""
    mag = bits & 0x7FFF
    bad = (mag == 0x7F80) | ((bits & 0x8000) != 0) & (mag <= 0x7F80)
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise MalformedSectionError(path, f"section {name!r}: scale {i} is {int(bits[i]):#06x} (+-Inf or negative; "
                                          f"only NaN or a finite value >= 0 is valid)")


def check_mean_finite(f, sub, label: str) -> None:
    """A ``keys.mean`` section (codec-state, spec 8.2) must hold finite values only."""
    name = sub.sections.get("keys.mean")
    if name is None:
        return
    a = f.read_section(name)
    ok = bool(np.all((a & 0x7F80) != 0x7F80)) if f.section(name).dtype == "bfloat16" else bool(np.all(np.isfinite(a)))
    if not ok:
        raise MalformedSectionError(f.path, f"section {name!r}: the key mean of {label} holds NaN or Inf")


#: ``verify`` decodes at most this many output bytes (float32) at a time, whatever the layer's shape.
DECODE_CHUNK_BYTES = 32 << 20


def decode_layers(f, *, chunk_bytes: int = DECODE_CHUNK_BYTES, progress=None) -> int:
    """Decode every rvq-coded layer side's codes with its codec (content-level part of ``verify``).

    Checks that a key mean (codec-state) is finite, the unused bits of every packed word, rebuilds each side's codec from its quantizer map
    with :meth:`rvqstore.codec.RVQCodec.from_header`, and decodes the vectors in chunks of at most
    ``chunk_bytes`` of float32 output, over all axes (batch, heads and tokens flattened), checking
    the output shape and that vectors with a finite scale decode to finite values.  Returns the
    number of vectors decoded.  Sides whose quantizer is not ``turboquant-rvq`` are skipped.
    """
    import mlx.core as mx

    from ..codec import EncodedVectors
    from ..errors import InvalidScaleError

    dtypes = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
    n = 0
    codecs: dict[int, Any] = {}
    for layer in f.layers:
        for sub in (layer.children or (layer,)):
            if not sub.is_coded:
                continue
            check_mean_finite(f, sub, f"layer {layer.index}" + (f" child {sub.index}" if sub is not layer else ""))
            for side in ("keys", "values"):
                q = f.quantizer_for(sub, side)
                if q is None or q.get("name") != QUANTIZER_NAME:
                    continue
                codec = codecs.get(id(q))
                if codec is None:
                    codec = codecs[id(q)] = f._codec_from_map(q, use_kernels=False)
                names = sub.sections
                c1 = f.read_section(names[f"{side}.codes1"])
                check_codes_padding(c1, codec.dim, codec.bits1, names[f"{side}.codes1"], f.path)
                c2 = None
                if codec.bits2:
                    c2 = f.read_section(names[f"{side}.codes2"])
                    check_codes_padding(c2, codec.dim, codec.bits2, names[f"{side}.codes2"], f.path)
                sc = f.read_section(names[f"{side}.scales"]).reshape(-1)
                check_scales(sc, names[f"{side}.scales"], f.path)
                if len(sc) == 0:
                    continue
                c1 = c1.reshape(len(sc), -1)
                c2 = None if c2 is None else c2.reshape(len(sc), -1)
                dt = dtypes[sub.side_dtype(side)]  # what a load returns
                step = max(1, chunk_bytes // (4 * codec.dim))
                for v0 in range(0, len(sc), step):
                    v1 = min(len(sc), v0 + step)
                    scales = mx.array(np.ascontiguousarray(sc[v0:v1])).view(mx.bfloat16)
                    enc = EncodedVectors(scales, mx.array(np.ascontiguousarray(c1[v0:v1])),
                                         None if c2 is None else mx.array(np.ascontiguousarray(c2[v0:v1])), dt)
                    try:  # NaN or within the dtype's bound (rvqstore.codec: "Scales"); +Inf is not
                        codec.check_scales(scales, dt)
                    except InvalidScaleError as e:
                        raise MalformedSectionError(f.path, f"layer {layer.index} {side}: {e}") from None
                    out = codec.decode(enc, dtype=dt)  # finite in the dtype a load returns, not only float32
                    finite_scale = mx.isfinite(scales.astype(mx.float32))
                    ok = mx.all(mx.where(finite_scale[..., None], mx.isfinite(out), True))
                    if out.shape != (v1 - v0, codec.dim) or not bool(ok.item()):
                        raise MalformedSectionError(
                            f.path, f"layer {layer.index} {side}: codes decode to values that are not finite "
                                    f"in {sub.side_dtype(side)}")
                    n += v1 - v0
                    del out
                if progress is not None:
                    progress(layer.index, side)
    return n
