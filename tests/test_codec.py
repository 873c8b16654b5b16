import hashlib
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQCodec, unpack_codes
from rvqstore.codec import EncodedVectors
from rvqstore.errors import CodecConfigError, InputShapeError, NonFiniteInputError

ROOT = Path(__file__).resolve().parents[1]


def gaussian(n, dim, seed=0, dtype=mx.float32):
    return mx.array(np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)).astype(dtype)


def rel_error(x, xh):
    x = np.array(x.astype(mx.float32), dtype=np.float64)
    xh = np.array(xh.astype(mx.float32), dtype=np.float64)
    return float(np.mean(np.sum((x - xh) ** 2, -1) / np.sum(x * x, -1)))


@pytest.fixture(scope="module")
def big_x():
    return gaussian(100_000, 128, seed=7)


def test_two_plus_two_conditional_meets_target(big_x):
    codec = RVQCodec(128, (2, 2))
    err = rel_error(big_x, codec.decode(codec.encode(big_x)))
    assert err <= 0.0105
    assert abs(err - codec.predicted_relative_error()) <= 0.01 * codec.predicted_relative_error()


_TWO_STAGE = [(1, 1), (1, 2), (2, 1), (2, 3), (3, 2), (3, 3), (4, 2), (1, 4), (4, 4)]
_CONFIGS = ([(b, r) for b in _TWO_STAGE for r in ("conditional", "shared")]
            + [((b, 0), "conditional") for b in (1, 2, 3, 4)])


@pytest.mark.parametrize("bits,residual", _CONFIGS)
def test_error_matches_prediction(bits, residual):
    x = gaussian(20_000, 128, seed=sum(bits))
    codec = RVQCodec(128, bits, seed=3, residual=residual)
    err = rel_error(x, codec.decode(codec.encode(x)))
    pred = codec.predicted_relative_error()
    assert abs(err - pred) <= 0.025 * pred, (err, pred)


@pytest.mark.parametrize("bits", [(1, 1), (2, 2), (3, 1), (2, 4)])
def test_conditional_beats_shared(bits):
    x = gaussian(20_000, 128, seed=11)
    errs = {r: rel_error(x, (c := RVQCodec(128, bits, residual=r)).decode(c.encode(x)))
            for r in ("conditional", "shared")}
    assert errs["conditional"] < errs["shared"]


@pytest.mark.parametrize("residual", ["conditional", "shared"])
def test_stage1_alone_is_the_single_stage_code(residual):
    x = gaussian(500, 96, seed=1)
    two = RVQCodec(96, (3, 2), seed=5, residual=residual)
    one = RVQCodec(96, (3, 0), seed=5)
    e2, e1 = two.encode(x), one.encode(x)
    np.testing.assert_array_equal(np.array(e2.codes1), np.array(e1.codes1))
    np.testing.assert_array_equal(np.array(two.decode(e2, stage1_only=True)), np.array(one.decode(e1)))
    assert rel_error(x, two.decode(e2)) < rel_error(x, one.decode(e1))


@pytest.mark.parametrize("bits", [(1, 1), (2, 2), (1, 3), (3, 3)])
def test_flat_and_gathered_stage2_formulations_agree(bits):
    x = gaussian(3000, 64, seed=2)
    flat = RVQCodec(64, bits)
    flat.max_flat_thresholds = 1 << 10
    gath = RVQCodec(64, bits)
    gath.max_flat_thresholds = 0
    y, _ = flat.rotate(x)
    # also values exactly on every threshold, and between
    edge = np.concatenate([flat.boundaries1, flat.boundaries2.reshape(-1), [0.0, -0.0, 1e30, -1e30]])
    y = mx.concatenate([y, mx.array(np.resize(edge, (8, 64)).astype(np.float32))])
    a, b = flat._quantize_reference(y), gath._quantize_reference(y)
    np.testing.assert_array_equal(np.array(a[0]), np.array(b[0]))
    np.testing.assert_array_equal(np.array(a[1]), np.array(b[1]))


def test_boundary_values_resolve_by_strict_greater():
    codec = RVQCodec(64, (2, 0))
    b = codec.boundaries1  # [-0.98, 0, 0.98]
    y = mx.array(np.resize(np.array([b[0], b[1], b[2], np.nextafter(b[2], 10)], np.float32), (1, 64)))
    codes1, _ = codec.quantize(y)
    assert np.array(unpack_codes(codes1, 2, 64))[0, :4].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("dim", [64, 80, 96, 112, 128, 256])
