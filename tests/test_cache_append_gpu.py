"""The fused append (kernels/rvq_append.inc, rvqstore.cache_append): one launch encodes a step's keys
and values; and the unpack (kernels/rvq_unpack.inc, rvqstore.cache_fetch): one launch decodes what a
packed cache hands back. On the GPU it must agree with the codec's encode (norms within one bfloat16 ulp, nearly
every code word equal: only the order of the norm's sum may differ), serve packed caches, and leave
them reading back what the codec decodes. With RVQ_ATTN_PARITY_REPORT=path each GPU comparison
appends a line there (tools/results/gpu-parity-attention.txt)."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQCodec, RVQKVCache, cache_append, cache_fetch
from rvqstore.codec import EncodedVectors

REPORT = os.environ.get("RVQ_ATTN_PARITY_REPORT")


def test_supported_configurations():
    assert cache_append.supported(RVQCodec(128, (2, 2))) is None
    assert cache_append.supported(RVQCodec(96, (2, 2))) is not None  # not a power of two
    assert cache_append.supported(RVQCodec(128, (4, 0))) is not None  # single stage
    assert cache_append.supported(RVQCodec(128, (3, 1))) is not None  # 3-bit codes


def test_declines_off_cuda():
    if mx.default_device().type == mx.DeviceType.gpu and cache_append.fused.gpu_backend() == "cuda":
        pytest.skip("a CUDA device serves the call")
    k = mx.zeros((1, 2, 3, 128), mx.float16)
    assert cache_append.append(RVQCodec(128, (2, 2)), k, k) is None


CASES = [  # (bits, residual, d, dtype, heads, tokens)
    ((2, 2), "conditional", 128, mx.float16, 8, 1),
    ((2, 2), "conditional", 128, mx.float16, 8, 700),
    ((4, 2), "conditional", 128, mx.bfloat16, 4, 33),
    ((2, 2), "shared", 64, mx.float32, 3, 17),
    ((1, 1), "conditional", 256, mx.float16, 2, 5),
    ((4, 4), "conditional", 32, mx.float32, 2, 9),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][0]}+{c[0][1]}-{c[1][:4]}-d{c[2]}-{c[3]}-h{c[4]}-t{c[5]}")
def test_gpu_fused_append_agrees_with_the_codec(case):
    if cache_append.fused.gpu_backend() != "cuda":
        pytest.skip("the fused append is CUDA only")
    bits, residual, d, dtype, h, t = case
    rng = np.random.default_rng(d + t)
    x = rng.standard_normal((2, 1, h, t, d)).astype(np.float32) * 3.0
    x[0, 0, 0, 0] = np.nan  # a non-finite vector: NaN norm and the zero vector's codes, as the codec
    k, v = (mx.array(a).astype(dtype) for a in x)
    codec = RVQCodec(d, bits, 0, residual)
    out = cache_append.launch(codec, k, v)
    mx.eval(out)
    why = cache_append.check(codec, k, v, out)
    ref = codec.encode(mx.concatenate([k, v]), check_finite=False)
    got_scales = mx.concatenate([out[0], out[3]])
    exact = float(mx.mean(mx.concatenate([out[1], out[4]]) == ref.codes1).item())
    same_scale = float(mx.mean(got_scales.view(mx.uint16) == ref.scales.view(mx.uint16)).item())
    if REPORT:
        with open(REPORT, "a") as f:
            f.write(f"append-vs-encode\t{'pass' if why is None else 'FAIL'}\t{case[:2]} d={d} {dtype} h={h} t={t} "
                    f"equal codes1 words={exact:.5f} equal norms={same_scale:.5f}\n")
    assert why is None, why
    assert bool(mx.isnan(out[0][0, 0, 0]).item())
    # what the cache reads back is the codec's decode of the kernel's codes
    dec = codec.decode(EncodedVectors(out[0], out[1], out[2], dtype))
    err = float(mx.abs(dec[:, 1:].astype(mx.float32) - k[:, 1:].astype(mx.float32)).max())
    assert err < 0.8 * float(mx.abs(k[:, 1:].astype(mx.float32)).max())


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_gpu_cache_steps_through_the_fused_append(mode):
    if cache_append.fused.gpu_backend() != "cuda":
        pytest.skip("the fused append is CUDA only")
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((1, 4, 40, 128)).astype(np.float16))
    v = mx.array(rng.standard_normal((1, 4, 40, 128)).astype(np.float16))
    c = RVQKVCache((2, 2), mode=mode)
    c.update_and_fetch(k[:, :, :30], v[:, :, :30])
    for i in range(30, 40):
        kk, vv = c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
    assert not cache_append.disabled() and any(cfg[-1] == (mode == "resident") for cfg in cache_append._verified)
    codec = c._keys.codec
    ks, k1, k2 = c._keys.used()
    vs, v1, v2 = c._values.used()
    if mode == "packed":  # what update_and_fetch returned came from the unpack kernel (rvqstore.cache_fetch)
        assert cache_fetch._verified and not cache_fetch.disabled()
    # packed: the unpack kernel's output, resident: the append kernel's decoded copy; both bit-identical
    # to decoding the stored codes
    assert mx.array_equal(kk, codec.decode(EncodedVectors(ks, k1, k2, mx.float16)))
    assert mx.array_equal(vv, codec.decode(EncodedVectors(vs, v1, v2, mx.float16)))
    # the codes agree with the codec's own encode of the same tokens (nearly every word)
    ref = codec.encode(k, check_finite=False)
    assert float(mx.mean(k1 == ref.codes1).item()) >= cache_append.MIN_EQUAL_WORDS


@pytest.mark.gpu
def test_gpu_copy_append_equals_slice_updates(monkeypatch):
    # packed caches at short contexts take whole new buffers from the kernel (old tokens copied, new
    # ones encoded): the same buffers as the launch + slice updates, across a capacity growth (256)
    if cache_append.fused.gpu_backend() != "cuda":
        pytest.skip("the fused append is CUDA only")
    rng = np.random.default_rng(3)
    k = mx.array(rng.standard_normal((1, 4, 300, 128)).astype(np.float16))
    v = mx.array(rng.standard_normal((1, 4, 300, 128)).astype(np.float16))

    def run():
        c = RVQKVCache((2, 2))
        c.update_and_fetch(k[:, :, :200], v[:, :, :200])
        for i in range(200, 300):
            c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
        return c

    copied = run()
    assert any("copy" in cfg for cfg in cache_append._verified) and not cache_append.disabled()
    monkeypatch.setattr(cache_append, "COPY_MAX_TOKENS", 0)
    updated = run()
    for a, b in zip(copied.state, updated.state):
        assert (a is None and b is None) or mx.array_equal(a, b)


# ---- on every backend: the caches' bookkeeping around the CUDA-only launches ------------------------------
def _model_launch(codec, keys, values, resident=False):
    """What the append kernel computes, with the codec's MLX-ops encode (and decode)."""
    b = keys.shape[0]
    enc = codec.encode(mx.concatenate([keys, values]), check_finite=False)
    out = (enc.scales[:b], enc.codes1[:b], enc.codes2[:b], enc.scales[b:], enc.codes1[b:], enc.codes2[b:])
    if resident:
        dec = codec.decode(enc)
        out += (dec[:b], dec[b:])
    return out


