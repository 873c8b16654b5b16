"""Mutation tests: damaged copies of valid files give a typed FormatError or a correct load, never a
crash, a hang, or an allocation far beyond the file's size.

Bases: every valid test vector, plus a file the library writer made from real codec output with zstd
sections.  All choices of position are deterministic.
"""

from __future__ import annotations

import copy
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

import rvqstore.format as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_format import HOSTILE_INTS, load_bytes, rebuild, seeds, split  # noqa: E402

TYPED = {name for name in F.errors.__all__ if name != "SectionNotFoundError"}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, bytes]:
    from test_format_roundtrip import make_cache

    out = dict(seeds(snapshots=False))  # the fuzz tests mutate the real snapshots
    d = tmp_path_factory.mktemp("base")
    header, secs, _, _ = make_cache(n_layers=2, T=21, D=64, n_dense=2)
    F.write_rvq(d / "written_zstd.rvq", header, secs, compress="zstd")
    out["written_zstd.rvq"] = (d / "written_zstd.rvq").read_bytes()
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("mut"))


def outcome(data: bytes, work: str, decode: bool = False) -> str:
    out = load_bytes(data, work, decode=decode, max_alloc=max(1 << 22, 40 * len(data)))
    assert out == "ok" or out in TYPED, out
    return out


def test_bases_are_valid(bases, work):
    for name, data in bases.items():
        assert outcome(data, work, decode=True) == "ok", name


def _boundaries(data: bytes) -> list[int]:
    header, _ = split(data)
    h_off = struct.unpack_from("<Q", data, 16)[0]
    cuts = {0, 1, 7, 8, 9, 10, 63, 64, h_off, len(data) - 1}
    for e in header["sections"]:
        cuts.update({e["offset"], e["offset"] + e["length"]})
    out = set()
    for c in cuts:
        out.update({c - 1, c, c + 1})
    return sorted(c for c in out if 0 <= c < len(data))


def test_truncation_at_every_section_boundary(bases, work):
    for name, data in bases.items():
        for cut in _boundaries(data):
            assert outcome(data[:cut], work) == "TruncatedFileError", (name, cut)


def test_truncation_at_every_length_of_a_small_file(bases, work):
    data = bases["worked_example.rvq"]
    for cut in range(len(data)):
        assert outcome(data[:cut], work) == "TruncatedFileError", cut


@pytest.mark.parametrize("extra", [b"\x00", b"\x00" * 63, b"\x00" * 64, b"garbage", bytes(range(256)) * 16])
def test_appended_bytes(bases, work, extra):
    for name, data in bases.items():
        assert outcome(data + extra, work) == "TrailingDataError", name


def test_single_bit_flips_are_always_detected(bases, work):
    """Every byte of a valid file is covered by a checksum or is padding that must be zero, so a single
    flipped bit anywhere gives an error.  Positions: every preamble byte, every byte of the smallest
    file, and a deterministic stride (coprime with 64 and 8) through the others; bit = position mod 8."""
    n_cases = 0
    for name, data in sorted(bases.items()):
        if name == "worked_example.rvq":
            positions = range(len(data))
        else:
            positions = sorted(set(range(64)) | set(range(64, len(data), 29)))
        for pos in positions:
            b = bytearray(data)
            b[pos] ^= 1 << (pos % 8)
            out = outcome(bytes(b), work)
            assert out != "ok", (name, pos)
            n_cases += 1
    assert n_cases > 2500, n_cases


