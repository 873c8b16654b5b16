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

from kernel_models import model_launch_inplace, pretend_cuda  # noqa: E402

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
@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_kernel_paths_bookkeeping_matches_the_portable_path(monkeypatch, mode):
    """With the four launches replaced by their MLX-ops models and a CUDA device pretended, a cache
    (fused append, in place, copy append across a capacity growth, staging, unpack, trims) holds exactly what the
    portable path holds: the buffer handling around the kernels is tested without a GPU."""
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
        pretend_cuda(m)
        fast, fk, fv = run()
        served, unpacked = set(cache_append._verified), set(cache_fetch._verified)
        assert not cache_append._disabled and not cache_fetch._disabled
    assert any(cfg[-1] == (mode == "resident") for cfg in served)
    assert any("inplace" in cfg for cfg in served)  # single steps were written in place
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


def test_inplace_writes_never_reach_what_was_handed_out(monkeypatch):
    """Positions written in place are never ones an earlier array could read: after a trim the cache
    copies its buffers once before it writes in place again (views of the state taken before keep their
    values), and arrays
    that came from outside (a loaded state) are never written in place. Bookkeeping only, on every
    backend (the in-place launch replaced by its model, a CUDA device pretended)."""
    rng = np.random.default_rng(5)
    k = mx.array(rng.standard_normal((1, 2, 120, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 120, 64)).astype(np.float32))
    writes = []

    def counted(codec, keys, values, kb, vb, count, resident=False):
        writes.append(int(count[0].item()))
        return model_launch_inplace(codec, keys, values, kb, vb, count, resident)

    with monkeypatch.context() as m:
        pretend_cuda(m, counted)
        m.setattr(cache_append, "COPY_MAX_TOKENS", 0)  # in place or slice updates, no copies
        c = RVQKVCache((2, 2))
        c.update_and_fetch(k[:, :, :40], v[:, :, :40])
        for i in range(40, 60):
            c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
        assert writes[-1] == 59 and c._keys._count is not None  # written in place, count pending
        held = [np.array(a) if a.dtype != mx.bfloat16 else np.array(a.view(mx.uint16))
                for a in c.state if a is not None]
        assert c._keys._count is None  # reading the state finished the pending write first
        views = [a for a in c.state if a is not None]
        c.trim(5)
        n_writes = len(writes)
        for i in range(55, 65):  # positions 55..59 were handed out: not rewritten in place
            c.update_and_fetch(k[:, :, (i + 7):(i + 8)], v[:, :, (i + 7):(i + 8)])
        # the first token after the trim went into new buffers (a copy), the others in place again
        assert writes[n_writes:] == list(range(56, 65))
        for a, want in zip(views, held):
            got = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
            assert np.array_equal(got, want)  # the views taken before the trim kept their values
        st = c.state
        loaded = RVQKVCache.from_packed(keys=st[0:3], values=st[3:6], dense_keys=None, dense_values=None,
                                        dtype=mx.float32, head_dims=(64, 64), bits=(2, 2))
        before = [a for a in st[:6] if a is not None]
        outside = [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in before]
        n_writes = len(writes)
        loaded.update_and_fetch(k[:, :, :1], v[:, :, :1])
        assert len(writes) == n_writes  # full buffers from outside: grown (copied), not written in place
        for a, want in zip(before, outside):
            assert np.array_equal(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a), want)