def test_dtypes_dims_and_shapes(dtype, dim):
    x = gaussian(2 * 3 * 5, dim, seed=dim).astype(dtype).reshape(2, 3, 5, dim)
    codec = RVQCodec(dim, (2, 2), seed=9)
    enc = codec.encode(x)
    assert enc.scales.shape == (2, 3, 5) and enc.scales.dtype == mx.bfloat16
    assert enc.codes1.shape == (2, 3, 5, codec.words1) and enc.codes2.shape == (2, 3, 5, codec.words2)
    out = codec.decode(enc)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_error(x, out) < 0.02
    assert enc.nbytes == enc.scales.nbytes + enc.codes1.nbytes + enc.codes2.nbytes


def test_zero_vector_decodes_to_zero():
    codec = RVQCodec(64, (2, 2))
    x = mx.zeros((3, 64))
    np.testing.assert_array_equal(np.array(codec.decode(codec.encode(x))), np.zeros((3, 64)))


def test_same_seed_same_bytes_different_seed_different_bytes():
    x = gaussian(64, 128, seed=4)
    a, b, c = (RVQCodec(128, (2, 2), seed=s).encode(x) for s in (1, 1, 2))
    assert np.array(a.codes1).tobytes() == np.array(b.codes1).tobytes()
    assert np.array(a.codes2).tobytes() == np.array(b.codes2).tobytes()
    assert np.array(a.codes1).tobytes() != np.array(c.codes1).tobytes()


_DIGEST_SCRIPT = """
import hashlib, numpy as np, mlx.core as mx
from rvqstore import RVQCodec
x = mx.array(np.random.default_rng(123).standard_normal((257, 128)).astype(np.float32))
e = RVQCodec(128, (2, 2), seed=77).encode(x)
h = hashlib.sha256()
for a in (e.scales.view(mx.uint16), e.codes1, e.codes2):
    h.update(np.array(a).tobytes())
print(h.hexdigest())
"""


def test_determinism_across_processes():
    digests = {subprocess.run([sys.executable, "-c", _DIGEST_SCRIPT], capture_output=True, text=True,
                              cwd=ROOT, check=True).stdout.strip() for _ in range(2)}
    here = hashlib.sha256()
    x = mx.array(np.random.default_rng(123).standard_normal((257, 128)).astype(np.float32))
    e = RVQCodec(128, (2, 2), seed=77).encode(x)
    for a in (e.scales.view(mx.uint16), e.codes1, e.codes2):
        here.update(np.array(a).tobytes())
    assert digests == {here.hexdigest()}


def test_header_round_trip_reproduces_codes():
    x = gaussian(100, 80, seed=8)
    for bits, res in [((2, 2), "conditional"), ((3, 1), "shared"), ((4, 0), "conditional")]:
        a = RVQCodec(80, bits, seed=2**63 + 5, residual=res)
        b = RVQCodec.from_header(a.to_header())
        ea, eb = a.encode(x), b.encode(x)
        for u, v in ((ea.codes1, eb.codes1), (ea.codes2, eb.codes2), (ea.scales, eb.scales)):
            if u is not None:
                np.testing.assert_array_equal(np.array(u.astype(mx.float32) if u.dtype == mx.bfloat16 else u),
                                              np.array(v.astype(mx.float32) if v.dtype == mx.bfloat16 else v))
        np.testing.assert_array_equal(np.array(a.decode(ea)), np.array(b.decode(ea)))


@pytest.mark.parametrize("mutate", [
    lambda h: h.update(name="other"),
    lambda h: h.update(version=99),
    lambda h: h.update(dim=100),
    lambda h: h.update(bits1=5),
    lambda h: h.update(bits2="2"),
    lambda h: h.update(residual="none"),
    lambda h: h.update(scale_dtype="float16"),
    lambda h: h["rotation"].update(prng="mt19937"),
    lambda h: h["rotation"].update(signs=b"\x00"),
    lambda h: h.update(centroids1=h["centroids1"][:-1]),
    lambda h: h.update(centroids1=list(reversed(h["centroids1"]))),
    lambda h: h.update(boundaries1=[float("nan")] * 3),
    lambda h: h.update(boundaries2=[[9.0, 10.0, 11.0]] * 4),  # outside their cells
    lambda h: h.pop("centroids2"),
    lambda h: h.update(rotation=None),
])
def test_malformed_headers_are_refused(mutate):
    h = RVQCodec(64, (2, 2)).to_header()
    mutate(h)
    with pytest.raises(CodecConfigError):
        RVQCodec.from_header(h)


