"""MLX-ops models of the cache's CUDA-only launches (rvqstore.cache_append, rvqstore.cache_fetch): with a
CUDA device pretended, tests swap them in to check the caches' bookkeeping around the kernels on any
backend. Each computes what its kernel computes, with the codec's own encode and decode."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from rvqstore import cache_steps


def model_launch(codec, keys, values, resident=False):
    """What the append kernel computes, with the codec's MLX-ops encode (and decode)."""
    b = keys.shape[0]
    enc = codec.encode(mx.concatenate([keys, values]), check_finite=False)
    out = (enc.scales[:b], enc.codes1[:b], enc.codes2[:b], enc.scales[b:], enc.codes1[b:], enc.codes2[b:])
    if resident:
        dec = codec.decode(enc)
        out += (dec[:b], dec[b:])
    return out


def model_launch_copy(codec, keys, values, key_buffers, value_buffers, n, cap, count=None):
    """The copy append: new buffers of ``cap`` tokens holding the old first ``n`` and then the new ones."""
    new = model_launch(codec, keys, values)
    t = keys.shape[2]
    out = []
    for old, fresh in zip((*key_buffers, *value_buffers), new):
        buf = mx.zeros(old.shape[:2] + (cap,) + old.shape[3:], old.dtype)
        buf[:, :, :n] = old[:, :, :n]
        buf[:, :, n:n + t] = fresh
        out.append(buf)
    return tuple(out)


def writable(a):
    """A numpy view of an evaluated array's own memory (CPU): where a kernel writing in place writes."""
    mx.eval(a)
    return np.frombuffer(memoryview(a).cast("B"), dtype=np.uint16 if a.dtype == mx.bfloat16 else np.uint32
                         ).reshape(a.shape)


def model_launch_inplace(codec, keys, values, key_buffers, value_buffers, count, resident=False):
    """The in-place append: the new tokens' codes written into the buffers' memory at [n, n + t) (``resident``:
    with the new tokens decoded)."""
    n, t = int(count[0].item()), keys.shape[2]
    out = model_launch(codec, keys, values, resident)
    for buf, fresh in zip((*key_buffers, *value_buffers), out):
        writable(buf)[:, :, n:n + t] = np.asarray(fresh.view(mx.uint16) if fresh.dtype == mx.bfloat16 else fresh)
    done = mx.array([n + t], dtype=mx.uint32)
    return (done, *out[6:]) if resident else done


def model_unpack(codec, key_buffers, value_buffers, n, dtype, count=None):
    k, v = cache_steps.decode_fn(codec, dtype)(*key_buffers, *value_buffers)
    return k[:, :, :n], v[:, :, :n]


def swap_launches(m, inplace=model_launch_inplace) -> None:
    """With ``m`` (pytest's monkeypatch or one of its contexts): the cache's CUDA launches replaced by
    their models (``inplace``: the in-place append's, or a wrapper of it) and fresh first-use state."""
    from rvqstore import cache_append, cache_fetch

    m.setattr(cache_append, "launch", model_launch)
    m.setattr(cache_append, "launch_copy", model_launch_copy)
    m.setattr(cache_append, "launch_inplace", inplace)
    m.setattr(cache_fetch, "launch", model_unpack)
    for mod in (cache_append, cache_fetch):
        m.setattr(mod, "_verified", set())
        m.setattr(mod, "_disabled", {})


def pretend_cuda(m, inplace=model_launch_inplace) -> None:
    """:func:`swap_launches`, on a CUDA device pretended, with the codec's own kernels and the attention
    kernel declining (their MLX-ops paths run)."""
    from rvqstore import fused
    from rvqstore.attention import kernel

    m.setattr(fused, "gpu_backend", lambda: "cuda")
    m.setattr(fused, "_on_gpu", lambda: True)
    m.setattr(fused, "quantize_pack", lambda *a: None)
    m.setattr(fused, "unpack_dequantize", lambda *a: None)
    m.setattr(kernel, "attend", lambda *a, **kw: None)
    swap_launches(m, inplace)
