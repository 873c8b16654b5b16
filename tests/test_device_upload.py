"""Sections into device memory through a pinned ring (rvqstore.device_upload, RVQFile.read_section_into).

The pipeline and the reader run on any backend: here with a numpy buffer as the ring and a launch that copies
its range into an MLX array, so the ring's reuse, the order of results and the errors are those of the CUDA path;
the pinned buffer and the copy kernel themselves are checked on the GPU (marked ``gpu``).
"""

from __future__ import annotations

import copy
import random
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import rvqstore.format as F
from rvqstore import device_upload
from rvqstore.device_upload import ALIGN, StagingRing

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).reshape(-1).view(np.uint8)


def _same(xs, ys) -> None:
    assert len(xs) == len(ys)
    for a, b in zip(xs, ys):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(_bits(a), _bits(b))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Files the library wrote from real caches: zstd, raw and rANS sections, bfloat16 norms, two layers."""
    from bench_generation import fill, make_caches, save

    d = tmp_path_factory.mktemp("upload")
    out = {}
    for arm in ("packed-2+2", "packed-4+2"):
        cs = make_caches(arm, 2)
        fill(cs, 333, 2, 64, mx.float32)
        for comp in ("auto", "none", "rans"):
            p = d / f"{arm}-{comp}.rvq"
            save(arm, cs, str(p), compress=comp)
            out[(arm, comp)] = p
    return out


# ---- the ring ------------------------------------------------------------------------------------------
def test_ring_takes_in_order_wraps_and_refuses_what_does_not_fit():
    r = StagingRing(10 * ALIGN)
    assert [r.take(ALIGN * 3) for _ in range(3)] == [0, 3 * ALIGN, 6 * ALIGN]
    assert r.take(2 * ALIGN) is None  # 1 left at the end, none before the oldest
    r.release()  # [0, 3) free
    assert r.take(2 * ALIGN) == 0  # the end cannot hold it: wraps
    assert r.take(ALIGN + 1) is None  # [2, 3) is one slot
    assert r.take(1) == 2 * ALIGN  # any size takes a whole slot
    r.release(), r.release(), r.release(), r.release()
    assert len(r) == 0 and r.take(10 * ALIGN) == 0
    with pytest.raises(ValueError):
        StagingRing(4 * ALIGN).take(4 * ALIGN + 1)


def test_ring_ranges_never_overlap_and_an_empty_ring_always_takes():
    rnd = random.Random(5)
    cap = 64 * ALIGN
    r = StagingRing(cap)
    live: list[tuple[int, int]] = []
    for _ in range(5000):
        if live and rnd.random() < 0.45:
            r.release()
            live.pop(0)
            continue
        n = rnd.randint(1, cap // 2)
        off = r.take(n)
        if not live:
            assert off == 0
        if off is None:
            continue
        size = -(-n // ALIGN) * ALIGN
        assert off % ALIGN == 0 and off + size <= cap
        assert all(off + size <= a or b <= off for a, b in live)
        live.append((off, off + size))
        assert len(r) == len(live)


# ---- read_section_into -----------------------------------------------------------------------------------
def test_read_section_into_gives_read_sections_bytes(files):
    for p in files.values():
        with F.open_rvq(p) as f:
            codecs = set()
            for s in f.sections:
                buf = np.full(s.raw_length, 0xA5, np.uint8)
                f.read_section_into(s.name, buf)
                assert np.array_equal(buf, np.ascontiguousarray(f.read_section(s.name)).reshape(-1).view(np.uint8))
                codecs.add(s.codec)
    assert {"raw", "zstd", "rans"} <= codecs | {c for p in files.values() for c in _codecs(p)}


def _codecs(p):
    with F.open_rvq(p) as f:
        return {s.codec for s in f.sections}


def test_read_section_into_refuses_a_wrong_buffer(files):
    with F.open_rvq(files[("packed-2+2", "auto")]) as f:
        s = f.sections[-1]
        for bad in (np.zeros(s.raw_length + 1, np.uint8), np.zeros(s.raw_length // 2, np.uint16),
                    np.zeros((1, s.raw_length), np.uint8)):
            with pytest.raises(ValueError):
                f.read_section_into(s.name, bad)
        ro = np.zeros(s.raw_length, np.uint8)
        ro.flags.writeable = False
        with pytest.raises(ValueError):
            f.read_section_into(s.name, ro)


def _outcome(fn):
    try:
        return fn()
    except F.FormatError as e:
        return type(e).__name__


def test_read_section_into_fails_as_read_section_on_damaged_zstd_frames(tmp_path):
    """Frames with bytes after them, a short or long content, a reserved block type, edits of a real frame's
    header: the same typed error from both readers (or the same bytes), the checksums fixed so the frames are
    what is checked."""
    import xxhash
    import make_format_vectors as MV
    from fuzz_format import rebuild, split
    from test_format_roundtrip import make_cache

    content, secs = MV.v_worked_example()
    tok = secs[0]["_data"]
    n = len(tok)
    frames = {
        "good": MV.zstd_frame([("raw", tok)], n),
        "two blocks": MV.zstd_frame([("raw", tok[:3]), ("raw", tok[3:])], n),
        "rle": MV.zstd_frame([("rle", (7, n))], n),
        "garbage after": MV.zstd_frame([("raw", tok)], n) + b"\x01\x02",
        "second frame after": MV.zstd_frame([("raw", tok)], n) + MV.zstd_frame([("raw", tok)], n),
        # a skippable frame (RFC 8878 3.1.2): decodes to nothing, still bytes after the section's frame
        "skippable frame after": MV.zstd_frame([("raw", tok)], n) + bytes.fromhex("502a4d18") + (3).to_bytes(4, "little")
        + b"abc",
        "short": MV.zstd_frame([("raw", tok[:-1])], n),
        "long": MV.zstd_frame([("raw", tok + b"\0")], n),
        "no content size": MV.zstd_frame([("raw", tok)], None),
        "reserved block": MV.zstd_frame([("raw", tok)], n)[:-n - 3] + (((n << 3) | (3 << 1) | 1).to_bytes(3, "little")) + tok,
        "cut block header": MV.zstd_frame([("raw", tok)], n)[:-n - 1],
    }
    cases = {}
    for label, frame in frames.items():
        s0 = dict(secs[0], _data=frame, codec="zstd", raw_length=n)
        cases[label] = MV.assemble(content, [s0] + secs[1:])
    header, secs2, _, _ = make_cache(n_layers=1, T=21, D=64, n_dense=2)
    F.write_rvq(tmp_path / "z.rvq", header, secs2, compress="zstd")
    data = (tmp_path / "z.rvq").read_bytes()
    h0, _ = split(data)
    e = [x for x in h0["sections"] if x["codec"] == "zstd"][0]
    for pos in range(4, min(18, e["length"])):
        for val in (0x00, 0xFF, 0xE0, 0x20):
            b = bytearray(data)
            b[e["offset"] + pos] = val
            h = copy.deepcopy(h0)
            for s in h["sections"]:
                if s["name"] == e["name"]:
                    s["checksum"] = xxhash.xxh3_64_intdigest(bytes(b[e["offset"]: e["offset"] + e["length"]]))
            cases[f"edit {pos}={val:#x}"] = rebuild(bytes(b), h)
    seen = set()
    for label, blob in cases.items():
        p = tmp_path / "case.rvq"
        p.write_bytes(blob)
        try:
            f = F.open_rvq(p)
        except F.FormatError:
            continue
        with f:
            for s in f.sections:
                a = _outcome(lambda: np.ascontiguousarray(f.read_section(s.name)).reshape(-1).view(np.uint8).copy())
                buf = np.zeros(s.raw_length, np.uint8)
                b = _outcome(lambda: (f.read_section_into(s.name, buf), buf)[1])
                if isinstance(a, str) or isinstance(b, str):
                    assert a == b, (label, s.name, a, b)
                    seen.add(a)
                else:
                    assert np.array_equal(a, b), (label, s.name)
    assert "MalformedSectionError" in seen


# ---- the pipeline -----------------------------------------------------------------------------------------
class _Launches:
    """A launch that copies the ring's range (what the kernel does), recording what it was given."""

    def __init__(self, staging):
        self.staging = staging
        self.calls: list[tuple[int, int]] = []

    def __call__(self, off, n):
        self.calls.append((off, n))
        return mx.array(self.staging[off:off + n].copy())


