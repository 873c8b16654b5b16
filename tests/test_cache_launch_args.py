"""The CUDA step launches' arguments (rvqstore.cache_append, rvqstore.cache_fetch) on any machine.

Their launch arguments are kept per shape, dtype and capacity (``_Call``) and the kernel is launched through a
prepared configuration (:class:`rvqstore.kernel_cache.PreparedLaunch`); here MLX's precompiled launch is a
recorder, so what each call would hand to the GPU is checked: counts, capacities, grids and outputs follow the
cache as it steps, trims, grows and changes dtype. Running the kernels is tests/test_cache_append_gpu.py's job.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQCodec, cache_append, cache_fetch, kernel_cache, kernel_ref


@pytest.fixture
def launches(monkeypatch):
    """Every precompiled launch's keyword arguments, in order (outputs: zeros of the asked shapes)."""
    seen = []

    def precompiled(**kw):
        seen.append(kw)
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    monkeypatch.setattr(kernel_cache, "cache_dir", lambda: Path("/nonexistent-rvqstore-test"))
    monkeypatch.setenv(kernel_ref.ENV, "0")  # the binaries themselves are looked at
    monkeypatch.setattr(kernel_cache, "get_binary", lambda tu, func: (func, tu, "key-" + func))
    monkeypatch.setattr(kernel_cache.mx, "eval", lambda *a: None)  # the first launch's load check
    return seen


def _kv(t, dtype=mx.float16, seed=0):
    rng = np.random.default_rng(seed)
    return [mx.array(rng.standard_normal((1, 2, t, 64)).astype(np.float32)).astype(dtype) for _ in range(2)]


def _values(a) -> list:
    return np.array(a).tolist()


def _padded(values: list) -> list:
    """``values`` as a launch's small constant holds them: zero-padded to 16 bytes where the constants live in
    device memory (CUDA: rvqstore.device_args), as they are elsewhere."""
    from rvqstore import device_args

    return _values(device_args.constant(values, mx.uint32))


def test_append_launches_follow_shape_and_dtype(launches):
    codec = RVQCodec(64, (2, 2))
    w1, w2 = codec.words1, codec.words2
    for t, dtype in ((1, mx.float16), (1, mx.float16), (3, mx.float16), (1, mx.bfloat16)):
        k, v = _kv(t, dtype)
        out = cache_append.launch(codec, k, v, resident=t == 3)
        kw = launches[-1]
        lead = (1, 2, t)
        shapes = [lead, lead + (w1,), lead + (w2,)] * 2 + ([(1, 2, t, 64)] * 2 if t == 3 else [])
        assert kw["output_shapes"] == shapes and [a.shape for a in out] == shapes
        assert kw["grid"] == (2 * 2 * t * 64, 1, 1) and kw["threadgroup"] == (64, 1, 1)
        assert kw["inputs"][0] is k and kw["inputs"][1] is v and _values(kw["inputs"][6]) == _padded([2 * t])
    names = [kw["name"] for kw in launches]
    assert names[0] == names[1] and len(set(names)) == 3  # one binary per template and dtype
    assert "using InT = __half;" in launches[0]["compiled_source"]
    assert "using InT = __nv_bfloat16;" in launches[3]["compiled_source"]


def test_copy_launches_follow_count_and_capacity(launches):
    codec = RVQCodec(64, (2, 2))
    w1, w2 = codec.words1, codec.words2
    k, v = _kv(1)
    bufs = {}
    for cap in (256, 512):
        bufs[cap] = [mx.zeros((1, 2, cap), mx.bfloat16), mx.zeros((1, 2, cap, w1), mx.uint32),
                     mx.zeros((1, 2, cap, w2), mx.uint32)]
    # a step, another, a trim back, a step that grows the buffers
    for n, cap_old, cap in ((5, 256, 256), (6, 256, 256), (3, 256, 256), (255, 256, 256), (256, 256, 512)):
        cache_append.launch_copy(codec, k, v, bufs[cap_old], bufs[cap_old], n, cap)
        kw = launches[-1]
        lead = (1, 2, cap)
        assert kw["output_shapes"] == [lead, lead + (w1,), lead + (w2,)] * 2
        side = 2 * n * (w1 + w2 + 1)
        assert kw["grid"] == ((2 * 2 + -(-2 * side // 64)) * 64, 1, 1)
        assert _values(kw["inputs"][6]) == [2, 1, cap_old, cap] and _values(kw["inputs"][7]) == [n]
        assert kw["inputs"][8] is bufs[cap_old][0]


def test_unpack_launches_follow_count_capacity_and_dtype(launches):
    codec = RVQCodec(64, (2, 2))
    for n, cap, dtype in ((7, 256, mx.float16), (8, 256, mx.float16), (4, 256, mx.float16), (300, 512, mx.float16),
                          (300, 512, mx.bfloat16)):
        bufs = [mx.zeros((1, 2, cap), mx.bfloat16), mx.zeros((1, 2, cap, codec.words1), mx.uint32),
                mx.zeros((1, 2, cap, codec.words2), mx.uint32)]
        k, v = cache_fetch.launch(codec, bufs, bufs, n, dtype)
        kw = launches[-1]
        assert k.shape == v.shape == (1, 2, n, 64) and k.dtype == v.dtype == dtype
        assert kw["output_shapes"] == [(1, 2, n, 64)] * 2 and kw["grid"] == (2 * 2 * n * 64, 1, 1)
        assert _values(kw["inputs"][8]) == [n] and _values(kw["inputs"][9]) == [cap, 2]
    assert len({kw["name"] for kw in launches}) == 2  # float16 and bfloat16 outputs


def test_counts_are_shared_between_launches_of_the_same_count():
    a, b = cache_append.shared_count(12), cache_append.shared_count(12)
    assert a is b and _values(a) == [12] and _values(cache_append.shared_count(13)) == [13]
