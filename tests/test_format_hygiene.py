"""Issue 12, format side: permissions and symlinks on save, stale temporaries, FIFOs, header decode
bounds, decoded-size limit, every byte a load relies on checked, range sources."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import signal
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest

import rvqstore
import rvqstore.format as F
from rvqstore.format import constants as C
from rvqstore.format.header import decode_header
from rvqstore.format.preamble import pack_preamble
from rvqstore.format.checksum import checksum
from rvqstore.format.tempfiles import sweep_stale_temps

from test_format_roundtrip import make_cache

ROOT = Path(__file__).resolve().parent.parent


def _write(path, **kw):
    header, secs, _, _ = make_cache(n_layers=1, T=5, **kw)
    return F.write_rvq(path, header, secs)


# ---- 12.3 permissions and symlinks -------------------------------------------------------------------
def test_resave_keeps_the_existing_mode(tmp_path):
    p = tmp_path / "a.rvq"
    _write(p)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600  # new file: private
    os.chmod(p, 0o640)
    _write(p)
    assert stat.S_IMODE(p.stat().st_mode) == 0o640
    _write(p, seed=1)
    assert stat.S_IMODE(p.stat().st_mode) == 0o640


def test_explicit_mode_wins(tmp_path):
    p = tmp_path / "a.rvq"
    header, secs, _, _ = make_cache(n_layers=1, T=5)
    F.write_rvq(p, header, secs, mode=0o644)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644
    with pytest.raises(ValueError, match="mode"):
        F.write_rvq(p, header, secs, mode=0o10000)


def test_read_only_file_is_not_replaced(tmp_path):
    p = tmp_path / "a.rvq"
    _write(p)
    os.chmod(p, 0o444)
    before = p.read_bytes()
    with pytest.raises(PermissionError, match="read-only"):
        _write(p, seed=3)
    assert p.read_bytes() == before and stat.S_IMODE(p.stat().st_mode) == 0o444
    assert os.listdir(tmp_path) == ["a.rvq"]


def test_symlink_is_written_through_to_its_target(tmp_path):
    real_dir = tmp_path / "store"
    real_dir.mkdir()
    target = real_dir / "real.rvq"
    _write(target)
    os.chmod(target, 0o640)
    link = tmp_path / "link.rvq"
    link.symlink_to(target)
    _write(link, seed=5)
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    with F.open_rvq(link) as f, F.open_rvq(target) as g:
        assert f.header.quantizer["rotation"]["seed"] == 5 == g.header.quantizer["rotation"]["seed"]
    # the temporary lived in the target's directory: nothing left beside the link
    assert sorted(os.listdir(tmp_path)) == ["link.rvq", "store"]
    # a dangling link creates its target
    dangling = tmp_path / "d.rvq"
    dangling.symlink_to(real_dir / "new.rvq")
    _write(dangling)
    assert dangling.is_symlink() and (real_dir / "new.rvq").is_file()


def test_symlink_loop_and_non_regular_targets_are_refused(tmp_path):
    a, b = tmp_path / "a.rvq", tmp_path / "b.rvq"
    a.symlink_to(b)
    b.symlink_to(a)
    with pytest.raises(OSError):
        _write(a)
    fifo = tmp_path / "f.rvq"
    os.mkfifo(fifo)
    with pytest.raises(F.errors.NotRegularFileError):
        _write(fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# ---- 12.10 temporaries of killed saves -------------------------------------------------------------
_KILLED_WRITER = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {tests!r})
    import rvqstore.format as F
    from test_format_roundtrip import make_cache
    header, secs, _, _ = make_cache(n_layers=2, T=5)
    def gen():
        for i, s in enumerate(secs):
            if i == 3:
                print("writing", flush=True)
                time.sleep(60)  # parent kills us (or, when it holds us alive, checks the temp stays)
            yield s
    F.write_rvq({path!r}, header, gen())
""")


def _start_writer(path):
    code = _KILLED_WRITER.format(tests=str(ROOT / "tests"), path=str(path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT)
    assert proc.stdout.readline().strip() == b"writing"
    return proc


def _temps(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".tmp"))