def _all_int_paths(obj, prefix=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _all_int_paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _all_int_paths(v, prefix + (i,))
    elif type(obj) is int:
        yield prefix


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


@pytest.mark.parametrize("name", ["worked_example.rvq", "two_layers_dense_tail_zstd.rvq", "written_zstd.rvq"])
def test_inflated_lengths_and_counts_in_the_header(bases, work, name):
    """Every integer of the header replaced by hostile values (huge, negative, off by one, 2^k), with the
    header checksum and lengths fixed so the value reaches the schema, layout and section checks."""
    data = bases[name]
    header, _ = split(data)
    seen = {}
    n_sec = len(header["sections"])
    for path in _all_int_paths(header):
        if name != "worked_example.rvq" and path[0] in ("sections", "layers") and \
                path[1] not in (0, 1, n_sec - 1):
            continue  # larger files: the first two and the last entries stand for the rest
        if "quantizer" in path and path[-1] != "version" and "dim" not in path and "bits" not in str(path):
            continue  # table values are floats; the seed is any uint64
        for v in HOSTILE_INTS + [header_value(header, path) + 1, header_value(header, path) * 2]:
            if not -(1 << 63) <= v < (1 << 64):
                continue  # not representable in msgpack
            h = copy.deepcopy(header)
            _set(h, path, v)
            out = outcome(rebuild(data, h), work)
            seen[out] = seen.get(out, 0) + 1
            if out == "ok":  # only where the value did not change anything a reader relies on
                assert v == header_value(header, path) or path[0] in ("model", "metadata") or \
                    path[-1] == "seed", (path, v)
    assert seen.get("ok", 0) < sum(seen.values()) / 5


def header_value(header, path):
    for k in path:
        header = header[k]
    return header


def test_inflated_counts_of_lists(bases, work):
    """Sections, layers and features lists repeated or padded to their limits and beyond."""
    data = bases["worked_example.rvq"]
    header, _ = split(data)
    cases = {
        "sections doubled": dict(header, sections=header["sections"] * 2),
        "layers doubled": dict(header, layers=header["layers"] * 2),
        "features at the limit": dict(header, required_features=[f"f{i}" for i in range(64)]),
        "features over the limit": dict(header, required_features=[f"f{i}" for i in range(65)]),
        "4097 layers": dict(header, layers=header["layers"] * 4097),
        "sections huge shape": dict(header, sections=[dict(s, shape=[1 << 40] * 8) for s in header["sections"]]),
    }
    for label, h in cases.items():
        out = outcome(rebuild(data, h), work)
        assert out != "ok", label


def test_zstd_bombs_are_not_allocated(work):
    """Frames claiming up to 2^62 bytes: refused before allocation, with and without a matching
    raw_length in the header."""
    import make_format_vectors as MV

    content, secs = MV.v_worked_example()
    tok = secs[0]["_data"]
    for claim in (1 << 20, 1 << 32, 1 << 40, 1 << 62):
        for declared in (len(tok), claim):
            frame = MV.zstd_frame([("rle", (0, 1 << 17))], claim)
            s0 = dict(secs[0], _data=frame, codec="zstd", raw_length=declared, shape=[declared // 4])
            data = MV.assemble(content, [s0] + secs[1:])
            out = outcome(data, work)
            assert out in ("LimitExceededError", "MalformedSectionError", "MalformedHeaderError"), (claim, declared, out)


def test_real_zstd_frame_header_edits(bases, work):
    """Edits of a real zstd frame's header bytes, with the section checksum fixed so they reach the
    frame checks: always a typed error."""
    import xxhash

    data = bases["written_zstd.rvq"]
    header, _ = split(data)
    z = [e for e in header["sections"] if e["codec"] == "zstd"]
    assert z
    e = z[0]
    for pos in range(4, min(18, e["length"])):
        for val in (0x00, 0xFF, 0xE0, 0x20):
            b = bytearray(data)
            b[e["offset"] + pos] = val
            if bytes(b) == data:
                continue
            h = copy.deepcopy(header)
            for s in h["sections"]:
                if s["name"] == e["name"]:
                    s["checksum"] = xxhash.xxh3_64_intdigest(bytes(b[e["offset"]: e["offset"] + e["length"]]))
            out = outcome(rebuild(bytes(b), h), work)
            assert out in ("MalformedSectionError", "ok"), (pos, val, out)
            if out == "ok":  # a frame header byte whose change does not alter the content (e.g. window size)
                with F.open_rvq(Path(work) / "fuzz.rvq") as f, F.open_rvq(_write(work, data)) as g:
                    assert np.array_equal(f.read_section(e["name"]), g.read_section(e["name"]))


def _write(work: str, data: bytes) -> str:
    p = str(Path(work) / "orig.rvq")
    Path(p).write_bytes(data)
    return p
