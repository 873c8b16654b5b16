import mlx.core as mx
import numpy as np
import pytest

from rvqstore import hadamard
from rvqstore.codebooks import gaussian_codebook, residual_tables, stage1_mse
from rvqstore.errors import CodecConfigError
from rvqstore.prng import bits_to_signs, rotation_signs, signs_to_bits, splitmix64


@pytest.mark.parametrize("bits,centroids,mse", [
    (1, [0.7979], 0.3634),
    (2, [0.4528, 1.5104], 0.1175),
    (3, None, 0.03455),
    (4, None, 0.00950),
])
def test_gaussian_lloyd_max_matches_classic_values(bits, centroids, mse):
    cb = gaussian_codebook(bits)
    assert len(cb.centroids) == 1 << bits and len(cb.boundaries) == (1 << bits) - 1
    np.testing.assert_allclose(cb.centroids, -cb.centroids[::-1], atol=1e-6)  # symmetric
    if centroids:
        np.testing.assert_allclose(cb.centroids[len(cb.centroids) // 2:], centroids, atol=1e-4)
    assert abs(stage1_mse(bits) - mse) < 1e-4 * max(1.0, mse * 100)
    np.testing.assert_allclose(cb.boundaries, (cb.centroids[1:] + cb.centroids[:-1]) / 2, rtol=1e-6)


@pytest.mark.parametrize("b1", [1, 2, 3, 4])
@pytest.mark.parametrize("b2", [1, 2, 3, 4])
def test_conditional_tables_nest_inside_stage1_cells(b1, b2):
    cb = gaussian_codebook(b1)
    rt = residual_tables("conditional", b1, b2)
    edges = np.concatenate([[-np.inf], cb.boundaries, [np.inf]])
    for i in range(1 << b1):
        assert np.all(rt.boundaries[i] > edges[i]) and np.all(rt.boundaries[i] < edges[i + 1])
        assert np.all(np.diff(rt.centroids[i]) > 0)


def test_conditional_1plus1_is_the_2bit_lloyd_max_quantizer():
    # refining each 1-bit cell with a 1-bit Lloyd–Max quantizer of the truncated Gaussian gives
    # the unconstrained 2-bit optimum (its boundary at 0 coincides with the 1-bit boundary)
    np.testing.assert_allclose(residual_tables("conditional", 1, 1).centroids.reshape(-1),
                               gaussian_codebook(2).centroids, atol=1e-6)


def test_shared_table_is_scaled_laplacian():
    rt = residual_tables("shared", 2, 1)
    beta = np.sqrt(stage1_mse(2) / 2)
    # 1-bit Lloyd–Max of Laplace(0, beta) has centroids +-beta
    np.testing.assert_allclose(rt.centroids[0], [-beta, beta], rtol=1e-5)
    assert np.all(rt.centroids == rt.centroids[0])


def test_splitmix64_reference_values():
    # published reference outputs of SplitMix64 for seed 0 and seed 1234567
    assert splitmix64(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert splitmix64(1234567, 1) == [6457827717110365317]


def test_signs_portable_and_round_trip():
    s = rotation_signs(0, 8)
    # top bits of the first 8 seed-0 outputs
    expect = [-1.0 if (z >> 63) else 1.0 for z in splitmix64(0, 8)]
    assert s.tolist() == expect
    for dim in (1, 7, 64, 80, 128):
        sg = rotation_signs(42, dim)
        np.testing.assert_array_equal(bits_to_signs(signs_to_bits(sg), dim), sg)
    assert rotation_signs(1, 128).tolist() != rotation_signs(2, 128).tolist()


@pytest.mark.parametrize("m", [12, 20, 28])
def test_base_matrices_are_mlx_hadamard(m):
    # on the CPU stream: MLX's CUDA kernel has no transform of size m alone (rvqstore routes around it)
    ref = mx.hadamard_transform(mx.eye(m), scale=1.0, stream=mx.cpu)
    np.testing.assert_array_equal(hadamard.base_matrix(m), np.array(ref))


@pytest.mark.parametrize("dim", [2, 8, 12, 20, 28, 64, 80, 96, 112, 128, 160, 224, 256, 1024])
def test_forward_is_kron_and_inverse_undoes_it(dim):
    m, p = hadamard.check_dim(dim)
    sylvester = np.array([[1.0]])
    while sylvester.shape[0] < p:
        sylvester = np.block([[sylvester, sylvester], [sylvester, -sylvester]])
    M = np.kron(hadamard.base_matrix(m), sylvester)
    x = np.random.default_rng(dim).standard_normal((3, dim)).astype(np.float32)
    y = hadamard.forward(mx.array(x))
    np.testing.assert_allclose(np.array(y), x @ M, rtol=1e-4, atol=1e-4)
    back = hadamard.inverse(y, 1.0 / dim)
    np.testing.assert_allclose(np.array(back), x, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dim", [0, 1, 3, 36, 44, 100, 65536, -4])
def test_unsupported_dims_name_supported_sizes(dim):
    with pytest.raises(CodecConfigError, match=r"m \* 2\^k"):
        hadamard.check_dim(dim)
