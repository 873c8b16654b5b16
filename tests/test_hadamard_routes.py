"""The explicit-sum route for head dims without a power-of-two factor (12, 20, 28).

MLX's CUDA Hadamard kernel does not compile for ``dim = m`` (Sylvester size 1), so rvqstore takes
explicit signed sums there on every backend. These tests run on CPU: they hold the route to MLX's own
CPU transform bit for bit, and simulate the CUDA failure by making ``mx.hadamard_transform`` refuse
those sizes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQCodec, hadamard

NO_POW2 = (12, 20, 28)


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).view(np.uint32)


@pytest.mark.parametrize("dim", [2, 8, 12, 20, 24, 28, 40, 56, 64, 96, 128])
def test_route_only_for_dims_without_a_sylvester_factor(dim):
    assert hadamard.needs_explicit_route(dim) == (dim in NO_POW2)


@pytest.mark.parametrize("dim", NO_POW2)
@pytest.mark.parametrize("scale", [1.0, None, 0.37])
def test_explicit_forward_is_bit_identical_to_mlx_cpu_transform(dim, scale):
    scale = 1.0 / dim if scale is None else scale
    rng = np.random.default_rng(dim)
    x = rng.standard_normal((257, dim)).astype(np.float32) * rng.uniform(1e-3, 1e3, (257, 1)).astype(np.float32)
    x = mx.array(x)
    with mx.stream(mx.cpu):
        ref = mx.hadamard_transform(x, scale=scale)
        got = hadamard._explicit_transform(x, scale)
    np.testing.assert_array_equal(_bits(got), _bits(ref))


@pytest.mark.parametrize("dim", NO_POW2)
def test_explicit_inverse_undoes_forward_and_matches_the_matrix_product(dim):
    rng = np.random.default_rng(100 + dim)
    x = mx.array(rng.standard_normal((64, dim)).astype(np.float32))
    y = hadamard.forward(x)
    back = hadamard.inverse(y, 1.0 / dim)
    np.testing.assert_allclose(np.array(back), np.array(x), rtol=0, atol=1e-5)
    # the inverse is y @ M.T / dim with M = A_m here
    expect = (np.array(y, np.float64) @ hadamard.base_matrix(dim).T.astype(np.float64)) / dim
    np.testing.assert_allclose(np.array(back), expect, rtol=0, atol=1e-5)


def _codec_outputs(dim: int, x: mx.array):
    with mx.stream(mx.cpu):  # the routes these dims took before exist on the CPU backend only
        codec = RVQCodec(dim, (4, 2), seed=7, use_kernels=False)
        enc = codec.encode(x)
        dec = codec.decode(enc)
        mx.eval(enc.scales, enc.codes1, enc.codes2, dec)
        return np.array(enc.codes1), np.array(enc.codes2), _bits(enc.scales), _bits(dec)


@pytest.mark.parametrize("dim", NO_POW2)
def test_codec_results_unchanged_by_the_route(dim, monkeypatch):
    """Against the routes these dims took before: MLX's own transform forward (and inverse at 12), a
    BLAS matrix product for the inverse at 20/28. Codes and scales are bit-identical; decoded values
    too at 12. At 20/28 the old inverse summed in whatever order the BLAS library chose (OpenBLAS and
    the reference BLAS differ), the explicit sums in one fixed order: float32 rounding apart."""
    rng = np.random.default_rng(dim)
    x = mx.array(rng.standard_normal((3, 2, 50, dim)).astype(np.float32))
    routed = _codec_outputs(dim, x)
    monkeypatch.setattr(hadamard, "needs_explicit_route", lambda d: False)
    monkeypatch.setattr(hadamard, "_explicit_transform", _pre_route_inverse)
    before = _codec_outputs(dim, x)
    for a, b in zip(routed[:3], before[:3]):
        np.testing.assert_array_equal(a, b)
    dec, dec_before = routed[3].view(np.float32), before[3].view(np.float32)
    if dim == 12:
        np.testing.assert_array_equal(routed[3], before[3])
    else:
        # float32 rounding of a ~20-term sum: far below the codec's error (~1e-2 of the norm)
        np.testing.assert_allclose(dec, dec_before, rtol=0, atol=4e-7 * np.abs(dec_before).max())


def _pre_route_inverse(v: mx.array, scale: float, transpose: bool = False) -> mx.array:
    if v.shape[-1] == 12:
        return mx.hadamard_transform(v, scale=scale)
    z = hadamard._base_matrix_mx(v.shape[-1]) @ v[..., None]  # A_m on the left of the (m, 1) view
    return (z * scale).reshape(v.shape)


@pytest.mark.parametrize("dim", NO_POW2)
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_codec_works_where_the_kernel_refuses_sylvester_size_one(dim, dtype, monkeypatch):
    """Simulate MLX's CUDA kernel: any transform whose last axis has no power-of-two factor fails."""
    real = mx.hadamard_transform

    def cuda_like(a, scale=None):
        if hadamard.split_dim(a.shape[-1])[1] == 1:
            raise RuntimeError("hadamard.cuh: right operand of '%' is zero")
        return real(a, scale=scale)

    monkeypatch.setattr(mx, "hadamard_transform", cuda_like)
    rng = np.random.default_rng(dim)
    x = mx.array(rng.standard_normal((2, 3, 17, dim)).astype(np.float32)).astype(dtype)
    codec = RVQCodec(dim, (4, 4), use_kernels=False)
    out = codec.decode(codec.encode(x))
    assert out.dtype == dtype and out.shape == x.shape
    xf, of = np.array(x.astype(mx.float32)), np.array(out.astype(mx.float32))
    rel = np.sum((xf - of) ** 2) / np.sum(xf ** 2)
    assert rel < 2e-3
