import itertools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from rvqstore import pack_codes, unpack_codes
from rvqstore.errors import CodecConfigError, InputShapeError
from rvqstore.packing import words_per_vector


def numpy_pack(idx: np.ndarray, bits: int) -> np.ndarray:
    """Independent bit-by-bit packer written from the layout description."""
    per = 32 // bits
    n, dim = idx.shape
    words = -(-dim // per)
    out = np.zeros((n, words), dtype=np.uint64)
    for j in range(dim):
        out[:, j // per] |= idx[:, j].astype(np.uint64) << np.uint64((j % per) * bits)
    return out.astype(np.uint32)


def test_worked_example_words():
    w = pack_codes(mx.array([1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4], dtype=mx.uint8), 3)
    assert [int(v) for v in w] == [0x111F58D1, 0x00000023]


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [1, 2, 3, 7, 8, 10, 11, 16, 31, 32, 33])
def test_exhaustive_small(bits, dim):
    levels = 1 << bits
    if levels ** min(dim, 3) <= 4096:
        combos = np.array(list(itertools.product(range(levels), repeat=min(dim, 3))), dtype=np.uint8)
        idx = np.zeros((len(combos), dim), dtype=np.uint8)
        idx[:, : combos.shape[1]] = combos
        idx[:, combos.shape[1]:] = levels - 1  # the rest saturated so every bit position gets exercised
    words = pack_codes(mx.array(idx), bits)
    assert words.dtype == mx.uint32 and words.shape == (len(idx), words_per_vector(dim, bits))
    np.testing.assert_array_equal(np.array(words), numpy_pack(idx, bits))
    np.testing.assert_array_equal(np.array(unpack_codes(words, bits, dim)), idx)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_unused_high_bits_zero(bits):
    dim = 37
    idx = np.full((4, dim), (1 << bits) - 1, dtype=np.uint8)
    words = np.array(pack_codes(mx.array(idx), bits)).astype(np.uint64)
    per = 32 // bits
    assert np.all(words[:, :-1] == (1 << (per * bits)) - 1)  # e.g. 3 bits: bits 30-31 zero
    tail = dim - per * (words.shape[1] - 1)
    assert np.all(words[:, -1] == (1 << (tail * bits)) - 1)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 4), dim=st.integers(1, 300), n=st.integers(1, 5), data=st.data())
def test_round_trip_property(bits, dim, n, data):
    seed = data.draw(st.integers(0, 2**32 - 1))
    idx = np.random.default_rng(seed).integers(0, 1 << bits, size=(n, dim), dtype=np.uint8)
    words = pack_codes(mx.array(idx), bits)
    np.testing.assert_array_equal(np.array(words), numpy_pack(idx, bits))
    np.testing.assert_array_equal(np.array(unpack_codes(words, bits, dim)), idx)


def test_leading_axes_kept():
    idx = mx.array(np.random.default_rng(0).integers(0, 4, size=(2, 3, 5, 64), dtype=np.uint8))
    w = pack_codes(idx, 2)
    assert w.shape == (2, 3, 5, 4)
    np.testing.assert_array_equal(np.array(unpack_codes(w, 2, 64)), np.array(idx))


def test_bad_arguments():
    with pytest.raises(CodecConfigError):
        pack_codes(mx.zeros((2, 8), mx.uint8), 5)
    with pytest.raises(CodecConfigError):
        unpack_codes(mx.zeros((2, 1), mx.uint32), 0, 8)
    with pytest.raises(InputShapeError):
        unpack_codes(mx.zeros((2, 3), mx.uint32), 2, 64)  # 64 two-bit codes need 4 words
    with pytest.raises(InputShapeError):
        pack_codes(mx.array(3, dtype=mx.uint8), 2)


def test_spec_packing_example_matches_code():
    import re
    from pathlib import Path

    spec = (Path(__file__).resolve().parents[1] / "format_spec" / "rvq-v1.md").read_text(encoding="utf-8")
    m = re.search(r"Example \(b = (\d), p = \d+, dim = (\d+)\): codes\s+`\[([\d, ]+)\]` are the words\s+`([^`]+)`", spec)
    assert m, "packing example not found in the spec"
    bits, dim = int(m.group(1)), int(m.group(2))
    codes = [int(v) for v in m.group(3).replace(" ", "").split(",")]
    words = [int(w.strip(), 16) for w in m.group(4).split(",")]
    assert len(codes) == dim
    assert [int(v) for v in pack_codes(mx.array(codes, dtype=mx.uint8), bits)] == words
