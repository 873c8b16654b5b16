"""rvqstore.kernel_ref and the launches by reference in rvqstore.kernel_cache, on any machine.

MLX's own side (that it finds the published module and runs the same code) needs a CUDA device:
tests/test_kernel_cache_gpu.py. Here: the module name MLX would compute (checked against libstdc++'s own
hash), the files published and where, what is refused, and which source each launch hands MLX (its
precompiled launch is a recorder) as first launches succeed or fail.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import stat

import mlx.core as mx
import pytest

from rvqstore import kernel_cache as kc, kernel_ref as kr

BINARY = b"\x7fELF stand-in cubin " + bytes(range(256)) * 8


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    kr.reset()
    monkeypatch.delenv(kr.ENV, raising=False)
    yield
    kr.reset()


@pytest.fixture
def mlx_dir(tmp_path, monkeypatch):
    d = tmp_path / "mlx-ptx"
    monkeypatch.setattr(kr, "mlx_cache_dir", lambda: d)
    return d


def _libstdcxx_hash():
    name = ctypes.util.find_library("stdc++") or "libstdc++.so.6"
    try:
        f = ctypes.CDLL(name)._ZSt11_Hash_bytesPKvmm
    except (OSError, AttributeError):
        pytest.skip("no libstdc++ to compare with")
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    return lambda b: f(b, len(b), 0xC70F6907)


def test_the_hash_is_libstdcxx_s_std_hash_of_a_string():
    ref = _libstdcxx_hash()
    rng = __import__("random").Random(0)
    for n in list(range(0, 33)) + [255, 1000, 32771]:
        data = bytes(rng.randrange(256) for _ in range(n))
        assert kr.std_hash(data) == ref(data), n
    assert kr.module_name("rvq_f", "rvqstore-kernel:ab") == f"rvq_f_{ref(b'rvqstore-kernel:ab'):x}"


def test_where_mlx_looks(monkeypatch, tmp_path):
    monkeypatch.setattr(kr, "mlx_cache_dir", kr.mlx_cache_dir)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "x"))
    assert kr.mlx_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(v, raising=False)
    assert str(kr.mlx_cache_dir()) == f"/tmp/mlx/{mx.__version__}/ptx"
    monkeypatch.setenv("TEMP", str(tmp_path / "t2"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "t1"))  # C++'s order: TMPDIR first
    assert kr.mlx_cache_dir() == tmp_path / "t1" / "mlx" / mx.__version__ / "ptx"


def test_publish_writes_the_module_mlx_would_look_for(mlx_dir):
    ref = kr.publish("rvq_k", BINARY)
    assert isinstance(ref, bytes) and len(ref) < 100 and ref.startswith(b"rvqstore-kernel:")
    base = mlx_dir / kr.module_name("rvq_k", ref)
    assert base.with_suffix(".ptx").read_bytes() == BINARY
    assert base.with_suffix(".txt").read_bytes() == b"rvq_k\trvq_k\n"
    assert sorted(p.name for p in mlx_dir.iterdir()) == sorted([base.name + ".ptx", base.name + ".txt"])
    assert kr.publish("rvq_k", BINARY) == ref  # once per process
    other = kr.publish("rvq_k", BINARY + b"!")
    assert other != ref and (mlx_dir / (kr.module_name("rvq_k", other) + ".ptx")).read_bytes() == BINARY + b"!"


def test_a_stale_or_tampered_module_file_is_replaced(mlx_dir):
    ref = kr.publish("rvq_k", BINARY)
    ptx = mlx_dir / (kr.module_name("rvq_k", ref) + ".ptx")
    ptx.write_bytes(b"someone else's code")
    kr.reset()
    assert kr.publish("rvq_k", BINARY) == ref and ptx.read_bytes() == BINARY


def test_no_reference_into_a_shared_or_foreign_directory(mlx_dir, tmp_path, monkeypatch):
    mlx_dir.mkdir(parents=True)
    os.chmod(mlx_dir, 0o777)
    assert kr.publish("rvq_k", BINARY) is None and not list(mlx_dir.iterdir())
    os.chmod(mlx_dir, 0o755)
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    monkeypatch.setattr(kr, "mlx_cache_dir", lambda: link)
    assert kr.publish("rvq_k", BINARY) is None and not list(real.iterdir())
    uid = os.getuid()
    monkeypatch.setattr(kr.os, "getuid", lambda: uid + 1)  # as if another user made it
    monkeypatch.setattr(kr, "mlx_cache_dir", lambda: mlx_dir)
    assert kr.publish("rvq_k", BINARY) is None


def test_a_group_writable_directory_is_private_only_with_the_user_s_own_group(mlx_dir, monkeypatch):
    mlx_dir.mkdir(parents=True)
    os.chmod(mlx_dir, 0o775)  # what a umask of 002 makes
    monkeypatch.setattr(kr, "_private_group", lambda gid: False)
    assert kr.publish("rvq_k", BINARY) is None
    monkeypatch.setattr(kr, "_private_group", lambda gid: gid == os.stat(mlx_dir).st_gid)
    assert kr.publish("rvq_k", BINARY) is not None


def test_a_folder_above_that_others_can_write_refuses_unless_sticky(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    d = shared / "mlx" / "ptx"
    d.mkdir(parents=True)
    monkeypatch.setattr(kr, "mlx_cache_dir", lambda: d)
    os.chmod(shared, 0o777)  # anyone could rename mlx/ and put their own in its place
    assert kr.publish("rvq_k", BINARY) is None
    os.chmod(shared, 0o1777)  # as /tmp: sticky, others cannot rename what is ours
    assert kr.publish("rvq_k", BINARY) is not None
    os.chmod(shared, 0o755)


def test_the_user_private_group_convention(monkeypatch):
    import grp
    import pwd

    user = pwd.getpwuid(os.getuid())
    own = type("G", (), {"gr_name": user.pw_name, "gr_mem": []})()
    shared = type("G", (), {"gr_name": user.pw_name, "gr_mem": ["someone"]})()
    other = type("G", (), {"gr_name": "staff", "gr_mem": []})()
    for group, want in ((own, True), (shared, False), (other, False)):
        monkeypatch.setattr(grp, "getgrgid", lambda gid, g=group: g)
        assert kr._private_group(user.pw_gid) is want
    assert kr._private_group(user.pw_gid + 12345) is False  # not the user's primary group


def test_no_reference_when_switched_off_or_unwritable(mlx_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(kr.ENV, "0")
    assert kr.publish("rvq_k", BINARY) is None and not mlx_dir.exists()
    monkeypatch.setenv(kr.ENV, "1")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setattr(kr, "mlx_cache_dir", lambda: blocker / "ptx")
    assert kr.publish("rvq_k", BINARY) is None


def test_after_giving_up_nothing_is_published(mlx_dir):
    kr.give_up("test")
    assert not kr.enabled() and kr.publish("rvq_k", BINARY) is None


# ---- which source the launches hand MLX -----------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch, mlx_dir):
    monkeypatch.setenv(kc.ENV, str(tmp_path / "kc"))
    monkeypatch.setattr(kc, "device", lambda: {"name": "Stand-in GPU", "cc": (9, 0)})
    monkeypatch.setattr(kc, "compile_setup", lambda: (["--gpu-architecture=sm_90a"], "sm_90a nvrtc 13.0"))
    monkeypatch.setattr(kc, "compile_source", lambda source, options, name="k.cu": (
        b"\x7fELF cubin " + kc.hashlib.sha256(source.encode()).digest(), ""))
    monkeypatch.setattr(kc, "stats", dict.fromkeys(kc.stats, 0))


class _MLX:
    """MLX's precompiled launch and evaluation, recorded; ``fail`` says which sources do not load."""

    def __init__(self, monkeypatch, fail=lambda source: False, tracing=False, reject=lambda source: False):
        self.sources, self.evals, self.jit = [], 0, 0
        self.fail, self.tracing = fail, tracing

        def precompiled(**kw):
            source = kw["compiled_source"]
            if not isinstance(source, bytes) or reject(source):  # MLX's binding takes bytes only
                raise TypeError("precompiled_cuda_kernel(): incompatible function arguments")
            self.sources.append(source)
            return [mx.array([float(len(self.sources))])]

        def evaluate(*arrays):
            self.evals += 1
            if self.tracing:
                raise ValueError("[eval] Attempting to eval an array during function transformations")
            if self.fail(self.sources[-1]):
                raise RuntimeError("Failed to load compiled rvq_k kernel: bad image")

        monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
        monkeypatch.setattr(kc.mx, "eval", evaluate)
        monkeypatch.setattr(kc.CudaKernel, "jit", lambda k, shared_memory=0: (lambda **kw: setattr(self, "jit", self.jit + 1) or [0]))


