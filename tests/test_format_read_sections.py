"""RVQFile.read_sections: compressed sections decoded on a pool of threads, raw ones in the caller's; the
same arrays as reading them in turn, the same first error, and one thread only for sources that do not
say they take concurrent reads. Real files, real damage."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import rvqstore.format as F
from rvqstore.format import reader as R
from rvqstore.format.errors import ChecksumMismatchError

sys.path.insert(0, str(Path(__file__).parent))
from test_format_roundtrip import make_cache  # noqa: E402


@pytest.fixture(autouse=True)
def pool_for_small_files(monkeypatch):
    """These files are small: the pool is switched on for them (test_small_files_are_read_in_turn says
    what happens by default)."""
    monkeypatch.setattr(R, "PARALLEL_MIN_BYTES", 0)


@pytest.fixture
def mixed(tmp_path):
    """A file of zstd sections (tokens, scales, codes that compress) beside raw ones (random words)."""
    header, secs, _, _ = make_cache(n_layers=3, T=300, n_dense=4)
    rng = np.random.default_rng(1)
    secs += [F.Section(f"noise{i}", -1, f"x.noise{i}", rng.integers(0, 2**32, 4096, dtype=np.uint32)) for i in range(3)]
    path = tmp_path / "m.rvq"
    h = F.write_rvq(path, header, secs, compress="auto")
    codecs = {s.codec for s in h.sections}
    assert codecs == {"raw", "zstd"}
    return path, h


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("as_mx", [False, True])
def test_the_same_arrays_as_reading_in_turn(mixed, monkeypatch, threads, as_mx):
    path, h = mixed
    monkeypatch.setattr(R, "READ_THREADS", threads)
    names = [s.name for s in h.sections]
    with F.open_rvq(path) as f:
        got = f.read_sections(names, as_mx=as_mx)
        want = [f.read_section_mx(n) if as_mx else f.read_section(n) for n in names]
        for name, g, w in zip(names, got, want):
            assert type(g) is type(w) and g.dtype == w.dtype and g.shape == w.shape, name
            assert (mx.array_equal(g, w) if as_mx else np.array_equal(g, w)), name
            if not as_mx:
                assert not g.flags.writeable


def _damage(path: Path, h, name: str) -> None:
    s = next(x for x in h.sections if x.name == name)
    data = bytearray(path.read_bytes())
    data[s.offset + s.length // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("first,second", [("zstd", "raw"), ("raw", "zstd")])
def test_the_first_damaged_name_is_the_error(mixed, monkeypatch, first, second):
    path, h = mixed
    monkeypatch.setattr(R, "READ_THREADS", 4)
    by_codec = {c: [s.name for s in h.sections if s.codec == c] for c in ("raw", "zstd")}
    names = [s.name for s in h.sections]
    a = by_codec[first][0]
    b = next(n for n in by_codec[second] if names.index(n) > names.index(a))
    _damage(path, h, a)
    _damage(path, h, b)
    with F.open_rvq(path) as f:
        for order in (names, names[::-1]):
            want = a if order is names else b
            with pytest.raises(ChecksumMismatchError, match=f"section '{want}'"):
                f.read_sections(order)


class _OneAtATime:
    """A range source that does not offer concurrent reads: the reader must call it from one thread."""

    def __init__(self, data: bytes):
        self.data, self.size, self.threads = data, len(data), set()

    def read(self, offset: int, length: int) -> bytes:
        self.threads.add(threading.get_ident())
        return self.data[offset: offset + length]


def test_a_source_without_concurrent_reads_is_read_from_one_thread(mixed, monkeypatch):
    path, h = mixed
    monkeypatch.setattr(R, "READ_THREADS", 4)
    src = _OneAtATime(path.read_bytes())
    names = [s.name for s in h.sections]
    with F.open_rvq(src) as f:
        got = f.read_sections(names)
    assert src.threads == {threading.get_ident()}
    with F.open_rvq(path) as f:
        assert all(np.array_equal(g, f.read_section(n)) for g, n in zip(got, names))


@pytest.fixture
def reader_threads(monkeypatch):
    """The set of threads that read a section (filled as sections are read)."""
    seen = set()
    real = R.RVQFile.read_section

    def spy(self, name):
        seen.add(threading.get_ident())
        return real(self, name)

    monkeypatch.setattr(R.RVQFile, "read_section", spy)
    return seen


def test_files_and_bytes_take_concurrent_reads(mixed, monkeypatch, reader_threads):
    path, h = mixed
    monkeypatch.setattr(R, "READ_THREADS", 4)
    seen = reader_threads
    for src in (path, path.read_bytes()):
        seen.clear()
        with F.open_rvq(src) as f:
            f.read_sections([s.name for s in h.sections])
        assert len(seen) > 1  # the pool took the zstd sections


def test_small_files_are_read_in_turn(mixed, monkeypatch, reader_threads):
    path, h = mixed
    monkeypatch.setattr(R, "READ_THREADS", 4)
    packed = sum(s.raw_length for s in h.sections if s.codec != "raw")
    seen = reader_threads
    for limit, threads in ((packed + 1, 1), (packed, None)):
        monkeypatch.setattr(R, "PARALLEL_MIN_BYTES", limit)
        seen.clear()
        with F.open_rvq(path) as f:
            f.read_sections([s.name for s in h.sections])
        assert (len(seen) == 1) if threads == 1 else (len(seen) > 1)


@pytest.mark.parametrize("threads", [1, 4])
def test_then_takes_each_section_in_the_callers_thread_as_it_comes(mixed, monkeypatch, threads):
    """``then`` (the loader's device copies) sees every section once, in this thread, and its results are
    what comes back; sections read in this thread reach it before the pool's are waited for."""
    from rvqstore.device_memory import copy_bits

    path, h = mixed
    monkeypatch.setattr(R, "READ_THREADS", threads)
    names = [s.name for s in h.sections]
    codec = {s.name: s.codec for s in h.sections}
    seen, made = [], []

    def then(a):
        seen.append((threading.get_ident(), a.shape, a.dtype))
        made.append(copy_bits(a))
        return made[-1]

    with F.open_rvq(path) as f:
        got = f.read_sections(names, as_mx=True, then=then)
        want = [f.read_section_mx(n) for n in names]
    assert {t for t, _, _ in seen} == {threading.get_ident()} and len(seen) == len(names)
    assert all(g.dtype == w.dtype and mx.array_equal(g, w) for g, w in zip(got, want))
    assert sum(any(g is m for m in made) for g in got) == sum(g.dtype != mx.bfloat16 for g in got)
    if threads > 1:  # the raw ones first (read here), then the pool's in name order
        raw = [w.shape for n, w in zip(names, want) if codec[n] == "raw"]
        assert [shape for _, shape, _ in seen[:len(raw)]] == raw


def test_then_is_not_called_past_the_first_error(mixed, monkeypatch):
    path, h = mixed
    monkeypatch.setattr(R, "READ_THREADS", 4)
    names = [s.name for s in h.sections]
    raw = [s.name for s in h.sections if s.codec == "raw"]
    _damage(path, h, raw[0])
    calls = []
    with F.open_rvq(path) as f, pytest.raises(ChecksumMismatchError, match=f"section '{raw[0]}'"):
        f.read_sections(names, then=lambda a: calls.append(a) or a)
    assert len(calls) < len(names)
