"""Section codec ``rans`` (spec 9.3): round trips against an independent scalar coder, the writer's
choices, loads through the library, and hostile streams (every malformed case a MalformedSectionError)."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import rvqstore.format as F
from rvqstore.format import constants as C
from rvqstore.format import rans
from rvqstore.format.quantizer import decode_layers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_format_vectors as MV  # noqa: E402
from test_format_roundtrip import make_cache  # noqa: E402


def _codes(rng, n_vec, dim, bits, skew=True):
    """Packed words of codes with a coordinate-dependent, skewed distribution (as rotated KV codes)."""
    k = 1 << bits
    if skew:
        p = rng.dirichlet(np.full(k, 0.7), size=dim)  # one distribution per coordinate
        codes = np.stack([rng.choice(k, size=n_vec, p=p[j]) for j in range(dim)], axis=1)
    else:
        codes = rng.integers(0, k, size=(n_vec, dim))
    return rans.pack(codes.astype(np.uint8), bits, dim)


@pytest.mark.parametrize("bits,dim,contexts,lanes,prob_bits", [
    (1, 8, 0, 1, 12), (2, 24, 1, 48, 12), (2, 24, 0, 7, 15), (3, 20, 1, 20, 13),
    (4, 12, 0, 1000, 14), (4, 64, 1, 64, 12), (2, 5, 0, 3, 12),
])
def test_matches_the_independent_scalar_coder(bits, dim, contexts, lanes, prob_bits):
    raw = _codes(np.random.default_rng(bits * 100 + dim), 37, dim, bits).tobytes()
    stored = rans.encode(raw, bits, dim, contexts=contexts, lanes=lanes, prob_bits=prob_bits)
    assert stored == MV.rans_encode(raw, bits, dim, contexts, lanes, prob_bits)  # byte for byte
    assert rans.decode(stored, len(raw)).tobytes() == raw
    assert MV.rans_decode(stored, len(raw)) == raw


def test_frequency_rule():
    for counts in ([5, 0, 0, 1], [1] * 16, [1000, 1, 1, 1], [0, 0, 7, 0], [0, 0], [3, 3]):
        f = rans.quantize_frequencies(np.array(counts), 12)
        assert f.sum() == 4096 and list(f) == MV.rans_freq(counts, 12)
        assert all((c == 0) == (v == 0) for c, v in zip(counts, f)) or sum(counts) == 0


def test_search_path_equals_table_path(monkeypatch):
    raw = _codes(np.random.default_rng(3), 50, 24, 3).tobytes()
    stored = rans.encode(raw, 3, 24, contexts=1)
    monkeypatch.setattr(rans, "LUT_MAX_ENTRIES", 0)
    assert rans.decode(stored, len(raw)).tobytes() == raw


def test_skewed_codes_shrink_uniform_ones_do_not():
    rng = np.random.default_rng(0)
    skewed = _codes(rng, 3000, 64, 2).tobytes()
    uniform = _codes(rng, 3000, 64, 2, skew=False).tobytes()
    assert len(rans.encode(skewed, 2, 64, contexts=1)) < 0.9 * len(skewed)
    assert len(rans.encode(uniform, 2, 64, contexts=1)) > len(uniform)


@pytest.mark.parametrize("skew", [True, False])
def test_the_writers_choice_is_the_shorter_form_and_the_estimate_is_close(skew):
    # per-coordinate skew favours one table per coordinate; shared statistics favour one table
    rng = np.random.default_rng(7 if skew else 8)
    raw = _codes(rng, 2000, 64, 3, skew=skew).tobytes()
    forms = {c: rans.encode(raw, 3, 64, contexts=c) for c in (1, 0)}
    smallest = rans.encode_smallest(raw, 3, 64)
    assert smallest == min(forms.values(), key=len)
    codes = rans.unpack(np.frombuffer(raw, "<u4"), 3, 64)
    for c, stored in forms.items():
        assert rans.estimated_size(codes, 3, c) == pytest.approx(len(stored), rel=0.01)
    assert rans.encode_smallest(b"\x01\x02", 3, 64) is None  # not whole vectors


def test_noncanonical_words_are_not_entropy_coded():
    words = _codes(np.random.default_rng(1), 10, 12, 3)  # 3 bits: 10 codes per word, 2 bits unused
    words[5] |= np.uint32(1 << 31)
    assert rans.encode(words.tobytes(), 3, 12) is None


# ---- through the container -------------------------------------------------------------------------------------
def _skewed_cache():
    """A 2+2 cache whose stage-1 codes are skewed per coordinate, as real keys' are (the key mean):
    Gaussian test vectors give nearly equiprobable codes, where rans and zstd tie within a few bytes."""
    header, secs, codec, originals = make_cache(n_layers=2, T=256, bits=(2, 2))
    rng = np.random.default_rng(5)
    for i, s in enumerate(secs):
        if s.kind.endswith("codes1"):
            shape = tuple(s.array.shape)
            secs[i] = F.Section(s.name, s.layer, s.kind, _codes(rng, int(np.prod(shape[:-1])), 64, 2).reshape(shape))
    return header, secs


@pytest.mark.parametrize("compress", ["rans", "best"])
def test_file_roundtrip_and_verify(tmp_path, compress):
    header, secs = _skewed_cache()
    F.write_rvq(tmp_path / "a.rvq", header, secs, compress="none")
    h = F.write_rvq(tmp_path / "b.rvq", header, secs, compress=compress)
    codecs = {s.codec for s in h.sections}
    assert "rans" in codecs
    assert (h.major, h.minor) == (1, 1) and "entropy-coded" in h.required_features
    with F.open_rvq(tmp_path / "a.rvq") as a, F.open_rvq(tmp_path / "b.rvq") as b:
        for s in b.sections:
            got = b.read_section(s.name)
            assert not got.flags.writeable
            assert np.array_equal(got, a.read_section(s.name)), s.name
        b.verify(decode=decode_layers)
    if compress == "best":
        sizes = {m: F.write_rvq(tmp_path / f"{m}.rvq", header, secs, compress=m).file_length
                 for m in ("none", "auto", "rans")}
        assert h.file_length <= min(sizes.values())


def test_rans_mode_falls_back_where_it_does_not_pay(tmp_path):
    header, secs = _skewed_cache()
    h = F.write_rvq(tmp_path / "b.rvq", header, secs, compress="rans")
    rans_kinds = {s.kind for s in h.sections if s.codec == "rans"}
    assert rans_kinds and rans_kinds <= set(C.CODE_KINDS)  # scales and tokens never
    assert {s.codec for s in h.sections if s.kind.endswith("scales")} <= {"zstd", "raw"}
    for s in h.sections:
        if s.codec == "rans":
            assert s.length < s.raw_length


def test_saved_prompt_cache_loads_identically(tmp_path):
    """Real mlx-lm caches of a tiny model's activations: rans and raw files load the same arrays."""
    from mlx_lm.models.cache import KVCache

    import tiny_models
    from rvqstore.prompt_cache import load_prompt_cache, save_prompt_cache

    model, _ = tiny_models.build("llama")
    caches = [KVCache() for _ in model.layers]
    ids = mx.array(np.random.default_rng(0).integers(0, 100, size=(1, 96)))
    mx.eval(model(ids, cache=caches))
    save_prompt_cache(tmp_path / "n.rvq", caches, compress="none")
    save_prompt_cache(tmp_path / "r.rvq", caches, compress="best")
    with F.open_rvq(tmp_path / "r.rvq") as f:
        assert any(s.codec == "rans" for s in f.sections)
    a, b = load_prompt_cache(tmp_path / "n.rvq"), load_prompt_cache(tmp_path / "r.rvq")
    assert len(a) == len(b) == len(caches)
    for x, y in zip(a, b):
        kx, vx = x.keys_and_values()
        ky, vy = y.keys_and_values()
        assert mx.array_equal(kx, ky) and mx.array_equal(vx, vy)