def _model_launch_copy(codec, keys, values, key_buffers, value_buffers, n, cap):
    """The copy append: new buffers of ``cap`` tokens holding the old first ``n`` and then the new ones."""
    new = _model_launch(codec, keys, values)
    t = keys.shape[2]
    out = []
    for old, fresh in zip((*key_buffers, *value_buffers), new):
        buf = mx.zeros(old.shape[:2] + (cap,) + old.shape[3:], old.dtype)
        buf[:, :, :n] = old[:, :, :n]
        buf[:, :, n:n + t] = fresh
        out.append(buf)
    return tuple(out)


def _model_unpack(codec, key_buffers, value_buffers, n, dtype):
    from rvqstore import cache_steps

    k, v = cache_steps.decode_fn(codec, dtype)(*key_buffers, *value_buffers)
    return k[:, :, :n], v[:, :, :n]


@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_kernel_paths_bookkeeping_matches_the_portable_path(monkeypatch, mode):
    """With the three launches replaced by their MLX-ops models and a CUDA device pretended, a cache
    (fused append, copy append across a capacity growth, staging, unpack, trims) holds exactly what the
    portable path holds: the buffer handling around the kernels is tested without a GPU."""
    from rvqstore import fused
    from rvqstore.attention import kernel

    rng = np.random.default_rng(11)
    k = mx.array(rng.standard_normal((1, 2, 300, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 300, 64)).astype(np.float32))

    def run():
        c = RVQKVCache((2, 2), mode=mode)
        c.update_and_fetch(k[:, :, :250], v[:, :, :250])
        for i in range(250, 290):  # crosses the 256-token capacity step
            kk, vv = c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
        c.trim(3)
        kk, vv = c.update_and_fetch(k[:, :, 287:297], v[:, :, 287:297])
        mx.eval(kk, vv)
        return c, kk, vv

    with monkeypatch.context() as m:
        m.setattr(fused, "gpu_backend", lambda: "cuda")
        m.setattr(fused, "_on_gpu", lambda: True)
        m.setattr(fused, "quantize_pack", lambda *a: None)  # the codec's own kernels stay off
        m.setattr(fused, "unpack_dequantize", lambda *a: None)
        m.setattr(kernel, "attend", lambda *a, **kw: None)
        m.setattr(cache_append, "launch", _model_launch)
        m.setattr(cache_append, "launch_copy", _model_launch_copy)
        m.setattr(cache_fetch, "launch", _model_unpack)
        for mod in (cache_append, cache_fetch):
            m.setattr(mod, "_verified", set())
            m.setattr(mod, "_disabled", {})
        fast, fk, fv = run()
        served, unpacked = set(cache_append._verified), set(cache_fetch._verified)
        assert not cache_append._disabled and not cache_fetch._disabled
    assert any(cfg[-1] == (mode == "resident") for cfg in served)
    if mode == "packed":
        assert any("copy" in cfg and cfg[-1] for cfg in served)  # the copy append grew the buffers
        assert unpacked  # what update_and_fetch handed back came from the unpack (cache_modes.Packed.coded)
    else:
        assert not unpacked  # resident caches hand back their decoded copy
    ref, rk, rv = run()
    assert fast.offset == ref.offset == 297
    for a, b in zip(fast.state, ref.state):
        assert (a is None and b is None) or mx.array_equal(a, b)
    assert mx.array_equal(fk, rk) and mx.array_equal(fv, rv)