@pytest.mark.parametrize("cap", [1 << 12, 1 << 15, 1 << 17, 1 << 22])
def test_upload_gives_read_sections_arrays_with_any_ring(files, cap):
    for p in files.values():
        with F.open_rvq(p) as f:
            names = [s.name for s in f.sections]
            staging = np.zeros(cap, np.uint8)
            launches = _Launches(staging)
            got = device_upload.upload(f, names, staging, launches, threads=3)
            _same(f.read_sections(names, as_mx=True), got)
            eligible = [n for n in names if 0 < f.section(n).raw_length <= cap // 2]
            runs = _runs(launches.calls, [f.section(x).raw_length for x in eligible])
            assert all(len(r) == 1 or n <= cap // device_upload.GROUP_SHARE for r, (_, n) in zip(runs, launches.calls))
            if cap == 1 << 22:  # neighbours went together
                assert len(launches.calls) < len(eligible)


def _runs(calls, sizes):
    """The sections (indices into ``sizes``, in order) each launch ``(offset, n)`` copied: consecutive runs of
    neighbouring slots that together are exactly ``n`` bytes, covering every section once, in order."""
    runs, k = [], 0
    for off, n in calls:
        run, span = [], 0
        while k < len(sizes) and span < n:
            run.append(k)
            span += sizes[k] if span + sizes[k] == n else device_upload._slot(sizes[k])
            k += 1
        assert run and span == n, (off, n, run)
        runs.append(run)
    assert k == len(sizes)
    return runs


def test_compressed_loads_take_more_workers_than_raw_ones(files, monkeypatch):
    """zstd is CPU-bound, raw copies bound by memory: a load whose bytes are mostly compressed takes THREADS
    workers, one mostly raw RAW_THREADS (read from the sections' codecs)."""
    monkeypatch.setattr(device_upload, "THREADS", 16)
    monkeypatch.setattr(device_upload, "RAW_THREADS", 8)
    for comp, want in (("none", 8), ("rans", 16)):
        with F.open_rvq(files[("packed-4+2", comp)]) as f:
            names = [s.name for s in f.sections]
            raw = sum(s.raw_length for s in f.sections if s.codec == "raw")
            assert (2 * raw > sum(s.raw_length for s in f.sections)) == (want == 8)
            assert device_upload.workers(f, names) == want
            assert device_upload.workers(f, []) == 8


def test_upload_of_a_subset_in_any_order(files):
    with F.open_rvq(files[("packed-4+2", "auto")]) as f:
        names = [s.name for s in f.sections][::-1][:7]
        staging = np.zeros(1 << 16, np.uint8)
        _same(f.read_sections(names, as_mx=True), device_upload.upload(f, names, staging, _Launches(staging)))


def test_upload_raises_the_first_failing_section_and_leaves_nothing_running(files, tmp_path):
    """A checksum mismatch in the middle: the same error as read_sections, every worker stopped (the ring is not
    written after the call) and the file unchanged."""
    from fuzz_format import split

    src = files[("packed-2+2", "none")]
    data = bytearray(src.read_bytes())
    header, _ = split(bytes(data))
    secs = sorted(header["sections"], key=lambda e: e["offset"])
    bad = secs[len(secs) // 2]
    data[bad["offset"] + bad["length"] // 2] ^= 0x40
    p = tmp_path / "bad.rvq"
    p.write_bytes(bytes(data))
    with F.open_rvq(p) as f:
        names = [s.name for s in f.sections]
        with pytest.raises(F.ChecksumMismatchError) as want:
            f.read_sections(names, as_mx=True)
        staging = np.zeros(1 << 15, np.uint8)
        with pytest.raises(F.ChecksumMismatchError) as got:
            device_upload.upload(f, names, staging, _Launches(staging), threads=4)
        assert str(got.value) == str(want.value)
        before = staging.copy()
        time.sleep(0.05)
        assert np.array_equal(before, staging)
    assert p.read_bytes() == bytes(data)


def test_upload_reuses_a_range_only_after_the_copy_that_read_it_was_evaluated(files, monkeypatch):
    """Every worker's write into the ring starts only once each launch whose range it overlaps has been waited
    for (mx.eval of its output, the sign on CUDA that the kernel has read the range)."""
    lock = threading.Lock()
    evals = [0]  # outputs waited for, oldest first
    launched: list[tuple[int, int]] = []
    bad = []

    class MX:
        def __getattr__(self, name):
            return getattr(mx, name)

        def eval(self, *a):
            with lock:
                evals[0] += 1
            return mx.eval(*a)

    class File:
        def __init__(self, f, base):
            self.f, self.base = f, base

        def __getattr__(self, name):
            return getattr(self.f, name)

        def read_section_into(self, name, out):
            off = out.__array_interface__["data"][0] - self.base
            end = off + out.nbytes
            with lock:
                for k, (a, b) in enumerate(launched):
                    if a < end and off < b and k >= evals[0]:
                        bad.append((name, off, k))
            time.sleep(0.001)  # let the caller run ahead if it would
            return self.f.read_section_into(name, out)

    monkeypatch.setattr(device_upload, "mx", MX())
    with F.open_rvq(files[("packed-4+2", "none")]) as f:
        names = [s.name for s in f.sections] * 3
        staging = np.zeros(1 << 15, np.uint8)

        def launch(off, n):
            with lock:
                launched.append((off, off + n))
            return mx.array(staging[off:off + n].copy())

        got = device_upload.upload(File(f, staging.__array_interface__["data"][0]), names, staging, launch, threads=4)
        _same(f.read_sections(names, as_mx=True), got)
    assert launched and not bad
    assert len({a for a, _ in launched}) < len(launched)  # ranges were reused


def test_a_load_through_the_pipeline_equals_the_regular_load(files, monkeypatch):
    """rvqstore.load_prompt_cache with the ring (a host buffer and copying launch in place of the pinned buffer
    and kernel) gives the caches of the regular path, bit for bit."""
    import rvqstore

    for key in (("packed-2+2", "auto"), ("packed-4+2", "rans")):
        ref = rvqstore.load_prompt_cache(str(files[key]))
        staging = np.zeros(1 << 16, np.uint8)
        calls = []

        def fake(f, names):
            calls.append(len(names))
            return device_upload.upload(f, names, staging, _Launches(staging))
        monkeypatch.setattr(device_upload, "read_sections", fake)
        got = rvqstore.load_prompt_cache(str(files[key]))
        monkeypatch.undo()
        assert calls
        for a, b in zip(ref, got):
            _same([x for x in _flat(a.state)], [x for x in _flat(b.state)])


def _flat(st):
    for x in (st if isinstance(st, (list, tuple)) else [st]):
        if isinstance(x, mx.array):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from _flat(x)


def test_no_ring_off_cuda_or_when_turned_off(files, monkeypatch):
    with F.open_rvq(files[("packed-2+2", "auto")]) as f:
        names = [s.name for s in f.sections]
        monkeypatch.setenv(device_upload.ENV, "0")
        assert not device_upload.available() and device_upload.read_sections(f, names) is None
        monkeypatch.delenv(device_upload.ENV)
        from rvqstore import fused
        if not (fused.gpu_backend() == "cuda" and fused._on_gpu()):
            assert device_upload.read_sections(f, names) is None


# ---- on the GPU: the pinned buffer and the copy kernel ------------------------------------------------
cuda = pytest.mark.skipif(not device_upload.available(), reason="CUDA device and pinned memory")


@pytest.mark.gpu
@cuda
def test_gpu_upload_kernel_copies_every_length_and_offset():
    from rvqstore import pinned_memory

    buf = pinned_memory.allocate(1 << 20)
    try:
        rng = np.random.default_rng(3)
        buf.array[:] = rng.integers(0, 256, buf.nbytes, dtype=np.uint8)
        for off in (0, 256, 4096, 1 << 19):
            for n in (1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 4095, 4096 * 4 + 3, 300_001, (1 << 19) - off % (1 << 19)):
                if off + n > buf.nbytes:
                    continue
                out = device_upload._launch(buf.device_address + off, n)
                assert np.array_equal(np.array(out), buf.array[off:off + n]), (off, n)
    finally:
        buf.free()


@pytest.mark.gpu
@cuda
def test_gpu_load_through_the_pinned_ring_equals_the_regular_load(files, monkeypatch):
    import rvqstore

    for key in files:
        monkeypatch.setenv(device_upload.ENV, "0")
        ref = rvqstore.load_prompt_cache(str(files[key]))
        monkeypatch.delenv(device_upload.ENV)
        with F.open_rvq(files[key]) as f:
            names = [s.name for s in f.sections]
            got = device_upload.read_sections(f, names)
            assert got is not None
            _same(f.read_sections(names, as_mx=True), got)
        loaded = rvqstore.load_prompt_cache(str(files[key]))
        for a, b in zip(ref, loaded):
            _same(list(_flat(a.state)), list(_flat(b.state)))


@pytest.mark.gpu
@cuda
def test_gpu_ring_small_enough_to_wrap(files, monkeypatch):
    """A ring of 16 MiB with the test files' small sections takes every section; with a tiny limit the path is
    refused (below MIN_RING) and the regular path serves."""
    with F.open_rvq(files[("packed-4+2", "auto")]) as f:
        names = [s.name for s in f.sections]
        monkeypatch.setenv(device_upload.ENV, "1")
        assert device_upload.read_sections(f, names) is None
        monkeypatch.setenv(device_upload.ENV, "16")
        got = device_upload.read_sections(f, names)
        _same(f.read_sections(names, as_mx=True), got)


def test_concurrent_loads_share_nothing(files):
    """Two threads loading through host rings at once get their own files' arrays (compared in the thread that
    made them: MLX's streams are per thread)."""
    out = {}

    def run(key):
        try:
            with F.open_rvq(files[key]) as f:
                names = [s.name for s in f.sections]
                staging = np.zeros(1 << 15, np.uint8)
                got = device_upload.upload(f, names, staging, _Launches(staging))
                _same(f.read_sections(names, as_mx=True), got)
            out[key] = "ok"
        except BaseException as e:  # noqa: BLE001 - reported below
            out[key] = repr(e)
    keys = [("packed-2+2", "auto"), ("packed-4+2", "none")]
    ts = [threading.Thread(target=run, args=(k,)) for k in keys]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert out == {k: "ok" for k in keys}


def test_a_file_of_mixed_cache_kinds_through_the_pipeline(tmp_path, monkeypatch):
    """A list layer (recurrent arrays + keys/values), a sliding window and a plain layer: every kind's sections go
    through the ring and load to the regular path's states, bit for bit."""
    from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

    import rvqstore

    mx.random.seed(2)
    ring = RotatingKVCache(16, 0)
    plain = KVCache()
    arrays = ArraysCache(2)
    arrays[0], arrays[1] = mx.random.normal((1, 3, 8)), mx.random.normal((1, 4))
    inner = KVCache()
    for c in (ring, plain, inner):
        for _ in range(3):
            k = mx.random.normal((1, 2, 13, 64))
            c.update_and_fetch(k, k * 0.5)
    caches = rvqstore.convert_prompt_cache([CacheList(arrays, inner), ring, plain], bits=(4, 2))
    p = tmp_path / "mixed.rvq"
    rvqstore.save_prompt_cache(p, caches)
    ref = rvqstore.load_prompt_cache(str(p))
    staging = np.zeros(1 << 16, np.uint8)
    launches, asked = _Launches(staging), []

    def read_sections(f, names):
        asked.extend(names)
        return device_upload.upload(f, names, staging, launches)

    monkeypatch.setattr(device_upload, "read_sections", read_sections)
    got = rvqstore.load_prompt_cache(str(p))
    with F.open_rvq(p) as f:
        assert sorted(asked) == sorted(s.name for s in f.sections)  # every section asked of the ring, once
        _runs(launches.calls, [f.section(n).raw_length for n in asked if 0 < f.section(n).raw_length <= (1 << 15)])
        assert {lay.kind for lay in f.layers} >= {"list", "rvq-rotating", "rvq"}
    assert [type(c).__name__ for c in got] == [type(c).__name__ for c in ref]
    for a, b in zip(ref, got):
        xs = list(_flat(a.state))
        assert xs
        _same(xs, list(_flat(b.state)))
