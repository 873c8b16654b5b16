"""RVQCodec.from_header (public: it rebuilds a codec from a quantizer map) raises CodecConfigError on
any malformed map, never another exception: ragged or non-numeric tables, strings, bytes, huge or
non-finite numbers, missing keys. RVQCodec.decode refuses malformed EncodedVectors the same way."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlx.core as mx

from rvqstore import EncodedVectors, RVQCodec
from rvqstore.errors import CodecConfigError, InputShapeError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fuzz_format as ff  # noqa: E402

BASES = [RVQCodec(24, (4, 2)).to_header(), RVQCodec(24, (2, 2), residual="shared").to_header(),
         RVQCodec(20, (3, 0)).to_header()]
VALUES = ff.HOSTILE_VALUES + [[1.0], [[1.0, 2.0], [3.0]], "abc", [float("inf")], 1e300, [1e300] * 16,
                              [[1e300] * 3] * 16]


@st.composite
def mutated_headers(draw):
    h = copy.deepcopy(draw(st.sampled_from(BASES)))
    for _ in range(draw(st.integers(1, 3))):
        p = draw(st.sampled_from(ff.paths(h)))
        try:
            if draw(st.integers(0, 4)):
                ff.set_path(h, p, copy.deepcopy(draw(st.sampled_from(VALUES))))
            else:
                ff.del_path(h, p)
        except (KeyError, IndexError, TypeError):
            pass
    return h


@settings(max_examples=400, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(mutated_headers())
def test_malformed_quantizer_maps_raise_codec_config_error(h):
    try:
        codec = RVQCodec.from_header(h)
    except CodecConfigError:
        return
    assert np.all(np.isfinite(codec.centroids1)) and codec.decode_bound > 0  # what loaded is usable


@pytest.mark.parametrize("key,value", [("centroids2", [[1.0, 2.0, 3.0, 4.0]] * 15 + [[1.0, 2.0]]),
                                       ("centroids1", ["a"] * 16), ("centroids1", [1e300] * 16),
                                       ("boundaries1", [b"\x00"] * 15)])
def test_each_table_fault_is_a_codec_config_error(key, value):
    h = copy.deepcopy(BASES[0])
    h[key] = value
    with pytest.raises(CodecConfigError):
        RVQCodec.from_header(h)


def test_decode_refuses_malformed_encoded_vectors():
    codec = RVQCodec(64, (2, 2))
    e = codec.encode(mx.ones((3, 64)))
    for bad in (EncodedVectors(None, e.codes1, e.codes2, mx.float32),
                EncodedVectors(e.scales, np.array(e.codes1), e.codes2, mx.float32),
                EncodedVectors(e.scales, e.codes1, None, mx.float32),
                EncodedVectors(e.scales, e.codes1[:, :1], e.codes2, mx.float32),
                EncodedVectors(e.scales, e.codes1, e.codes2, mx.int32)):
        with pytest.raises(InputShapeError):
            codec.decode(bad)
    assert codec.decode(e).shape == (3, 64)