# ---- hostile streams -------------------------------------------------------------------------------------------
RAW = _codes(np.random.default_rng(7), 40, 24, 2).tobytes()
GOOD = rans.encode(RAW, 2, 24, contexts=1, lanes=48)


def _edit(off, fmt, value):
    b = bytearray(GOOD)
    struct.pack_into(fmt, b, off, value)
    return bytes(b)


@pytest.mark.parametrize("stored,raw_length,what", [
    (GOOD[:31], len(RAW), "shorter than"),
    (GOOD[:-2], len(RAW), "implies"),
    (GOOD + b"\0\0", len(RAW), "implies"),
    (_edit(5, "<B", 0), len(RAW), "symbol width"),
    (_edit(5, "<B", 5), len(RAW), "symbol width"),
    (_edit(6, "<B", 11), len(RAW), "precision"),
    (_edit(7, "<B", 2), len(RAW), "contexts"),
    (_edit(8, "<I", 0), len(RAW), "dim"),
    (_edit(12, "<I", 0), len(RAW), "lanes"),
    (_edit(12, "<I", 1 << 17), len(RAW), "lanes"),
    (_edit(16, "<Q", (1 << 64) - 1), len(RAW), "symbols"),
    (_edit(24, "<Q", (1 << 62)), len(RAW), "implies"),  # a huge word count: refused before any read
    (GOOD, len(RAW) - 8, "symbols"),
    (GOOD, len(RAW) + 4, "whole number"),
])
def test_malformed_headers(stored, raw_length, what):
    with pytest.raises(F.MalformedSectionError, match=what):
        rans.decode(stored, raw_length)


