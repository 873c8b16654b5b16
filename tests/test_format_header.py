"""Strict msgpack decoding, canonical encoding, and the header schema, unit by unit."""

from __future__ import annotations

import math

import msgpack
import numpy as np
import pytest

from rvqstore.format import constants as C
from rvqstore.format import errors as E
from rvqstore.format.header import (
    canonicalize,
    check_layout,
    checked_product,
    decode_header,
    encode_header,
    parse_header,
)
from rvqstore.format.preamble import pack_preamble, parse_preamble
from rvqstore.format.quantizer import check_quantizer


# ---- strict msgpack ----------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, what", [
    (b"\x82\xa1a\x01\xa1a\x02", "duplicate map key 'a'"),
    (b"\x81\x01\x02", "not a string"),
    (b"\x81\xc4\x01a\x02", "not a string"),  # bin key
    (b"\x81\xa1a\xd4\x05\x00", "ext type 5"),
    (b"\x81\xa1a\xd6\xff\x00\x00\x00\x00", "Timestamp"),
    (b"\x81\xa1a\xa2\xff\xfe", "not valid msgpack"),
    (b"\x81\xa1a\xc0\xc0", "not valid msgpack"),  # trailing data
    (b"\x81\xa1a", "not valid msgpack"),  # truncated
    (b"\xc1", "not valid msgpack"),  # never-used byte
    (b"\x93\x01\x02\x03", "not a map"),
    (b"\x81\xa1a" + b"\x91" * 40 + b"\xc0", "nesting deeper"),
    (b"\x81\xa1a" + b"\x91" * 5000 + b"\xc0", "not valid msgpack"),  # msgpack's own stack limit
])
def test_decode_refuses(raw, what):
    with pytest.raises(E.MalformedHeaderError, match=what) as ei:
        decode_header(raw, "/x.rvq")
    assert str(ei.value).startswith("/x.rvq: ")


def test_decode_accepts_every_allowed_type():
    obj = {"n": None, "t": True, "i": -5, "u": (1 << 64) - 1, "f": 1.5, "s": "é", "b": b"\x00", "l": [1, [2]],
           "m": {"k": {}}}
    assert decode_header(msgpack.packb(obj, use_bin_type=True)) == obj
    # depth exactly MAX_DEPTH is fine
    deep: object = 0
    for _ in range(C.MAX_DEPTH - 1):
        deep = [deep]
    decode_header(msgpack.packb({"d": deep}))
    with pytest.raises(E.MalformedHeaderError):
        decode_header(msgpack.packb({"d": [deep]}))


def test_canonical_encoding():
    a = encode_header({"b": 1, "a": {"z": 1.0, "y": np.float32(0.5)}, "c": (1, np.int64(2)), "d": np.arange(2)})
    b = encode_header({"d": [0, 1], "c": [1, 2], "a": {"y": 0.5, "z": 1.0}, "b": 1})
    assert a == b
    assert a.startswith(b"\x84\xa1a")  # sorted keys
    assert b"\xcb" in a  # floats as float64
    assert encode_header({"x": b"\x01"}) == b"\x81\xa1x\xc4\x01\x01"  # bytes -> bin
    with pytest.raises(TypeError):
        canonicalize({1: 2})
    with pytest.raises(TypeError):
        canonicalize({"a": object()})


def test_checked_product():
    assert checked_product((), 10) == 1
    assert checked_product((0, 1 << 62, 1 << 62), 10) == 0
    assert checked_product((3, 3), 9) == 9
    assert checked_product((3, 4), 11) is None
    assert checked_product((1 << 40,) * 8, 1 << 40) is None


# ---- preamble ------------------------------------------------------------------------------------------
def _pre(**kw):
    base = dict(header_offset=64, header_length=10, header_checksum=0, file_length=74)
    base.update(kw)
    return pack_preamble(**base)


