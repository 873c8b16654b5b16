"""rvqstore.entropy_coding: rANS-coded joint indices decode exactly to the codec's packed codes, at
the model's entropy on Gaussian data; bad input is refused with typed errors."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("constriction")

from rvqstore import CodecConfigError, RVQCodec  # noqa: E402
from rvqstore import entropy_coding as E  # noqa: E402


@pytest.mark.parametrize("bits", [(2, 0), (2, 2), (4, 1), (1, 1)])
def test_roundtrip_to_the_packed_layout(bits):
    codec = RVQCodec(64, bits)
    x = mx.array(np.random.default_rng(0).standard_normal((3, 400, 64)).astype(np.float32))
    idx, _ = E.joint_indices(codec, x)
    c1, c2 = codec.quantize(codec.rotate(x)[0])
    coded = E.encode(codec, idx)
    back = E.decode(codec, coded)
    assert np.array_equal(back, idx)
    p1, p2 = E.to_packed(codec, back)
    assert np.array_equal(np.array(p1), np.array(c1))
    assert (p2 is None and c2 is None) or np.array_equal(np.array(p2), np.array(c2))
    # Gaussian input: rANS lands within 2% of the model's entropy, below the fixed width
    p = E.gaussian_model(codec)
    h = float(-(p * np.log2(p)).sum())
    assert h <= coded.nbytes * 8 / idx.size < 1.02 * h
    assert h < sum(bits)


def test_model_is_the_gaussian_cell_probabilities():
    p = E.gaussian_model(RVQCodec(64, (2, 0)))
    np.testing.assert_allclose(p, [0.1631, 0.3369, 0.3369, 0.1631], atol=2e-4)
    assert E.gaussian_model(RVQCodec(64, (2, 2))).shape == (16,)


def test_bad_input_refused():
    codec = RVQCodec(64, (2, 2))
    idx, _ = E.joint_indices(codec, mx.ones((2, 64)))
    coded = E.encode(codec, idx)
    with pytest.raises(CodecConfigError):
        E.decode(codec, E.CodedIndices((2, 32), coded.words))  # not this codec's dim
    with pytest.raises(CodecConfigError):
        E.decode(codec, E.CodedIndices((10 ** 9, 64), coded.words))  # far more symbols than the words hold
    with pytest.raises(CodecConfigError, match="conditional"):
        E.gaussian_model(RVQCodec(64, (2, 2), residual="shared"))