def _kernel(name="test_k"):
    return kc.cuda_kernel(name, ["x"], ["out"], "  out[0] = x[0];\n")


def _call(k):
    return k(inputs=[mx.array([1.0])], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
             threadgroup=(32, 1, 1))


def _binary(k) -> bytes:
    return next(iter(k._entries.values()))[1]


def test_checked_configurations_launch_by_reference(cache, monkeypatch):
    m = _MLX(monkeypatch)
    k = _kernel()
    for _ in range(3):
        _call(k)
    ref = m.sources[0]
    assert ref.startswith(b"rvqstore-kernel:") and ref != _binary(k) and m.sources == [ref] * 3
    assert m.evals == 1 and kc.stats["by_reference"] == 1 and not m.jit
    run = k.prepare([], (mx.float32,), [mx.float32])
    run([mx.array([1.0])], [(1,)], (32, 1, 1), (32, 1, 1))
    run([mx.array([1.0])], [(1,)], (32, 1, 1), (32, 1, 1))
    assert m.sources[3:] == [ref, ref] and m.evals == 1
    monkeypatch.setattr(kr, "BY_REFERENCE", False)  # the benchmarks' "binary" variant
    _call(k)
    run([mx.array([1.0])], [(1,)], (32, 1, 1), (32, 1, 1))
    assert m.sources[5:] == [_binary(k)] * 2