def test_preamble_roundtrip_and_checks():
    p = parse_preamble(_pre(), 74)
    assert (p.major, p.minor, p.flags, p.header_offset, p.header_length, p.file_length) == (1, 0, 0, 64, 10, 74)
    assert parse_preamble(_pre(minor=9), 74).minor == 9
    cases = [
        (_pre(), 75, E.TrailingDataError),
        (_pre(), 73, E.TruncatedFileError),
        (_pre(major=3), 74, E.UnsupportedVersionError),
        (_pre(flags=1 << 31), 74, E.UnknownFeatureError),
        (_pre(header_length=0, file_length=64), 64, E.MalformedHeaderError),
        (_pre(header_length=C.MAX_HEADER_LENGTH + 1), 74, E.LimitExceededError),
        (_pre(header_offset=32, file_length=42), 42, E.LayoutError),
        (_pre(header_offset=128, file_length=74), 74, E.TruncatedFileError),
        (_pre(header_length=5), 74, E.LayoutError),
        (_pre(file_length=1 << 63), 74, E.LimitExceededError),
        (_pre(preamble_checksum=1), 74, E.ChecksumMismatchError),
        (b"\x89RVQ", 4, E.TruncatedFileError),
        (b"GIF8", 4, E.BadMagicError),
        (b"", 0, E.TruncatedFileError),
        (_pre()[:9], 9, E.TruncatedFileError),
        (_pre()[:63], 63, E.TruncatedFileError),
    ]
    for head, size, cls in cases:
        with pytest.raises(cls):
            parse_preamble(head[:64], size, "/p")


def test_magic_damage_hints():
    good = _pre()
    with pytest.raises(E.BadMagicError, match="CR LF was converted to LF"):
        parse_preamble(good.replace(b"\r\n", b"\n")[:64], 74)
    with pytest.raises(E.BadMagicError, match="LF was converted to CR LF"):
        parse_preamble(good.replace(b"\n", b"\r\n")[:64], 74)
    with pytest.raises(E.BadMagicError, match="7-bit"):
        parse_preamble(bytes(b & 0x7F for b in good), 74)


def test_major_version_checked_before_checksum():
    """Bytes 0..10 keep their meaning forever: a v2 file is 'unsupported', not 'corrupt'."""
    v2 = bytearray(_pre())
    v2[8:10] = (2).to_bytes(2, "little")  # checksum now wrong too
    with pytest.raises(E.UnsupportedVersionError):
        parse_preamble(bytes(v2), 74)


# ---- schema -----------------------------------------------------------------------------------------------
def _sec(name, offset, length, kind="x.blob", layer=-1, **kw):
    d = dict(name=name, layer=layer, kind=kind, dtype="uint8", shape=[length], offset=offset, length=length,
             codec="raw", raw_length=length, checksum=0)
    d.update(kw)
    return d


def _header(sections, **kw):
    h = dict(format_version=[1, 0], required_features=[], sections=sections, n_tokens=0, layers=[],
             quantizer=None, model=None, metadata={})
    h.update(kw)
    return h


def _parse(h, header_offset=None):
    if header_offset is None:
        end = 64
        for s in h.get("sections", []):
            if isinstance(s, dict) and isinstance(s.get("offset"), int) and isinstance(s.get("length"), int):
                end = max(end, s["offset"] + s["length"])
        header_offset = C.align_up(end)
    return parse_header(h, path="/h", major=1, minor=0, flags=0, header_offset=header_offset, header_length=1,
                        file_length=header_offset + 1, quantizer_check=check_quantizer)


def test_minimal_header():
    hd = _parse(_header([]))
    assert hd.sections == () and hd.layers == () and hd.header_offset == 64


def test_unknown_keys_are_ignored():
    hd = _parse(_header([_sec("a", 64, 3, extra_key=1)], new_key={"x": [1]}))
    assert hd.raw["new_key"] == {"x": [1]} and hd.sections[0].name == "a"


