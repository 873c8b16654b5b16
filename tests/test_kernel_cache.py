"""rvqstore.kernel_cache on any machine: the translation unit, the cache files, the fallback, the verdicts.

What needs a CUDA device (launching the cached binaries, parity with MLX's JIT, a second process
compiling nothing) is in tests/test_kernel_cache_gpu.py; NVRTC itself is exercised here where the
library is installed (it compiles without a GPU).
"""

from __future__ import annotations

import logging
import threading

import mlx.core as mx
import pytest

from rvqstore import first_use, fused, kernel_cache as kc, kernel_ref

FAKE_DEVICE = {"name": "Stand-in GPU", "cc": (9, 0)}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(kc.ENV, str(tmp_path))
    monkeypatch.setenv(kernel_ref.ENV, "0")  # launches by reference: tests/test_kernel_ref.py
    monkeypatch.setattr(kc, "device", lambda: FAKE_DEVICE)
    monkeypatch.setattr(kc, "compile_setup", lambda: (["--gpu-architecture=sm_90a"], "sm_90a nvrtc 13.0"))
    compiled = []

    def fake_compile(source, options, name="k.cu"):
        compiled.append(source)
        return b"\x7fELF fake cubin " + kc.hashlib.sha256(source.encode()).digest(), ""

    monkeypatch.setattr(kc, "compile_source", fake_compile)
    return tmp_path / mx.__version__, compiled


def _kernel(source="  out[0] = x[0] * 2.0f;\n", inputs=("x",)):
    return kc.cuda_kernel("test_k", list(inputs), ["out"], source, header="#define TWO 2\n")


# ---- the translation unit ------------------------------------------------------------------------------
def test_translation_unit_wraps_the_body_as_mlx_does():
    tu = kc.translation_unit("f", "#define H 1\n", "  out[0] = q[0];", [("q", "__half"), ("p", "uint32_t")],
                             [("out", "float")], [("T_B1", 2), ("T_ON", True), ("InT", mx.bfloat16)])
    assert tu.index("#include <cuda_fp16.h>") < tu.index("#define H 1") < tu.index("namespace mlx::core::cu {")
    assert 'extern "C" __global__ void f(\n    const __half* q,\n    const uint32_t* p,\n    float* out) {' in tu
    assert "  constexpr int T_B1 = 2;\n  constexpr bool T_ON = true;\n  using InT = __nv_bfloat16;\n" in tu
    assert tu.rstrip().endswith("} // namespace mlx::core::cu")
    # fused.cuda_translation_unit (offline compile checks) is the same wrapping with C++ linkage
    tu2 = fused.cuda_translation_unit("encode", True, [("T_B1", 2)], "// stub\n", name="k0")
    assert "__global__ void k0(\n    const float* y," in tu2 and 'extern "C"' not in tu2


def test_configurations_differ_by_template_and_dtypes():
    k = _kernel()
    a = k.source_for([("T", 1)], (mx.float32,), (mx.float32,))
    b = k.source_for([("T", 2)], (mx.float32,), (mx.float32,))
    c = k.source_for([("T", 1)], (mx.float16,), (mx.float32,))
    assert len({a[0], b[0], c[0]}) == 3 and "const __half* x" in c[1] and "constexpr int T = 2;" in b[1]
    with pytest.raises(TypeError):
        kc.cuda_type(mx.complex64)


# ---- cache files -----------------------------------------------------------------------------------------
def test_binaries_are_compiled_once_then_read_from_disk(cache):
    d, compiled = cache
    src = kc.translation_unit("f", "", "", [], [("out", "float")], [])
    sym, binary, key = kc.get_binary(src, "f")
    assert (sym, len(compiled)) == ("f", 1) and (d / f"{key}.bin").is_file()
    assert kc.get_binary(src, "f") == (sym, binary, key) and len(compiled) == 1
    assert not [p for p in d.iterdir() if p.suffix == ".tmp"]  # written atomically: nothing half-written left


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "empty", "foreign", "name"])
def test_a_damaged_or_foreign_file_is_ignored_and_rebuilt(cache, damage):
    d, compiled = cache
    src = kc.translation_unit("f", "", "", [], [("out", "float")], [])
    _, binary, key = kc.get_binary(src, "f")
    path = d / f"{key}.bin"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x40
    elif damage == "truncate":
        data = data[:-5]
    elif damage == "magic":
        data[:4] = b"\x7fELF"
    elif damage == "empty":
        data = b""
    elif damage == "foreign":  # another key's valid file under this name
        data = kc._pack("0" * 64, "f", binary)
    else:  # a symbol that is not an identifier
        data = kc._pack(key, "f; rm -rf", binary)
    path.write_bytes(bytes(data))
    assert kc.read_binary(key) is None
    assert kc.get_binary(src, "f") == ("f", binary, key) and len(compiled) == 2
    assert kc.read_binary(key) == ("f", binary)