def test_a_reference_mlx_does_not_find_gives_way_to_binaries_for_the_process(cache, monkeypatch):
    m = _MLX(monkeypatch, fail=lambda source: source.startswith(b"rvqstore-kernel:"))
    k = _kernel()
    out = _call(k)
    binary = _binary(k)
    assert len(m.sources) == 2 and m.sources[0].startswith(b"rvqstore-kernel:") and m.sources[1] == binary
    assert out[0].item() == 2.0  # what the binary's launch gave
    _call(k)
    assert m.sources[2] == binary and not kr.enabled() and kc.stats["by_reference"] == 0 and not m.jit
    k2 = _kernel("test_k2")
    _call(k2)  # another kernel: straight to its binary, nothing published
    assert m.sources[3] == _binary(k2) and len(m.sources) == 4


def test_a_reference_mlx_refuses_at_the_launch_gives_way_too(cache, monkeypatch):
    m = _MLX(monkeypatch, reject=lambda source: source.startswith(b"rvqstore-kernel:"))
    k = _kernel()
    _call(k)
    _call(k)
    assert m.sources == [_binary(k)] * 2 and not m.jit and not kr.enabled()


def test_a_launch_failing_either_way_goes_to_mlx_s_jit_and_keeps_references_on(cache, monkeypatch):
    m = _MLX(monkeypatch, fail=lambda source: True)
    k = _kernel()
    _call(k)
    assert len(m.sources) == 2 and m.jit == 1 and kr.enabled()  # not the reference's fault
    _call(k)
    assert len(m.sources) == 2 and m.jit == 2


def test_inside_a_transformation_the_binary_goes_back_unchecked(cache, monkeypatch):
    m = _MLX(monkeypatch, tracing=True)
    k = _kernel()
    out = _call(k)
    assert len(m.sources) == 2 and m.sources[1] == _binary(k) and out[0].item() == 2.0
    assert kr.enabled() and not k._checked
    m.tracing = False
    _call(k)  # outside: checked now, by reference
    assert m.sources[2].startswith(b"rvqstore-kernel:") and kc.stats["by_reference"] == 1


def test_shared_directory_means_binaries_from_the_start(cache, monkeypatch, mlx_dir):
    mlx_dir.mkdir(parents=True)
    os.chmod(mlx_dir, stat.S_IRWXU | stat.S_IRWXG | stat.S_IRWXO)
    m = _MLX(monkeypatch)
    k = _kernel()
    _call(k)
    _call(k)
    assert m.sources == [_binary(k)] * 2 and m.evals == 1


def test_glibc_is_tuned_only_where_binaries_launch(cache, monkeypatch):
    from rvqstore import host_malloc

    tuned = []
    monkeypatch.setattr(host_malloc, "tune", lambda: tuned.append(1) or True)
    _MLX(monkeypatch)
    _call(_kernel())
    assert not tuned  # by reference: each node copies ~90 bytes, the heap is left alone
    _MLX(monkeypatch, fail=lambda source: source.startswith(b"rvqstore-kernel:"))
    _call(_kernel("test_k2"))
    assert tuned == [1]