@pytest.mark.parametrize("edit, cls, what", [
    (lambda h: h.pop("format_version"), E.MalformedHeaderError, "format_version"),
    (lambda h: h.update(format_version=[1]), E.MalformedHeaderError, "format_version"),
    (lambda h: h.update(required_features=["zstd", "zstd"]), E.MalformedHeaderError, "twice"),
    (lambda h: h.update(required_features=["warp"]), E.UnknownFeatureError, "warp"),
    (lambda h: h.update(required_features=["x"] * 65), E.LimitExceededError, "limit"),
    (lambda h: h.update(required_features="zstd"), E.MalformedHeaderError, "array"),
    (lambda h: h.update(sections={}), E.MalformedHeaderError, "array"),
    (lambda h: h.update(n_tokens=-1), E.MalformedHeaderError, "below"),
    (lambda h: h.update(n_tokens=1 << 31), E.LimitExceededError, "limit"),
    (lambda h: h.update(n_tokens=1.0), E.MalformedHeaderError, "integer"),
    (lambda h: h.update(n_tokens=True), E.MalformedHeaderError, "integer"),
    (lambda h: h.update(metadata={"a": 1}), E.MalformedHeaderError, "string"),
    (lambda h: h.update(metadata={"k" * 257: "v"}), E.LimitExceededError, "256"),
    (lambda h: h.update(metadata=None), E.MalformedHeaderError, "map"),
    (lambda h: h.update(model={"a": 1.5}), E.MalformedHeaderError, "string or integer"),
    (lambda h: h.update(quantizer={"name": "q"}), E.MalformedHeaderError, "version"),
    (lambda h: h.update(quantizer=[]), E.MalformedHeaderError, "map"),
    (lambda h: h.pop("layers"), E.MalformedHeaderError, "layers"),
    (lambda h: h.update(layers=[None] * (C.MAX_LAYERS + 1)), E.LimitExceededError, "limit"),
])
def test_top_level_schema(edit, cls, what):
    h = _header([])
    edit(h)
    with pytest.raises(cls, match=what):
        _parse(h)


@pytest.mark.parametrize("kw, cls, what", [
    (dict(name="bad name"), E.MalformedHeaderError, "valid name"),
    (dict(name=""), E.MalformedHeaderError, "valid name"),
    (dict(name="n" * 257), E.LimitExceededError, "256"),
    (dict(layer=-2), E.MalformedHeaderError, "below"),
    (dict(layer=C.MAX_LAYERS), E.LimitExceededError, "limit"),
    (dict(dtype="complex64"), E.MalformedHeaderError, "unknown dtype"),
    (dict(codec="gzip"), E.MalformedHeaderError, "unknown codec"),
    (dict(shape=[1] * 9), E.LimitExceededError, "limit"),
    (dict(shape=[-1]), E.MalformedHeaderError, "below"),
    (dict(shape=[(1 << 40) + 1]), E.LimitExceededError, "limit"),
    (dict(shape=[1 << 21, 1 << 20]), E.LimitExceededError, "elements"),
    (dict(shape=[4]), E.MalformedHeaderError, "does not match shape"),
    (dict(raw_length=2), E.MalformedHeaderError, "does not match"),
    (dict(checksum=-1), E.MalformedHeaderError, "below"),
    (dict(checksum=1 << 64), E.MalformedHeaderError, "exceeds"),
    (dict(offset=1 << 63), E.LimitExceededError, "limit"),
    (dict(codec="zstd", raw_length=3 * 33, shape=[99]), E.LimitExceededError, "32x"),
])
def test_section_entry_schema(kw, cls, what):
    entry = _sec("a", 64, 3)
    entry.update(kw)
    with pytest.raises(cls, match=what):
        _parse(_header([entry], required_features=["zstd"]), header_offset=128)


def test_zero_length_zstd_and_feature_rule():
    with pytest.raises(E.MalformedHeaderError, match="cannot be empty"):
        _parse(_header([_sec("a", 64, 0, codec="zstd")], required_features=["zstd"]))
    with pytest.raises(E.MalformedHeaderError, match="lacks 'zstd'"):
        _parse(_header([_sec("a", 64, 3, codec="zstd", raw_length=3)]))