def test_an_oversized_file_is_not_read(cache, monkeypatch):
    d, _ = cache
    d.mkdir(parents=True)
    (d / f"{'a' * 64}.bin").write_bytes(b"x" * 100)
    monkeypatch.setattr(kc, "MAX_BINARY_BYTES", 50)
    assert kc.read_binary("a" * 64) is None


def test_an_unwritable_cache_still_gives_the_binary(cache, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(kc.ENV, str(blocker))
    _, compiled = cache
    assert kc.get_binary("src", "f")[0] == "f" and len(compiled) == 1


def test_cache_off_and_default_location(monkeypatch):
    monkeypatch.setenv(kc.ENV, "off")
    assert kc.cache_dir() is None and kc.read_binary("a" * 64) is None
    assert kc.verdict_key("x", (1,), ("b",)) is None
    monkeypatch.delenv(kc.ENV)
    d = kc.cache_dir()
    assert d.parts[-4:] == (".cache", "rvqstore", "kernels", mx.__version__)


# ---- launches: precompiled, or MLX's JIT when anything fails -----------------------------------------
class _Launches:
    def __init__(self, monkeypatch, fail_precompiled=False):
        self.pre, self.jit = [], []
        out = [mx.array([2.0])]

        def precompiled(**kw):
            self.pre.append(kw)
            if fail_precompiled:
                raise RuntimeError("Failed to load compiled kernel")
            return out

        monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
        self.jit_shared = []  # the dynamic shared memory each JIT kernel was made with

        def jit(k, shared_memory=0):
            self.jit_shared.append(shared_memory)
            return lambda **kw: self.jit.append(kw) or out

        monkeypatch.setattr(kc.CudaKernel, "jit", jit)


def _call(k, dtype=mx.float32, template=(("T", 1),)):
    return k(inputs=[mx.array([1.0], dtype=dtype)], output_shapes=[(1,)], output_dtypes=[mx.float32],
             grid=(32, 1, 1), threadgroup=(32, 1, 1), template=list(template))


def test_a_cached_binary_is_launched_with_mlx_s_argument_convention(cache, monkeypatch):
    d, compiled = cache
    calls = _Launches(monkeypatch)
    k = _kernel()
    kc.begin_launch_log()
    _call(k)
    _call(k)
    assert len(compiled) == 1 and len(calls.pre) == 2 and not calls.jit and k.precompiled() == 1
    kw = calls.pre[0]
    sym, tu = k.source_for([("T", 1)], (mx.float32,), (mx.float32,))
    assert kw["name"] == sym and kw["compiled_source"] == kc.read_binary(kc.binary_key(tu, "sm_90a nvrtc 13.0"))[1]
    assert kw["scalars"] == [] and kw["ensure_row_contiguous"] is True and kw["grid"] == (32, 1, 1)
    assert len(kc.launched_binaries()) == 1
    _call(k)
    assert kc.launched_binaries() == ()  # the log ended: later launches are not noted
    _call(k, dtype=mx.float16)  # another configuration: another translation unit
    assert len(compiled) == 2 and "const __half* x" in compiled[1]


def test_a_prepared_launch_goes_straight_to_the_binary_after_its_first_launch(cache, monkeypatch):
    calls = _Launches(monkeypatch)
    k = _kernel()
    run = k.prepare([("T", 1)], (mx.float32,), [mx.float32])
    args = ([mx.array([1.0])], [(1,)], (32, 1, 1), (32, 1, 1))
    checked = []
    monkeypatch.setattr(kc.mx, "eval", lambda *a: checked.append(a))
    run(*args)  # the first goes through the kernel: built, loaded, evaluated once
    assert len(calls.pre) == 1 and len(checked) == 1 and run._entry is not None
    kc.begin_launch_log()
    run(*args)
    run(*args)
    assert len(calls.pre) == 3 and len(checked) == 1  # directly, and no second evaluation
    assert calls.pre[2] == {**calls.pre[0], "inputs": args[0]} and len(kc.launched_binaries()) == 1
    assert k(inputs=args[0], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
             threadgroup=(32, 1, 1), template=[("T", 1)]) is not None and len(calls.pre) == 4  # the same binary


def test_a_prepared_launch_that_fails_goes_back_to_the_kernel_s_own_path(cache, monkeypatch):
    calls = _Launches(monkeypatch)
    k = _kernel()
    run = k.prepare([("T", 1)], (mx.float32,), [mx.float32])
    args = ([mx.array([1.0])], [(1,)], (32, 1, 1), (32, 1, 1))
    run(*args)
    failing = _Launches(monkeypatch, fail_precompiled=True)
    out = run(*args)  # direct launch fails, then the kernel's path (fails again) falls back to MLX's JIT
    assert out is not None and len(failing.pre) == 2 and len(failing.jit) == 1 and run._entry is None
    run(*args)
    assert len(failing.pre) == 2 and len(failing.jit) == 2 and len(calls.pre) == 1


def test_a_launch_s_dynamic_shared_memory_reaches_every_path(cache, monkeypatch):
    """A prepared launch's ``shared_memory`` (the tensor-core kernel's 64 KB table, kernel_mma.dynamic_shared_bytes)
    goes with its precompiled launches, the first (through the kernel) and the direct ones, and to the JIT kernel
    where the binary cannot serve; other launches ask for none."""
    calls = _Launches(monkeypatch)
    monkeypatch.setattr(kc.mx, "eval", lambda *a: None)
    run = _kernel().prepare([("T", 1)], (mx.float32,), [mx.float32], shared_memory=65536)
    for _ in range(3):
        run([mx.array([1.0])], [(1,)], (32, 1, 1), (32, 1, 1))
    assert len(calls.pre) == 3 and all(kw["shared_memory"] == 65536 for kw in calls.pre)
    _call(_kernel(), template=(("T", 2),))
    assert calls.pre[-1]["shared_memory"] == 0
    monkeypatch.setenv(kc.ENV, "off")
    off = _kernel().prepare([("T", 3)], (mx.float32,), [mx.float32], shared_memory=65536)
    off([mx.array([1.0])], [(1,)], (32, 1, 1), (32, 1, 1))
    assert calls.jit_shared[-1] == 65536 and len(calls.jit) == 1


def test_cache_off_prepared_launches_use_the_jit_kernel(cache, monkeypatch):
    monkeypatch.setenv(kc.ENV, "off")
    calls = _Launches(monkeypatch)
    run = _kernel().prepare([("T", 1)], (mx.float32,), [mx.float32])
    for _ in range(2):
        run([mx.array([1.0])], [(1,)], (32, 1, 1), (32, 1, 1))
    assert not calls.pre and len(calls.jit) == 2 and calls.jit[1]["template"] == [("T", 1)]


def test_compile_failure_falls_back_to_mlx_s_jit_once(cache, monkeypatch, caplog):
    _, compiled = cache
    calls = _Launches(monkeypatch)

    def broken(*a, **kw):
        raise kc.NvrtcError("NVRTC not found")

    monkeypatch.setattr(kc, "compile_source", broken)
    k = _kernel()
    with caplog.at_level(logging.INFO, logger="rvqstore.kernels"):
        _call(k)
        _call(k)
    assert not calls.pre and len(calls.jit) == 2 and k.precompiled() == 0
    assert sum("compiled by MLX instead" in r.getMessage() for r in caplog.records) == 1
    assert calls.jit[0]["template"] == [("T", 1)] and calls.jit[0]["grid"] == (32, 1, 1)


def test_a_binary_that_fails_to_launch_is_replaced_by_the_jit_kernel(cache, monkeypatch):
    calls = _Launches(monkeypatch, fail_precompiled=True)
    k = _kernel()
    kc.begin_launch_log()
    out = _call(k)
    assert float(out[0][0].item()) == 2.0 and len(calls.pre) == 1 and len(calls.jit) == 1
    _call(k)
    assert len(calls.pre) == 1 and len(calls.jit) == 2 and kc.launched_binaries() == ()


def test_bodies_that_read_shapes_go_to_the_jit_kernel(cache, monkeypatch):
    calls = _Launches(monkeypatch)
    k = _kernel("  out[0] = x[0] * x_shape[0];\n")
    _call(k)
    assert not calls.pre and len(calls.jit) == 1 and not cache[1]


def test_cache_off_uses_the_jit_kernel(cache, monkeypatch):
    monkeypatch.setenv(kc.ENV, "off")
    calls = _Launches(monkeypatch)
    _call(_kernel())
    assert not calls.pre and len(calls.jit) == 1 and not cache[1]


# ---- first-use verdicts -----------------------------------------------------------------------------------
def test_verdict_files(cache):
    key = kc.verdict_key("append", (128, 2, 2, "float16"), ("b1",))
    assert key and kc.verdict(key) is None
    assert key != kc.verdict_key("append", (128, 2, 2, "float16"), ("b2",))  # other binaries, other verdict
    kc.record_verdict(key, True)
    assert kc.verdict(key) is True
    kc.record_verdict(key, False, "differs")
    assert kc.verdict(key) == "differs"
    kc.record_verdict(key, True)  # a failed check stays failed
    assert kc.verdict(key) == "differs"
    path = cache[0] / f"{key}.verdict"
    path.write_text('{"key": "other", "ok": true}')
    assert kc.verdict(key) is None
    path.write_bytes(b"\xff\x00 not json")
    assert kc.verdict(key) is None


def _serve(state, launch, check):
    return first_use.serve("cfg", launch, check, verified=state[0], disabled=state[1], lock=threading.Lock(),
                           what="test kernel")


def test_a_later_process_skips_the_check_of_the_same_binaries(cache, monkeypatch):
    _Launches(monkeypatch)
    k = _kernel()
    checks = []

    def check(out):
        checks.append(out)
        return None

    assert _serve((set(), {}), lambda: _call(k), check) is not None and len(checks) == 1
    fresh = (set(), {})  # another process: nothing verified in memory
    assert _serve(fresh, lambda: _call(k), check) is not None and len(checks) == 1 and fresh[0] == {"cfg"}
    # a stand-in launch (no cached binary) keeps no verdict: it is checked every time
    assert _serve((set(), {}), lambda: [mx.array([2.0])], check) is not None and len(checks) == 2
    assert _serve((set(), {}), lambda: [mx.array([2.0])], check) is not None and len(checks) == 3


def test_a_failed_check_stays_failed_on_this_machine(cache, monkeypatch):
    calls = _Launches(monkeypatch)
    k = _kernel()
    first = (set(), {})
    assert _serve(first, lambda: _call(k), lambda out: "differs") is None and "differs" in first[1]["cfg"]
    later, checks = (set(), {}), []
    assert _serve(later, lambda: _call(k), lambda out: checks.append(1)) is None
    assert not checks and "failed on this machine before: differs" in later[1]["cfg"] and len(calls.pre) == 2


def test_fused_run_keeps_only_real_disagreements(cache, monkeypatch):
    from rvqstore import kernel_checks

    _Launches(monkeypatch)
    k = _kernel()
    fused.reset()
    try:
        def broken_check():
            raise ValueError("reference path failed to build")

        assert fused._run(None, ("encode", 8, 2, 2, "x"), "cuda", lambda: _call(k), broken_check) is None
        fused.reset()  # an error on the way is not kept: checked again
        seen = []
        assert fused._run(None, ("encode", 8, 2, 2, "x"), "cuda", lambda: _call(k), lambda: seen.append(1)) is not None
        assert seen == [1]
        fused.reset()  # passed: kept, not checked again
        assert fused._run(None, ("encode", 8, 2, 2, "x"), "cuda", lambda: _call(k), lambda: seen.append(1)) is not None
        assert seen == [1]

        def disagrees():
            raise kernel_checks.CheckFailed("encode kernel disagrees")

        fused.reset()
        assert fused._run(None, ("decode", 8, 2, 2, "x"), "cuda", lambda: _call(k, template=(("T", 3),)),
                          disagrees) is None
        fused.reset()
        assert fused._run(None, ("decode", 8, 2, 2, "x"), "cuda", lambda: _call(k, template=(("T", 3),)),
                          lambda: seen.append(2)) is None and seen == [1]
    finally:
        fused.reset()


# ---- NVRTC, where installed (it compiles without a GPU) ---------------------------------------------------
def test_nvrtc_compiles_a_kernel_to_ptx_where_installed():
    try:
        kc.nvrtc_library()
        inc = kc.include_dirs()
    except kc.NvrtcError as err:
        pytest.skip(f"no NVRTC / CUDA headers on this machine: {err}")
    header, body = fused.kernel_sources("decode", "cuda", True)
    k = kc.cuda_kernel("dec", ["codes1", "codes2", "tab", "params"], ["out"], body, header)
    plan_t = [("T_B1", 2), ("T_B2", 2), ("T_MODE", 1), ("T_LAYOUT", 1), ("T_VL", 4), ("T_C", 16), ("T_TABN", 16)]
    sym, tu = k.source_for(plan_t, (mx.uint32, mx.uint32, mx.float32, mx.uint32), (mx.float32,))
    ptx, _ = kc.compile_source(tu, ["--gpu-architecture=compute_90a", f"--include-path={inc[0]}"])
    assert f".entry {sym}(" in ptx.decode()
    with pytest.raises(kc.NvrtcError, match="could not compile"):
        kc.compile_source(tu + "\nthis is not C++", ["--gpu-architecture=compute_90a", f"--include-path={inc[0]}"])
