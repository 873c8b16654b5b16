"""rvqstore.device_memory: the loader's device copies (CUDA) are bit-for-bit copies, and only CUDA makes them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import device_memory, fused


@pytest.mark.parametrize("dtype", [mx.uint32, mx.uint16, mx.bfloat16, mx.float16, mx.float32, mx.int32, mx.uint8])
def test_copy_bits_keeps_every_bit(dtype):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, 64 * dtype.size, dtype=np.uint8)  # any pattern: NaN payloads, -0, subnormals
    a = mx.array(raw).view(dtype)
    c = device_memory.copy_bits(a)
    assert c is not a and c.dtype == dtype and c.shape == a.shape
    assert np.array_equal(np.array(c.view(mx.uint8)), raw)


def test_copies_are_made_on_cuda_only(monkeypatch):
    if fused.gpu_backend() != "cuda":
        assert device_memory.onto_device() is None
    monkeypatch.setattr(fused, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(fused, "_on_gpu", lambda: False)  # a CUDA build whose default device is the CPU
    assert device_memory.onto_device() is None
    monkeypatch.setattr(fused, "_on_gpu", lambda: True)
    copy = device_memory.onto_device()
    a = mx.arange(10, dtype=mx.uint32)
    c = copy(a)
    assert c is not a and mx.array_equal(c, a)
    empty = mx.zeros((0, 3), mx.uint32)
    assert copy(empty) is empty  # nothing to copy


def test_a_load_on_cuda_holds_the_same_codes(tmp_path, monkeypatch):
    """The load path with the copies on (as on CUDA without the pinned ring) gives caches equal to the plain
    load's."""
    import rvqstore
    from rvqstore import RVQKVCache, device_upload

    monkeypatch.setenv(device_upload.ENV, "0")  # the regular reader's path (the ring's: tests/test_device_upload.py)

    rng = np.random.default_rng(3)
    caches = [RVQKVCache((2, 2), use_kernels=False) for _ in range(2)]
    for c in caches:
        c.update_and_fetch(*(mx.array(rng.standard_normal((1, 2, 40, 64)).astype(np.float16)) for _ in range(2)))
    rvqstore.save_prompt_cache(tmp_path / "p.rvq", caches)
    plain = rvqstore.load_prompt_cache(tmp_path / "p.rvq")
    made = []
    real = device_memory.copy_bits
    monkeypatch.setattr(device_memory, "onto_device", lambda: lambda a: made.append(1) or real(a))
    copied = rvqstore.load_prompt_cache(tmp_path / "p.rvq")
    assert len(made) >= 12  # every section of both layers went through the copy
    for a, b in zip(plain, copied):
        for x, y in zip(a.state[:6], b.state[:6]):
            assert x.dtype == y.dtype and mx.array_equal(x, y)
