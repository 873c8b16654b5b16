"""Compiled per-step paths of :class:`rvqstore.cache.RVQKVCache`: fewer dispatches per generated token.

A decode step appends one token per layer. Unfused, that is a dozen Python-level MLX calls per layer
(concatenate, rotate, quantize, split, three slice writes per stream) and, in packed mode, the lazy
decode of the whole history that ``update_and_fetch`` returns (built even when attention is served
from the codes and it is never evaluated). Here each is one compiled call, shared by every cache with
the same codec settings:

- :func:`append_fn`: encode keys and values together (and decode them for the resident copy) in one
  call, traced once per step length; the caller writes the results into its preallocated buffers
  with static slices (in place, as mlx-lm's KVCache does);
- :func:`decode_fn`: the decode of the whole buffers (sliced to the used part by the caller) for
  ``update_and_fetch``'s return value, with the codec's MLX-ops decode (no kernel first-use check can
  run inside a trace).

A cache that centers its keys (:mod:`rvqstore.cache_state`) passes its key mean as one more argument
where a function decodes keys (``centered=True``, part of the shared table's key): the decoded keys are
``dtype(float32(dec) + float32(mean))`` in the same call. The keys it appends are centered already.

Both take the two-stage, joint case (keys and values with the same head dim and bits), the one a
model's decode loop uses; anything else, or a trace that fails, takes the cache's unfused path.
"""

from __future__ import annotations

import mlx.core as mx

from .codec import RVQCodec

_fns: dict = {}


def _key(codec: RVQCodec, *extra) -> tuple:
    return (codec.dim, codec.bits, codec.seed, codec.residual, codec.centroids1.tobytes(),
            codec.centroids2.tobytes(), codec.boundaries1.tobytes(), codec.boundaries2.tobytes(),  # encode reads them
            codec.signs.tobytes()) + extra


def append_fn(codec: RVQCodec, resident: bool = False, centered: bool = False):
    """``f(keys, values)`` -> the new tokens' ``(ks, k1, k2, vs, v1, v2)`` codes (and, ``resident``, their
    decoded keys and values: the same call, bit-identical to decoding the stored codes; ``centered``:
    ``f(keys, values, mean)`` with ``mean`` float32 ``(B, H, 1, D)`` added to the decoded keys). The caller
    writes them into its buffers with static slices: in place (a dynamic-offset ``slice_update`` copies
    the whole buffer on MLX's CUDA backend), and the trace does not depend on the offset."""
    centered = centered and resident  # only a decode adds the mean back
    key = _key(codec, "append", resident, centered)
    fn = _fns.get(key)
    if fn is None:
        def append(keys, values, mean=None):
            b = keys.shape[0]
            enc = codec.encode(mx.concatenate([keys, values.astype(keys.dtype)], axis=0), check_finite=False)
            out = [enc.scales[:b], enc.codes1[:b], enc.codes2[:b], enc.scales[b:], enc.codes1[b:], enc.codes2[b:]]
            if resident:
                x = codec.unrotate(_dequantize(codec, enc.codes1, enc.codes2), enc.scales, keys.dtype)
                out += [_plus_mean(x[:b], mean), x[b:]]
            return tuple(out)

        fn = _fns[key] = mx.compile(append)
    return fn


def _dequantize(codec: RVQCodec, c1: mx.array, c2: mx.array) -> mx.array:
    """The codec's MLX-ops rotated-domain decode (group tables where the bits allow)."""
    lut = codec._group_lut(True)
    if lut is not None:
        return codec._lut_fn(c1, c2, lut[0], lut[1], True)
    return codec._dequantize_fn(c1, c2)


def _plus_mean(keys: mx.array, mean: mx.array | None) -> mx.array:
    """Decoded keys with the key mean added back (rvqstore.cache_state's rule), or as they are."""
    if mean is None:
        return keys
    return (keys.astype(mx.float32) + mean).astype(keys.dtype)


def decode_fn(codec: RVQCodec, dtype: mx.Dtype, centered: bool = False):
    """``f(ks, k1, k2, vs, v1, v2)`` -> decoded keys and values of the whole buffers, in ``dtype``;
    ``centered``: ``f(ks, k1, k2, vs, v1, v2, mean)``, the keys with ``mean`` added back."""
    key = _key(codec, "decode", str(dtype), centered)
    fn = _fns.get(key)
    if fn is None:
        def decode(ks, k1, k2, vs, v1, v2, mean=None):
            b = ks.shape[0]
            y = _dequantize(codec, mx.concatenate([k1, v1]), mx.concatenate([k2, v2]))
            x = codec.unrotate(y, mx.concatenate([ks, vs]), dtype)
            return _plus_mean(x[:b], mean), x[b:]

        fn = _fns[key] = mx.compile(decode)
    return fn