def test_stale_temps_of_killed_writers_are_swept_live_ones_kept(tmp_path):
    p = tmp_path / "k.rvq"
    dead = _start_writer(p)
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    live = _start_writer(p)
    try:
        temps = _temps(tmp_path)
        assert len(temps) == 2
        assert {str(dead.pid), str(live.pid)} == {n.split(".")[3] for n in temps}  # pid in the name
        # too young to sweep (a writer between open and flock), whatever its state
        assert sweep_stale_temps(p) == []
        old = time.time() - 3600
        for n in temps:
            os.utime(tmp_path / n, (old, old))
        _write(p)  # a successful save sweeps the unlocked (dead writer's) temp only
        left = _temps(tmp_path)
        assert left == [n for n in temps if n.split(".")[3] == str(live.pid)]
    finally:
        live.kill()
        live.wait()
    # once its writer is dead the last one goes too
    assert [os.path.basename(x) for x in sweep_stale_temps(p)] == left
    assert sorted(os.listdir(tmp_path)) == ["k.rvq"]


# ---- 12.7 FIFOs and other non-regular paths ----------------------------------------------------------
def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.rvq"
    os.mkfifo(fifo)

    def hung(*_):  # a blocking open never returns: turn that into a failure instead of a hung suite
        raise AssertionError("opening a FIFO blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)
    try:
        with pytest.raises(F.errors.NotRegularFileError, match="FIFO"):
            F.open_rvq(fifo)
        with pytest.raises(F.errors.NotRegularFileError):
            rvqstore.load_prompt_cache(fifo)
        with pytest.raises(F.errors.NotRegularFileError, match="directory"):
            F.open_rvq(tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_inspect_refuses_a_fifo(tmp_path):
    fifo = tmp_path / "pipe.rvq"
    os.mkfifo(fifo)
    r = subprocess.run([sys.executable, "-m", "rvqstore", "inspect", str(fifo)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode != 0 and "FIFO" in r.stderr, r.stderr


# ---- 12.5 header decode bounds -------------------------------------------------------------------------
def _file_with_header(obj) -> bytes:
    h = msgpack.packb(obj, use_bin_type=True)
    return pack_preamble(header_offset=64, header_length=len(h), header_checksum=checksum(h),
                         file_length=64 + len(h)) + h


def test_a_16_mib_header_of_empty_arrays_is_refused_cheaply():
    base = dict(format_version=[1, 0], required_features=[], sections=[], n_tokens=0, layers=[],
                quantizer=None, model=None, metadata={})
    # ~16.7 M empty arrays under an unknown key: decoding it whole took ~15 s and 1.2 GB before
    filler = [[[]] * 65535] * 255
    data = _file_with_header(dict(base, junk=filler))
    assert C.MAX_HEADER_LENGTH - 2**16 < len(data) - 64 <= C.MAX_HEADER_LENGTH
    # refused at 2^21 decoded objects (about 1 s; the cost is in tools/results/format-bounds-cpu.txt)
    with pytest.raises(F.LimitExceededError, match="msgpack objects"):
        F.open_rvq(data)
    # one array longer than any the schema allows is refused before it is built
    with pytest.raises(F.LimitExceededError, match="longer than 65536"):
        decode_header(msgpack.packb({"a": [0] * 65537}))
    # an unknown key of moderate size still opens (unknown keys are ignored)
    with F.open_rvq(_file_with_header(dict(base, junk=[[]] * 1000))) as f:
        assert f.layers == ()


# ---- 12.6 decoded-size amplification ---------------------------------------------------------------------
def test_decoded_size_limit_on_a_highly_amplifying_file(tmp_path, monkeypatch):
    """The 1-bit dim-32768 float32 case of the issue, scaled down: 1-bit codes at dim 4096 decode to
    float32 at ~32x, zstd stores the (constant) codes and scales at up to 32x."""
    import mlx.core as mx

    from rvqstore import RVQCodec

    D, T = 4096, 64
    codec = RVQCodec(D, (1, 0), use_kernels=False)
    x = mx.ones((1, 1, T, D), dtype=mx.float32)
    e = codec.encode(x)
    secs = []
    for side in ("keys", "values"):
        secs += [F.Section(f"layers.0.{side}.codes1", 0, f"{side}.codes1", e.codes1),
                 F.Section(f"layers.0.{side}.scales", 0, f"{side}.scales", e.scales)]
    header = dict(n_tokens=T, quantizer=codec.to_header(), model=None, metadata={},
                  layers=[dict(index=0, kind="rvq", batch=1, n_kv_heads=1, head_dim=D, n_tokens=T,
                               n_dense_tokens=0, key_dtype="float32", value_dtype="float32")])
    p = tmp_path / "amp.rvq"
    F.write_rvq(p, header, secs, compress="zstd")
    size = p.stat().st_size
    with F.open_rvq(p) as f:
        n = f.decoded_nbytes()
        assert n == 2 * T * D * 4
        assert n > 10 * size  # far beyond the file size: the old "32x the file" bound was wrong
        assert f.check_decoded_size() == n  # under the default limit
        with pytest.raises(F.LimitExceededError, match="RVQSTORE_MAX_DECODED_BYTES"):
            f.check_decoded_size(n - 1)
        monkeypatch.setenv("RVQSTORE_MAX_DECODED_BYTES", str(n - 1))
        with pytest.raises(F.LimitExceededError):
            f.check_decoded_size()
        monkeypatch.setenv("RVQSTORE_MAX_DECODED_BYTES", "lots")
        with pytest.raises(ValueError, match="RVQSTORE_MAX_DECODED_BYTES"):
            f.check_decoded_size()
        monkeypatch.delenv("RVQSTORE_MAX_DECODED_BYTES")
        # verify decodes in bounded chunks over all axes (here 1 vector per chunk of 16 KiB)
        from rvqstore.format.quantizer import decode_layers

        assert decode_layers(f, chunk_bytes=4 * D) == 2 * T


# ---- 12.11 every byte a load relies on ---------------------------------------------------------------
def _saved(tmp_path):
    import mlx.core as mx

    c = rvqstore.RVQKVCache(bits=(2, 2))
    k = mx.random.normal((1, 2, 6, 64), key=mx.random.key(0)).astype(mx.float16)
    c.update_and_fetch(k, k)
    p = tmp_path / "s.rvq"
    rvqstore.save_prompt_cache(p, [c], tokens=list(range(10, 16)), compress="none")
    return p


def test_flipped_token_bits_fail_the_load(tmp_path):
    p = _saved(tmp_path)
    rvqstore.load_prompt_cache(p)
    with F.open_rvq(p) as f:
        tok = f.section("tokens")
    data = bytearray(p.read_bytes())
    data[tok.offset + 5] ^= 0x10
    p.write_bytes(bytes(data))
    with pytest.raises(F.ChecksumMismatchError, match="tokens"):
        rvqstore.load_prompt_cache(p)
    with pytest.raises(F.ChecksumMismatchError, match="tokens"):
        rvqstore.resume(p, list(range(10, 20)))


def test_flipped_padding_before_the_header_fails_the_open(tmp_path):
    p = _saved(tmp_path)
    with F.open_rvq(p) as f:
        last = f.sections[-1]
        end, h_off = last.offset + last.length, f.header.header_offset
    assert h_off > end, "the test needs padding before the header"
    data = bytearray(p.read_bytes())
    data[h_off - 1] = 0x01
    p.write_bytes(bytes(data))
    with pytest.raises(F.LayoutError, match="before the header"):
        F.open_rvq(p)


def test_load_refuses_what_it_would_decode_past_the_limit(tmp_path):
    p = _saved(tmp_path)
    with pytest.raises(F.LimitExceededError):
        rvqstore.load_prompt_cache(p, max_decoded_bytes=100)
    assert len(rvqstore.load_prompt_cache(p, max_decoded_bytes=10**6)) == 1


# ---- range sources ------------------------------------------------------------------------------------------
class _CountingSource:
    def __init__(self, data: bytes):
        self.data, self.size, self.calls = data, len(data), []
        self.name = "mem://c.rvq"

    def read(self, offset, length):
        self.calls.append((offset, length))
        return self.data[offset: offset + length]


def test_open_through_a_range_source_reads_lazily(tmp_path):
    p = tmp_path / "r.rvq"
    _write(p)
    src = _CountingSource(p.read_bytes())
    with F.open_rvq(src) as f:
        assert len(src.calls) == 2  # preamble; header with the padding before it
        assert f.path == "mem://c.rvq"
        name = f.layers[0].sections["keys.codes1"]
        a = f.read_section(name)
        s = f.section(name)
        assert (s.offset, s.length) in src.calls
        with F.open_rvq(p) as g:
            np.testing.assert_array_equal(a, g.read_section(name))
        f.verify()
    # a damaged byte read through the source is caught by the section checksum
    bad = bytearray(src.data)
    bad[s.offset] ^= 1
    with F.open_rvq(_CountingSource(bytes(bad))) as f:
        with pytest.raises(F.ChecksumMismatchError, match="mem://c.rvq"):
            f.read_section(name)
    # a source that returns short reads is a truncated file, not garbage
    short = _CountingSource(src.data)
    short.read = lambda o, n: src.data[o: o + n][: max(0, n - 1)] if o > 64 and n > 100 else src.data[o: o + n]
    with pytest.raises(F.TruncatedFileError):
        F.open_rvq(short)
    with pytest.raises(TypeError, match="range source"):
        F.open_rvq(12)
