"""A digest of a model's raw parameters, computed where they live: the proof that no weight changed since a
fingerprint was taken (:mod:`rvqstore.model_check`'s memo, :mod:`rvqstore.weights_cache`'s entries).

It covers every parameter's name, shape, dtype and raw bits (no conversion), so an in-place edit such as
``w[0, 0] += 1`` changes it. Two ways, one per kind of device, named in the digest (``xxh3-128:...`` /
``lanes-v1:...``), so digests of the two kinds never compare equal:

- **CPU** (the default device is the CPU): XXH3-128 over the bytes, on the host, at memory speed
  (0.07 s for SmolLM2-135M's 538 MB on this project's 2-core machines).
- **GPU**: the bytes never leave the device. On CUDA, MLX keeps arrays in managed memory, and a host read
  migrates their pages to the host (and the next kernel migrates them back): for an 8B float16 model
  16 GB each way on every check. Instead MLX reduces each parameter on the GPU to two 32-bit *lane
  sums*, and only those (8 bytes a parameter) are hashed on the host. Lane ``l`` of a parameter seen as
  32-bit words ``w_i`` is ``sum_i fmix32(w_i ^ (i * 0x9E3779B9 + c_l)) mod 2^32`` (``fmix32``: MurmurHash3's
  finalizer, a bijection of 32-bit words): changing any one word changes both sums (its term takes
  another value), swapping or moving words changes them (the index is mixed in), and any other change
  goes unnoticed with a chance of about 2^-32 per lane. Integer arithmetic only: the same parameters
  give the same digest in every run, whatever the reduction order.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np
import xxhash
from mlx.utils import tree_flatten

#: words per lane-sum call: bounds the temporaries MLX allocates (two lanes of uint32 per word)
_BLOCK_WORDS = 1 << 24
_LANE_SEEDS = (0x243F6A88, 0x85A308D3)  # the first digits of pi: arbitrary, fixed
_failed: dict[str, str] = {}  # "lanes" -> why the device digest could not run here (then: the host's)
log = logging.getLogger("rvqstore.parameter_digest")


def parameters_digest(model: Any, *, on_device: bool | None = None) -> str:
    """The digest of ``model.parameters()``; ``on_device`` None: lane sums on a GPU default device (the
    host's XXH3 if they fail there, logged once), XXH3 on the host otherwise; True/False force one kind
    (e.g. to test the GPU's on a CPU)."""
    params = tree_flatten(model.parameters())
    if on_device is not None:
        return _lanes_digest(params) if on_device else _host_digest(params)
    if mx.default_device() == mx.gpu and "lanes" not in _failed:
        try:
            return _lanes_digest(params)
        except Exception as err:  # noqa: BLE001 - a backend without some op: the host digest is as valid
            _failed["lanes"] = f"{type(err).__name__}: {err}"
            log.warning("parameter digest on the device failed (%s); digesting on the host", _failed["lanes"])
    return _host_digest(params)


def _header(name: str, a: mx.array) -> bytes:
    return f"{name}|{tuple(a.shape)}|{a.dtype}\n".encode()


def _host_digest(params: list) -> str:
    h = xxhash.xxh3_128()
    for name, a in params:
        h.update(_header(name, a))
        # a parameter may be a strided view (jamba's conv weights): bytes in C order, copied only then
        h.update(memoryview(np.ascontiguousarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)).cast("B"))
    return "xxh3-128:" + h.hexdigest()


def _words(a: mx.array) -> mx.array:
    """A parameter's raw bits as a flat uint32 array (C order): whole words where the bytes allow, else
    each 1- or 2-byte element widened to a word of its own."""
    flat = a.reshape(-1)
    if (flat.size * a.itemsize) % 4 == 0 and a.itemsize in (1, 2, 4, 8):
        return flat.view(mx.uint32)
    return flat.view({1: mx.uint8, 2: mx.uint16}[a.itemsize]).astype(mx.uint32)


def _fmix32(h: mx.array) -> mx.array:
    h = h ^ (h >> 16)
    h = h * mx.array(0x85EBCA6B, mx.uint32)
    h = h ^ (h >> 13)
    h = h * mx.array(0xC2B2AE35, mx.uint32)
    return h ^ (h >> 16)


@mx.compile
def _lane_sums(words: mx.array, start: mx.array) -> mx.array:
    """Both lane sums of ``words`` (uint32), the first at word index ``start``."""
    i = mx.arange(words.size, dtype=mx.uint32) + start
    base = i * mx.array(0x9E3779B9, mx.uint32)
    return mx.stack([mx.sum(_fmix32(words ^ (base + mx.array(c, mx.uint32)))) for c in _LANE_SEEDS])


def _lanes_digest(params: list) -> str:
    sums = []
    for _, a in params:
        w = _words(a)
        # whole blocks, then the rest: few distinct shapes to trace; a word index fits in uint32 (the
        # count is below 2^32 for any parameter under 16 GiB; larger ones wrap, still deterministic)
        parts = [_lane_sums(w[s: s + _BLOCK_WORDS], mx.array(s % (1 << 32), mx.uint32))
                 for s in range(0, w.size, _BLOCK_WORDS)]
        sums.append(mx.sum(mx.stack(parts), axis=0) if parts else mx.zeros((2,), mx.uint32))
        if len(sums) % 64 == 0:
            mx.eval(sums[-64:])  # keeps the graph (and the temporaries in flight) small
    host = np.array(mx.stack(sums)) if sums else np.zeros((0, 2), np.uint32)
    h = xxhash.xxh3_128()
    for (name, a), s in zip(params, host):
        h.update(_header(name, a))
        h.update(s.astype("<u4").tobytes())
    return "lanes-v1:" + h.hexdigest()


__all__ = ["parameters_digest"]
