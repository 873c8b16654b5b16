"""rvqstore.device_args: small kernel constants copied bit for bit, padded where CUDA needs it, and left as
the host arrays elsewhere."""

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import device_args


def test_off_the_cuda_gpu_the_host_values_come_back_unpadded():
    if device_args.wanted():
        pytest.skip("this machine's default device is a CUDA GPU: the other test covers it")
    a = device_args.constant([7, 9], mx.uint32)
    assert a.dtype == mx.uint32 and a.tolist() == [7, 9]
    assert device_args.count_shape() == (1,)
    host = mx.array([1.5, -0.0], dtype=mx.float32)
    assert device_args.moved(host) is host


@pytest.fixture
def on_cuda(monkeypatch):
    """The CUDA path's logic, run on this machine's device (the copy is an MLX op wherever it runs)."""
    monkeypatch.setattr(device_args, "wanted", lambda: True)


def test_constants_are_padded_past_the_scalar_pool(on_cuda):
    a = device_args.constant([5], mx.uint32)
    assert a.nbytes >= 16 and a.nbytes > 8
    assert a.tolist()[0] == 5 and all(v == 0 for v in a.tolist()[1:])
    f = device_args.constant([0.25], mx.float32)
    assert f.nbytes >= 16 and f.tolist()[0] == 0.25
    wide = device_args.constant([1, 2, 3, 4, 5, 6], mx.uint32)
    assert wide.tolist() == [1, 2, 3, 4, 5, 6]  # long enough already: no padding
    assert device_args.count_shape()[0] * 4 >= 16


def test_moved_keeps_every_bit(on_cuda):
    bits = np.array([0x80000000, 0x7FC00001, 0xFF800000, 0x3F800000, 0x00000001], dtype=np.uint32)
    host = mx.array(bits).view(mx.float32)  # -0.0, a NaN with a payload, -inf, 1.0, a denormal
    out = device_args.moved(host)
    assert out is not host and out.dtype == mx.float32 and out.shape == host.shape
    assert np.array(out.view(mx.uint32)).tolist() == bits.tolist()
    half = mx.array(np.array([0x8000, 0x7E01, 1, 2, 3], dtype=np.uint16)).view(mx.bfloat16)
    assert np.array(device_args.moved(half).view(mx.uint16)).tolist() == [0x8000, 0x7E01, 1, 2, 3]
    small = mx.array([3], dtype=mx.uint32)
    assert device_args.moved(small) is small  # an 8-byte array would land in the scalar pool again


def test_moved_inside_a_transformation_hands_back_the_host_array(on_cuda):
    host = mx.array([1.0, 2.0, 3.0, 4.0], dtype=mx.float32)

    def f(x):
        return x * device_args.moved(host)

    assert mx.compile(f)(mx.ones(4)).tolist() == [1.0, 2.0, 3.0, 4.0]