@pytest.mark.parametrize("kwargs", [
    dict(dim=100), dict(dim=36), dict(dim=0), dict(dim=64.0), dict(dim=64, bits=(0, 2)), dict(dim=64, bits=(5, 1)),
    dict(dim=64, bits=(2, 5)), dict(dim=64, bits=(True, 1)), dict(dim=64, bits=(2.0, 2)), dict(dim=64, bits=(1, 2, 3)),
    dict(dim=64, residual="laplace"), dict(dim=64, seed="1"),
])
def test_bad_configuration(kwargs):
    with pytest.raises(CodecConfigError):
        RVQCodec(**kwargs)


def test_bad_inputs():
    codec = RVQCodec(64, (2, 2))
    with pytest.raises(InputShapeError, match=r"\(\.\.\., 64\)"):
        codec.encode(mx.zeros((4, 32)))
    with pytest.raises(InputShapeError, match="float16, bfloat16 or float32"):
        codec.encode(mx.zeros((4, 64), mx.int32))
    with pytest.raises(InputShapeError):
        codec.encode(mx.array(1.0))
    with pytest.raises(InputShapeError):
        codec.encode([[0.0] * 64])
    enc = codec.encode(mx.ones((2, 64)))
    with pytest.raises(InputShapeError):
        codec.decode(EncodedVectors(enc.scales, enc.codes1[:, :-1], enc.codes2, enc.dtype))
    with pytest.raises(InputShapeError):
        RVQCodec(128, (2, 2)).decode(enc)


def test_empty_arrays():
    codec = RVQCodec(64, (2, 2))
    for shape in [(0, 64), (2, 0, 64)]:
        enc = codec.encode(mx.zeros(shape, mx.float16))
        assert enc.codes1.shape == shape[:-1] + (codec.words1,)
        out = codec.decode(enc)
        assert out.shape == shape and out.dtype == mx.float16


def test_non_finite_inputs():
    codec = RVQCodec(64, (2, 2))
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    bad = x.copy()
    bad[1, 3] = np.nan
    bad[2, 0] = np.inf
    with pytest.raises(NonFiniteInputError):
        codec.encode(mx.array(bad))
    enc = codec.encode(mx.array(bad), check_finite=False)
    out = np.array(codec.decode(enc))
    assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
    clean = np.array(codec.decode(codec.encode(mx.array(x))))
    np.testing.assert_array_equal(out[[0, 3]], clean[[0, 3]])
    zero = codec.encode(mx.zeros((1, 64)))
    assert np.array(enc.codes1)[1].tolist() == np.array(zero.codes1)[0].tolist()


@pytest.mark.parametrize("bits,residual", [(b, r) for b in [(1, 1), (2, 2), (4, 4), (4, 2), (2, 4), (4, 1), (1, 4),
                                                              (2, 1), (1, 2)] for r in ("conditional", "shared")]
                         + [((b, 0), "conditional") for b in (1, 2, 4)])
@pytest.mark.parametrize("dim", [64, 80, 96, 12])
def test_byte_table_decode_is_bit_identical_to_reference(bits, residual, dim):
    codec = RVQCodec(dim, bits, residual=residual)
    x = gaussian(301, dim, seed=dim + bits[0])
    enc = codec.encode(x)
    assert codec._group_lut(bits[1] > 0) is not None
    fast = codec.dequantize(enc.codes1, enc.codes2)
    if bits[1]:
        ref = codec._dequantize_reference(enc.codes1, enc.codes2)
    else:
        ref = mx.take(codec._c1_mx, unpack_codes(enc.codes1, bits[0], dim).astype(mx.uint32))
    np.testing.assert_array_equal(np.array(fast), np.array(ref))
    # stage-1-only decode of a two-stage code goes through the single-byte table
    s1 = codec.dequantize(enc.codes1, None)
    np.testing.assert_array_equal(
        np.array(s1), np.array(mx.take(codec._c1_mx, unpack_codes(enc.codes1, bits[0], dim).astype(mx.uint32))))


def test_checked_step_refuses_what_the_codec_refuses_every_time():
    from rvqstore.codec import checked_step
    from rvqstore.errors import CodecConfigError

    assert checked_step((2, 2), 0, "conditional", None) is None
    assert checked_step((2, 2), 0, "conditional", 0.25) == RVQCodec(64, (2, 2), step=0.25).step
    for bad in [((2, True), 0, "conditional", None), ((5, 2), 0, "conditional", None),
                ((2, 2), 0, "nope", None), ((2, 2), 0, "conditional", -1.0)]:
        for _ in range(2):  # a refusal is never remembered as a pass
            with pytest.raises(CodecConfigError):
                checked_step(*bad)
    assert checked_step((2, 1), 0, "conditional", None) is None  # (2, True) was not taken for it