def test_random_damage_never_crashes():
    """Any damaged stream decodes to exactly raw_length bytes or raises MalformedSectionError."""
    rng = np.random.default_rng(11)
    caught = 0
    for _ in range(300):
        b = bytearray(GOOD)
        for _ in range(rng.integers(1, 4)):
            b[rng.integers(0, len(b))] ^= 1 << rng.integers(0, 8)
        try:
            out = rans.decode(bytes(b), len(RAW))
        except F.MalformedSectionError:
            caught += 1
            continue
        assert out.nbytes == len(RAW)
    assert caught > 250  # the final-state check catches nearly every damaged stream


def test_damaged_stream_in_a_file_is_a_section_error(tmp_path):
    data = bytearray((ROOT / "format_spec/vectors/valid/entropy_coded.rvq").read_bytes())
    with F.open_rvq(bytes(data)) as f:
        s = f.section("layers.0.keys.codes1")
    # damage a word, then recompute the section checksum in the header so only the stream is wrong
    MVdata = MV.VALID["entropy_coded.rvq"]()
    assert bytes(data) == MVdata
    bad = MV._rans_edit(lambda b: MV._put(b, len(b) - 4, "<H", 0x1234 ^ struct.unpack_from("<H", b, len(b) - 4)[0]))()
    with F.open_rvq(bad) as f:
        with pytest.raises(F.MalformedSectionError, match="rans"):
            f.read_section(s.name)
        with pytest.raises(F.MalformedSectionError):
            f.verify()


def test_expansion_bound_applies_to_rans():
    from rvqstore.format.header import _parse_section

    row = dict(name="a", layer=0, kind="keys.codes1", dtype="uint32", shape=[33 * 10], offset=64, length=40,
               codec="rans", raw_length=33 * 40, checksum=0)
    with pytest.raises(F.LimitExceededError, match="32x"):
        _parse_section(None, 0, row)
    with pytest.raises(F.MalformedHeaderError, match="uint32"):
        _parse_section(None, 0, dict(row, dtype="int32"))