def test_layout_rules():
    S = lambda name, off, n: _parse(_header([_sec("a", 64, 3), _sec(name, off, n)])).sections  # noqa: E731
    assert S("b", 128, 10)[1].offset == 128
    for off, what in ((64, "overlaps"), (66, "overlaps"), (136, "aligned"), (192, "hole")):
        with pytest.raises(E.LayoutError, match=what):
            S("b", off, 10)
    with pytest.raises(E.LayoutError, match="not sorted"):
        _parse(_header([_sec("a", 64, 3), _sec("b", 128, 3), _sec("c", 64, 3)]), header_offset=192)
    with pytest.raises(E.LayoutError, match="run into the header"):
        _parse(_header([_sec("a", 64, 100)]), header_offset=128)
    with pytest.raises(E.LayoutError, match="hole of 64 bytes"):
        _parse(_header([_sec("a", 64, 3)]), header_offset=192)
    # zero-length sections may share an offset
    secs = _parse(_header([_sec("a", 64, 0), _sec("b", 64, 0), _sec("c", 64, 5)])).sections
    assert [s.offset for s in secs] == [64, 64, 64]


def test_check_layout_alone():
    check_layout([], 64)
    with pytest.raises(E.LayoutError):
        check_layout([], 128)


def _layer(i=0, kind="rvq", T=2, Td=0, **kw):
    d = dict(index=i, kind=kind, batch=1, n_kv_heads=1, head_dim=8, n_tokens=T, n_dense_tokens=Td,
             key_dtype="float16", value_dtype="float16")
    d.update(kw)
    return d


Q8 = {"name": "turboquant-rvq", "version": 1, "dim": 8, "bits1": 2, "bits2": 0, "residual": "none",
      "scale_dtype": "bfloat16",
      "rotation": {"kind": "randomized-hadamard", "seed": 0, "prng": "splitmix64-msb-sign", "signs": b"\x00"},
      "centroids1": [-1.5, -0.5, 0.5, 1.5], "boundaries1": [-1.0, 0.0, 1.0]}


def _rvq_sections(T=2, Td=0, words=1, extra=()):
    specs = [("keys.codes1", "uint32", [1, 1, T - Td, words]), ("keys.scales", "bfloat16", [1, 1, T - Td]),
             ("values.codes1", "uint32", [1, 1, T - Td, words]), ("values.scales", "bfloat16", [1, 1, T - Td])]
    if Td:
        specs += [("keys.dense", "float16", [1, 1, Td, 8]), ("values.dense", "float16", [1, 1, Td, 8])]
    specs += list(extra)
    out, pos = [], 64
    for kind, dt, shape in specs:
        n = math.prod(shape) * C.DTYPES[dt][1]
        out.append(dict(name=f"layers.0.{kind}", layer=0, kind=kind, dtype=dt, shape=shape, offset=pos, length=n,
                        codec="raw", raw_length=n, checksum=0))
        pos = C.align_up(pos + n)
    return out


def test_layer_rules_accept_valid():
    hd = _parse(_header(_rvq_sections(T=3, Td=1), layers=[_layer(T=3, Td=1)], quantizer=Q8))
    assert hd.layers[0].n_quantized_tokens == 2
    assert set(hd.layers[0].sections) == {"keys.codes1", "keys.scales", "values.codes1", "values.scales",
                                          "keys.dense", "values.dense"}


