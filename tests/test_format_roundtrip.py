"""Writer and reader: round trips, laziness, zero-copy, atomic replacement, determinism, API errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import rvqstore.format as F
from rvqstore import RVQCodec
from rvqstore.codec import EncodedVectors
from rvqstore.format import constants as C
from rvqstore.format import reader as R
from rvqstore.format.source import FileSource
from rvqstore.format.quantizer import decode_layers

ROOT = Path(__file__).resolve().parent.parent


def make_cache(n_layers=2, B=1, H=2, T=37, D=64, bits=(2, 2), n_dense=0, seed=0, dtype=mx.float16,
               tokens=True, value_dtype=None):
    """Content header + sections of a synthetic KV cache encoded with the real codec, and the codec."""
    codec = RVQCodec(D, bits, seed=seed, use_kernels=False)
    rng = np.random.default_rng(seed)
    vdt = value_dtype or dtype
    names = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}
    layers, secs, originals = [], [], {}
    if tokens:
        secs.append(F.Section("tokens", -1, "tokens", np.arange(1000, 1000 + T, dtype=np.int32)))
    Tq = T - n_dense
    for i in range(n_layers):
        k = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32)).astype(dtype)
        v = mx.array(rng.standard_normal((B, H, T, D)).astype(np.float32)).astype(vdt)
        originals[i] = (k, v)
        layers.append(dict(index=i, kind="rvq", batch=B, n_kv_heads=H, head_dim=D, n_tokens=T,
                           n_dense_tokens=n_dense, key_dtype=names[dtype], value_dtype=names[vdt]))
        for side, x in (("keys", k), ("values", v)):
            e = codec.encode(x[:, :, :Tq])
            secs.append(F.Section(f"layers.{i}.{side}.codes1", i, f"{side}.codes1", e.codes1))
            if e.codes2 is not None:
                secs.append(F.Section(f"layers.{i}.{side}.codes2", i, f"{side}.codes2", e.codes2))
            secs.append(F.Section(f"layers.{i}.{side}.scales", i, f"{side}.scales", e.scales))
        if n_dense:
            secs.append(F.Section(f"layers.{i}.keys.dense", i, "keys.dense", k[:, :, Tq:]))
            secs.append(F.Section(f"layers.{i}.values.dense", i, "values.dense", v[:, :, Tq:]))
    header = dict(quantizer=codec.to_header(), model={"arch": "test", "n_layers": n_layers}, n_tokens=T,
                  metadata={"who": "test"}, layers=layers)
    return header, secs, codec, originals


@pytest.fixture
def cache_file(tmp_path):
    header, secs, codec, originals = make_cache(n_dense=3)
    p = tmp_path / "c.rvq"
    F.write_rvq(p, header, secs)
    return p, header, secs, codec


@pytest.mark.parametrize("compress", ["none", "auto", "zstd"])
@pytest.mark.parametrize("bits", [(2, 2), (4, 0), (3, 1)])
def test_roundtrip_decodes_bit_exactly(tmp_path, compress, bits):
    header, secs, codec, _ = make_cache(bits=bits, n_dense=2, value_dtype=mx.bfloat16)
    p = tmp_path / "x.rvq"
    written = F.write_rvq(p, header, secs, compress=compress)
    by_name = {s.name: s for s in secs}
    with F.open_rvq(p) as f:
        assert f.header.sections == written.sections
        assert f.n_tokens == 37 and f.model == {"arch": "test", "n_layers": 2} and f.metadata == {"who": "test"}
        assert f.quantizer == header["quantizer"]
        assert np.array_equal(f.tokens(), np.arange(1000, 1037, dtype=np.int32))
        for layer in f.layers:
            arrs = f.layer_arrays(layer.index, as_mx=True)
            for kind, arr in arrs.items():
                src = by_name[layer.sections[kind]].array
                assert arr.dtype == src.dtype and arr.shape == src.shape, kind
                assert mx.array_equal(arr, src).item(), kind
            # decoding from the file equals decoding the in-memory codes
            for side in ("keys", "values"):
                enc = EncodedVectors(arrs[f"{side}.scales"], arrs[f"{side}.codes1"], arrs.get(f"{side}.codes2"),
                                     mx.float16)
                ref = EncodedVectors(by_name[layer.sections[f"{side}.scales"]].array,
                                     by_name[layer.sections[f"{side}.codes1"]].array,
                                     by_name[layer.sections[f"{side}.codes2"]].array if codec.bits2 else None,
                                     mx.float16)
                assert mx.array_equal(codec.decode(enc), codec.decode(ref)).item()
        counts = f.verify(decode=decode_layers)
        assert counts["sections"] == len(secs)
    if compress == "none":
        assert all(s.codec == "raw" for s in written.sections)
    if compress == "zstd":
        assert any(s.codec == "zstd" for s in written.sections)
        assert "zstd" in written.required_features


def test_auto_compression_choices(tmp_path):
    header, secs, _, _ = make_cache(T=200, n_dense=4)
    # tokens with a small vocabulary and repetitive scales compress; uniform random bytes do not
    secs.append(F.Section("noise", -1, "x.noise", np.random.default_rng(1).integers(0, 2**32, 4096, dtype=np.uint32)))
    secs.append(F.Section("zeros", -1, "x.zeros", np.zeros(1 << 16, np.uint8)))
    h = F.write_rvq(tmp_path / "a.rvq", header, secs, compress="auto")
    by = {s.name: s for s in h.sections}
    assert by["tokens"].codec == "zstd"
    assert by["noise"].codec == "raw"  # zstd cannot save 2 % on random words
    assert by["zeros"].codec == "raw"  # would exceed the 32x ratio a reader accepts
    for s in h.sections:
        if s.codec == "zstd":
            assert s.length <= 0.98 * s.raw_length and s.raw_length <= C.MAX_ZSTD_RATIO * s.length
    with F.open_rvq(tmp_path / "a.rvq") as f:
        assert f.read_section("zeros").sum() == 0
        f.verify()


def test_open_reads_only_preamble_and_header(cache_file, monkeypatch):
    p, *_ = cache_file
    calls = []
    real = FileSource.read

    def spy(self, off, n):
        calls.append((off, n))
        return real(self, off, n)

    monkeypatch.setattr(FileSource, "read", spy)
    with F.open_rvq(p) as f:
        # the preamble, then the header with the 63 bytes before it (its padding lies there), in one read
        pad = min(63, f.header.header_offset - 64)
        assert calls == [(0, 64), (f.header.header_offset - pad, pad + f.header.header_length)]
        assert f._source._mm is None  # nothing mapped until a section is read
        f.read_section("tokens")
        assert f._source._mm is not None
    assert len(calls) == 2


def test_open_does_not_touch_section_data(cache_file):
    """A damaged section does not stop opening or inspecting; reading it does."""
    p, *_ = cache_file
    with F.open_rvq(p) as f:
        s = f.section("layers.1.values.codes1")
    data = bytearray(p.read_bytes())
    data[s.offset + 3] ^= 0x40
    p.write_bytes(bytes(data))
    with F.open_rvq(p) as f:
        assert len(f.layers) == 2
        f.layer_arrays(0)
        with pytest.raises(F.ChecksumMismatchError, match="layers.1.values.codes1"):
            f.layer_arrays(1)
        with pytest.raises(F.ChecksumMismatchError):
            f.verify()


def test_raw_sections_are_zero_copy_read_only_views(cache_file):
    p, *_ = cache_file
    f = F.open_rvq(p)
    s = f.section("layers.0.keys.codes1")
    assert s.codec == "raw"
    arr = f.read_section(s.name)
    assert not arr.flags.writeable and not arr.flags.owndata
    base = arr
    while getattr(base, "base", None) is not None and not isinstance(base, memoryview):
        base = base.base
    assert isinstance(base, memoryview) and base.obj is f._source._mm
    with pytest.raises(ValueError):
        arr[0, 0, 0, 0] = 1
    f.close()  # the mapping stays alive while the view does
    assert int(arr.sum()) >= 0
    with pytest.raises(ValueError, match="closed"):
        f.read_section(s.name)


def test_bfloat16_sections_as_mx(cache_file):
    p, _, secs, _ = cache_file
    by = {s.name: s for s in secs}
    with F.open_rvq(p) as f:
        raw = f.read_section("layers.0.keys.scales")
        assert raw.dtype == np.uint16
        m = f.read_section_mx("layers.0.keys.scales")
        assert m.dtype == mx.bfloat16
        assert mx.array_equal(m, by["layers.0.keys.scales"].array).item()
        dense = f.read_section_mx("layers.0.keys.dense")
        assert dense.dtype == mx.float16 and dense.shape == (1, 2, 3, 64)


def test_section_lookup_errors(cache_file):
    p, *_ = cache_file
    with F.open_rvq(p) as f:
        with pytest.raises(F.SectionNotFoundError, match="nope"):
            f.read_section("nope")
        with pytest.raises(KeyError):
            f.section("nope")
        with pytest.raises(F.SectionNotFoundError):
            f.layer_arrays(2)
        assert "RVQFile" in repr(f)


def test_writer_is_deterministic(tmp_path):
    header, secs, _, _ = make_cache()
    F.write_rvq(tmp_path / "a.rvq", header, secs)
    F.write_rvq(tmp_path / "b.rvq", dict(reversed(list(header.items()))), secs)  # key order does not matter
    assert (tmp_path / "a.rvq").read_bytes() == (tmp_path / "b.rvq").read_bytes()


def test_writer_accepts_a_generator_and_reports_progress(tmp_path):
    header, secs, _, _ = make_cache()
    seen = []
    F.write_rvq(tmp_path / "g.rvq", header, (s for s in secs), progress=lambda d, t: seen.append((d, t)))
    assert seen == [(i + 1, None) for i in range(len(secs))]
    seen.clear()
    F.write_rvq(tmp_path / "l.rvq", header, secs, progress=lambda d, t: seen.append((d, t)))
    assert seen[-1] == (len(secs), len(secs))
    assert (tmp_path / "g.rvq").read_bytes() == (tmp_path / "l.rvq").read_bytes()


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    header, secs, _, _ = make_cache()
    p = tmp_path / "keep.rvq"
    F.write_rvq(p, header, secs)
    before = p.read_bytes()

    def broken():
        yield secs[0]
        yield secs[1]
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        F.write_rvq(p, header, broken())
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["keep.rvq"]
    # an invalid header is refused before anything is renamed into place
    bad = dict(header, layers=header["layers"][:1])
    with pytest.raises(F.MalformedHeaderError, match="keep.rvq"):
        F.write_rvq(p, bad, secs)
    assert p.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["keep.rvq"]


def test_killed_writer_never_leaves_a_partial_file(tmp_path):
    """A process that dies in the middle of a save (os._exit: no cleanup at all) leaves the old file."""
    header, secs, _, _ = make_cache()
    p = tmp_path / "k.rvq"
    F.write_rvq(p, header, secs)
    before = p.read_bytes()
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(Path(__file__).parent)!r})
        import rvqstore.format as F
        from test_format_roundtrip import make_cache
        header, secs, _, _ = make_cache(seed=5)
        def progress(done, total):
            if done == 3:
                os._exit(17)
        F.write_rvq({str(p)!r}, header, secs, progress=progress)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert r.returncode == 17, r.stderr.decode()
    assert p.read_bytes() == before
    with F.open_rvq(p) as f:
        f.verify()
    leftovers = [n for n in os.listdir(tmp_path) if n != "k.rvq"]
    assert all(n.startswith(".k.rvq.") and n.endswith(".tmp") for n in leftovers)


def test_new_file_is_private_whatever_the_umask(tmp_path):
    header, secs, _, _ = make_cache(n_layers=1)
    old = os.umask(0o022)
    try:
        F.write_rvq(tmp_path / "m.rvq", header, secs)
    finally:
        os.umask(old)
    assert (tmp_path / "m.rvq").stat().st_mode & 0o777 == 0o600


def test_writer_rejects_bad_input(tmp_path):
    header, secs, _, _ = make_cache(n_layers=1)
    p = tmp_path / "w.rvq"
    with pytest.raises(F.MalformedHeaderError, match="written by the writer"):
        F.write_rvq(p, dict(header, sections=[]), secs)
    with pytest.raises(ValueError):
        F.write_rvq(p, header, secs, compress="brotli")
    with pytest.raises(F.MalformedHeaderError, match="cannot be stored"):
        F.write_rvq(p, dict(header, metadata={"a": object()}), secs)
    with pytest.raises(F.MalformedHeaderError, match="dtype"):
        F.write_rvq(p, header, secs + [F.Section("c", -1, "x.c", np.zeros(3, np.complex64))])
    with pytest.raises(F.MalformedHeaderError, match="declared dtype"):
        F.write_rvq(p, header, secs + [F.Section("d", -1, "x.d", np.zeros(3, np.float32), dtype="int32")])
    with pytest.raises(F.MalformedHeaderError, match="two sections"):
        F.write_rvq(p, header, secs + [secs[0]])
    wrong = list(secs)
    wrong[1] = F.Section(wrong[1].name, 0, wrong[1].kind, np.zeros((1, 2, 37, 5), np.uint32))
    with pytest.raises(F.MalformedHeaderError, match="words per vector"):
        F.write_rvq(p, header, wrong)
    assert not p.exists() and os.listdir(tmp_path) == []


def test_big_endian_and_noncontiguous_inputs_are_stored_little_endian(tmp_path):
    a = np.arange(12, dtype=">i4").reshape(3, 4).T  # big-endian, non-contiguous
    header = dict(quantizer=None, model=None, n_tokens=0, metadata={}, layers=[])
    F.write_rvq(tmp_path / "e.rvq", header, [F.Section("a", -1, "x.a", a)])
    with F.open_rvq(tmp_path / "e.rvq") as f:
        s = f.section("a")
        assert s.dtype == "int32" and s.shape == (4, 3)
        assert np.array_equal(f.read_section("a"), a)
        assert f.read_section("a").dtype == np.dtype("<i4")


def test_dense_layers_and_no_tokens(tmp_path):
    k = mx.array(np.random.default_rng(0).standard_normal((1, 2, 5, 16)).astype(np.float32))
    header = dict(quantizer=None, model=None, n_tokens=5, metadata={},
                  layers=[dict(index=0, kind="dense", batch=1, n_kv_heads=2, head_dim=16, n_tokens=5,
                               n_dense_tokens=5, key_dtype="float32", value_dtype="float32")])
    F.write_rvq(tmp_path / "d.rvq", header, [F.Section("layers.0.keys.dense", 0, "keys.dense", k),
                                           F.Section("layers.0.values.dense", 0, "values.dense", k * 2)])
    with F.open_rvq(tmp_path / "d.rvq") as f:
        assert f.tokens() is None
        arrs = f.layer_arrays(0, as_mx=True)
        assert mx.array_equal(arrs["values.dense"], k * 2).item()
        assert f.verify(decode=decode_layers)["sections"] == 2


def test_open_missing_file_is_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        F.open_rvq(tmp_path / "missing.rvq")


def test_file_changed_after_open_is_detected(cache_file):
    p, *_ = cache_file
    with F.open_rvq(p) as f:
        with open(p, "r+b") as fh:
            fh.truncate(f.file_length - 100)
        with pytest.raises(F.TruncatedFileError, match="changed size"):
            f.read_section("tokens")


def test_errors_are_rvq_errors_and_name_the_file(tmp_path):
    from rvqstore.errors import RVQError

    p = tmp_path / "junk.rvq"
    p.write_bytes(b"hello world, not an rvq file at all" * 3)
    with pytest.raises(RVQError) as ei:
        F.open_rvq(p)
    assert isinstance(ei.value, F.BadMagicError) and str(ei.value).startswith(str(p))
    for name in F.errors.__all__:
        assert issubclass(getattr(F.errors, name), RVQError)


def test_codec_from_file(cache_file, tmp_path):
    p, header, secs, codec = cache_file
    with F.open_rvq(p) as f:
        c = f.codec(use_kernels=False)
        assert (c.dim, c.bits, c.seed, c.residual) == (codec.dim, codec.bits, codec.seed, codec.residual)
        assert np.array_equal(c.signs, codec.signs)
    other = dict(header, quantizer={"name": "someone-elses-vq", "version": 3})
    F.write_rvq(tmp_path / "o.rvq", other, secs)
    with F.open_rvq(tmp_path / "o.rvq") as f:
        f.verify(decode=decode_layers)  # the container is readable; codes are not decoded
        with pytest.raises(F.UnknownFeatureError, match="someone-elses-vq"):
            f.codec()