@pytest.mark.parametrize("make, what", [
    (lambda: _header(_rvq_sections(), layers=[_layer(index=1)], quantizer=Q8), "must equal its position"),
    (lambda: _header(_rvq_sections(), layers=[_layer(kind="sparse")], quantizer=Q8), "not one of"),
    (lambda: _header(_rvq_sections(), layers=[_layer(batch=0)], quantizer=Q8), "below"),
    (lambda: _header(_rvq_sections(), layers=[_layer(key_dtype="int8")], quantizer=Q8), "not one of"),
    (lambda: _header(_rvq_sections(), layers=[_layer(Td=3)], quantizer=Q8), "exceeds"),
    (lambda: _header(_rvq_sections(), layers=[_layer()]), "quantizer is nil"),
    (lambda: _header(_rvq_sections()[:3], layers=[_layer()], quantizer=Q8), "lacks its 'values.scales'"),
    (lambda: _header(_rvq_sections(T=3), layers=[_layer()], quantizer=Q8), "should be"),
    (lambda: _header(_rvq_sections(words=2), layers=[_layer()], quantizer=Q8), "words per vector"),
    (lambda: _header(_rvq_sections(extra=[("keys.codes2", "uint32", [1, 1, 2, 1])]), layers=[_layer()],
                     quantizer=Q8), "both have codes2"),
    (lambda: _header(_rvq_sections(extra=[("keys.dense", "float16", [1, 1, 0, 8])]), layers=[_layer()],
                     quantizer=Q8), "no dense tokens"),
    (lambda: _header(_rvq_sections(), layers=[_layer(kind="dense")], quantizer=Q8), "keeps all its tokens dense"),
    (lambda: _header(_rvq_sections(), layers=[], quantizer=Q8), "the file has 0 layers"),
    (lambda: _header([_sec("t", 64, 8, kind="tokens", dtype="int32", shape=[2], layer=-1)], n_tokens=3),
     "tokens must be int32 of shape"),
    (lambda: _header([_sec("t", 64, 8, kind="tokens", dtype="int32", shape=[2], layer=0)], n_tokens=2,
                     layers=[_layer(kind="dense", T=0)]), "layer -1"),
    (lambda: _header([_sec("t", 64, 0, kind="keys.dense", dtype="float16", shape=[0])]), "layer index >= 0"),
])
def test_layer_rules_refuse(make, what):
    with pytest.raises(E.MalformedHeaderError, match=what):
        _parse(make())


@pytest.mark.parametrize("edit, cls, what", [
    (lambda q: q.update(version=2), E.UnsupportedVersionError, "version 2"),
    (lambda q: q.update(dim=44), E.MalformedHeaderError, "m \\* 2\\^k"),
    (lambda q: q.update(bits1=5), E.MalformedHeaderError, "outside"),
    (lambda q: q.update(residual="conditional"), E.MalformedHeaderError, "'none'"),
    (lambda q: q.update(scale_dtype="float16"), E.MalformedHeaderError, "scale_dtype"),
    (lambda q: q.update(rotation={**Q8["rotation"], "kind": "givens"}), E.UnknownFeatureError, "givens"),
    (lambda q: q.update(rotation={**Q8["rotation"], "seed": -1}), E.MalformedHeaderError, "seed"),
    (lambda q: q.update(rotation={**Q8["rotation"], "signs": "00"}), E.MalformedHeaderError, "signs"),
    (lambda q: q.update(centroids1=[-1.5, -0.5, 0.5]), E.MalformedHeaderError, "centroids1"),
    (lambda q: q.update(centroids1=[-1.5, -0.5, 0.5, float("nan")]), E.MalformedHeaderError, "non-finite"),
    (lambda q: q.update(boundaries1=[-1.0, 1.0, 0.0]), E.MalformedHeaderError, "increasing"),
    (lambda q: q.update(boundaries1=[-1, 0, 1]), E.MalformedHeaderError, "floats"),
    (lambda q: q.update(bits2=1, residual="conditional", centroids2=[[-2.0, -1.0]] * 4,
                        boundaries2=[[-1.5]] * 4), E.MalformedHeaderError, "inside their stage-1 cell"),
])
def test_quantizer_rules(edit, cls, what):
    q = dict(Q8)
    edit(q)
    with pytest.raises(cls, match=what):
        _parse(_header(_rvq_sections(), layers=[_layer()], quantizer=q))


def test_unknown_quantizer_name_is_accepted_by_the_container():
    q = {"name": "someone-elses-vq", "version": 9}
    hd = _parse(_header(_rvq_sections(), layers=[_layer()], quantizer=q))
    assert hd.quantizer == q


def test_quantizer_tables_match_codec_schema():
    """The codec's own to_header() passes the format's quantizer rules, for every configuration."""
    from rvqstore import RVQCodec
    from rvqstore.format.quantizer import check_quantizer

    for dim in (8, 12, 64, 80, 96):
        for bits in ((1, 0), (2, 2), (3, 1), (4, 4), (1, 3)):
            for residual in ("conditional", "shared"):
                q = RVQCodec(dim, bits, seed=dim, residual=residual, use_kernels=False).to_header()
                check_quantizer(decode_header(encode_header({"q": q}))["q"], (), (), None)
