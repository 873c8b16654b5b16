"""Fused GPU kernels (rvqstore.fused, kernels/): dispatch, fallback, sources, and GPU parity.

CPU-side tests run everywhere: the sources load and are packaged, the generated Metal body names the
thread attributes MLX scans for, the CUDA translation unit compiles with a local nvcc, a NumPy model
of the kernels' algorithm (search, table layout, chunked packing) reproduces the reference bit for
bit, and the dispatch falls back / latches off / logs once. Tests marked ``gpu`` run the kernels for
real (Metal or MLX's CUDA backend) and compare them with the reference path on the same device.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQCodec, fused
from rvqstore.packing import pack_codes

ROOT = Path(__file__).resolve().parents[1]

DIMS = (64, 80, 96, 128, 256)
BITS2 = [(b1, b2) for b1 in range(1, 5) for b2 in range(1, 5)]
CONFIGS = ([(b, r) for b in BITS2 for r in ("conditional", "shared")]
           + [((b1, 0), "conditional") for b1 in range(1, 5)])
CONFIG_IDS = [f"{b[0]}{b[1]}-{r[:4] if b[1] else 'single'}" for b, r in CONFIGS]


def _codec(dim, bits, residual, use_kernels=True, seed=5):
    return RVQCodec(dim, bits, seed=seed, residual=residual, use_kernels=use_kernels)


def _same(a, b) -> bool:
    return fused._same(a, b)


@pytest.fixture(autouse=True)
def _fresh_latches():
    fused.reset()
    yield
    fused.reset()


# ---- sources and packaging ---------------------------------------------------------------------------
def test_sources_load_and_are_packaged():
    import tomllib

    for name in fused._kernels_module().SOURCES:
        assert fused.load_source(name).strip()
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "rvqstore.kernels"]
    files = [p.name for p in (ROOT / "kernels").iterdir() if p.is_file() and p.suffix != ".py"
             and not p.name.startswith(".")]
    assert files
    for f in files:  # every kernel source ships in the wheel
        assert any(Path(f).match(g) for g in globs), f


@pytest.mark.parametrize("kind", [fused.ENCODE, fused.DECODE])
@pytest.mark.parametrize("two_stage", [True, False])
def test_one_body_two_dialects(kind, two_stage):
    hm, bm = fused.kernel_sources(kind, "metal", two_stage)
    hc, bc = fused.kernel_sources(kind, "cuda", two_stage)
    shared = fused.load_source(f"rvq_{kind}.inc")
    assert bm.endswith(shared) and bc.endswith(shared)  # the same body text ...
    assert hm.endswith(fused.load_source("rvq_common.h")) and hc.endswith(fused.load_source("rvq_common.h"))
    # ... and only the preludes differ
    assert "typedef unsigned int uint;" in hc and "typedef unsigned int uint;" not in hm


@pytest.mark.parametrize("kind", [fused.ENCODE, fused.DECODE])
@pytest.mark.parametrize("two_stage", [True, False])
def test_metal_body_names_its_thread_attributes(kind, two_stage):
    header, body = fused.kernel_sources(kind, "metal", two_stage)
    # what MLX's metal_kernel does: declare each attribute whose name occurs in the body text
    declared = {a for a in fused.METAL_ATTRIBUTES if a in body}
    needed = {"thread_position_in_grid", "thread_position_in_threadgroup", "threads_per_threadgroup"}
    assert needed <= declared
    # every attribute the code uses is declared, and none is used only through the header
    used = {a for a in fused.METAL_ATTRIBUTES if re.search(rf"\b{a}\b", header + body)}
    assert used <= declared
    # the CUDA body uses none of them
    assert not any(a in fused.kernel_sources(kind, "cuda", two_stage)[1] for a in fused.METAL_ATTRIBUTES)


_NVCC_STUB = """#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <cuda/std/limits>
#include <cstdint>
#include <cooperative_groups.h>
#define inf cuda::std::numeric_limits<float>::infinity()
"""


def _cuda_tu(configs) -> str:
    parts = []
    for i, (dim, bits, residual, kind) in enumerate(configs):
        plan = fused.make_plan(_codec(dim, bits, residual, use_kernels=False), kind)
        src = fused.cuda_translation_unit(kind, plan.bits2 > 0, plan.template(), _NVCC_STUB if i == 0 else "",
                                          name=f"k{i}")
        if i:  # one file for speed: later kernels reuse the first one's headers, redefining the one macro
            src = (f"#undef RVQ_CODES2\n#define RVQ_CODES2 {'codes2' if plan.bits2 else 'codes1'}\n"
                   + src[src.index("namespace mlx::core::cu {"):])
        parts.append(src)
    return "".join(parts)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on this machine")
def test_cuda_source_compiles_with_nvcc(tmp_path):
    """The CUDA dialect, wrapped the way mx.fast.cuda_kernel wraps it, compiles (PTX for sm_90)."""
    configs = [(128, (2, 2), "conditional", k) for k in ("encode", "decode")]
    configs += [(96, (3, 1), "shared", "encode"), (80, (1, 4), "conditional", "decode"),
                (64, (4, 0), "conditional", "encode"), (64, (3, 0), "conditional", "decode"),
                (2, (1, 0), "conditional", "encode"), (256, (4, 4), "shared", "decode")]
    cu = tmp_path / "rvq.cu"
    cu.write_text(_cuda_tu(configs))
    r = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-ptx", "-Werror", "all-warnings", str(cu), "-o",
                        str(tmp_path / "rvq.ptx")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    ptx = (tmp_path / "rvq.ptx").read_text()
    assert ptx.count(".entry") == len(configs)
    assert "ld.global.v4.f32" in ptx or "ld.global.nc.v4.f32" in ptx  # 16-byte loads are there


# ---- a NumPy model of the kernels: the algorithm is exact on the CPU too ------------------------------
def _np_count(y, tab, off, levels, search):
    y = np.asarray(y, np.float32)
    p = np.zeros(y.shape, np.int64)
    if search == fused.SEARCH_BINARY:
        for s in range(levels - 1, -1, -1):
            st = 1 << s
            p = np.where(tab[off + p + st - 1] < y, p + st, p)
    else:
        for k in range((1 << levels) - 1):
            p += (tab[off + k] < y)
    return p


def _np_quantize(plan, y, search):
    tab = np.asarray(plan.tab, np.float32)
    b1, b2 = plan.bits1, plan.bits2
    if plan.mode == fused.MODE_CONDITIONAL:
        p = _np_count(y, tab, 0, b1 + b2, search)
        return p >> b2, p & ((1 << b2) - 1)
    i1 = _np_count(y, tab, 0, b1, search)
    if plan.mode == fused.MODE_SINGLE:
        return i1, np.zeros_like(i1)
    r = (y - tab[(1 << b1) - 1 + i1]).astype(np.float32)
    return i1, _np_count(r, tab, (1 << b1) - 1 + (1 << b1), b2, search)


def np_encode(plan, y, search=None):
    """Mirror of rvq_encode_chunk: per chunk of C coordinates, whole words, partial last chunk."""
    search = plan.search if search is None else search
    y = np.asarray(y, np.float32)
    n, d = y.shape
    i1, i2 = _np_quantize(plan, y, search)
    out = []
    for bits, idx, words in ((plan.bits1, i1, plan.words1), (plan.bits2, i2, plan.words2)):
        if not bits:
            out.append(None)
            continue
        per = 32 // bits
        w = np.full((n, words), 0xDEADBEEF, np.uint64)  # poison: every word must be written
        for c in range(plan.chunks_per_vector):
            s0 = c * plan.chunk
            clen = min(plan.chunk, d - s0)
            acc = np.zeros((n, plan.chunk // per), np.uint64)
            for jj in range(clen):
                acc[:, jj // per] |= idx[:, s0 + jj].astype(np.uint64) << ((jj % per) * bits)
            for k in range(plan.chunk // per):
                if k * per < clen:
                    w[:, s0 // per + k] = acc[:, k]
        out.append(w.astype(np.uint32))
    return out[0], out[1]


def np_encode_lanes(plan, y):
    """Mirror of rvq_encode_lanes: a thread per float4, words OR-combined over aligned lane groups."""
    y = np.asarray(y, np.float32)
    n, d = y.shape
    tpv = plan.threads_per_vector(fused.LAYOUT_LANES)
    assert plan.lanes_ok
    assert 32 % (plan.chunk // 4) == 0 and tpv % (plan.chunk // 4) == 0
    i1, i2 = _np_quantize(plan, y, plan.search)
    gid = np.arange(n * tpv + 37)  # a ragged grid tail, as CUDA launches whole blocks
    vec, t = gid // tpv, gid % tpv
    j0 = 4 * t
    active = (gid < n * tpv) & (j0 < d)
    out = []
    for bits, idx, words in ((plan.bits1, i1, plan.words1), (plan.bits2, i2, plan.words2)):
        if not bits:
            out.append(None)
            continue
        per, g = 32 // bits, (32 // bits) // 4
        frag = np.zeros(gid.size, np.uint64)
        for e in range(4):
            j = np.minimum(j0 + e, d - 1)
            code = np.where(active, idx[np.minimum(vec, n - 1), j], 0).astype(np.uint64)
            frag |= code << (((t % g) * 4 + e) * bits).astype(np.uint64)
        # xor-shuffle OR over lane groups of g aligned lanes (within warps of 32)
        lane = gid % 32
        for m in (1, 2, 4, 8, 16)[: int(np.log2(g))]:
            partner = gid - lane + (lane ^ m)
            frag = frag | frag[np.minimum(partner, gid.size - 1)]
        w = np.full((n, words), 0xDEADBEEF, np.uint64)
        own = active & (t % g == 0)
        w[vec[own], j0[own] // per] = frag[own]
        out.append(w.astype(np.uint32))
    return out[0], out[1]


def np_decode(plan, codes1, codes2):
    tab = np.asarray(plan.tab, np.float32)
    b1, b2, d = plan.bits1, plan.bits2, plan.dim
    c1 = np.asarray(codes1, np.uint32)
    j = np.arange(d)
    i1 = (c1[:, j // (32 // b1)] >> ((j % (32 // b1)) * b1)) & ((1 << b1) - 1)
    if not b2:
        return tab[i1]
    c2 = np.asarray(codes2, np.uint32)
    i2 = (c2[:, j // (32 // b2)] >> ((j % (32 // b2)) * b2)) & ((1 << b2) - 1)
    if plan.mode == fused.MODE_CONDITIONAL:
        return tab[(i1 << b2) | i2]
    return (tab[i1] + tab[(1 << b1) + i2]).astype(np.float32)


@pytest.mark.skipif(fused.gpu_backend() is not None, reason="CPU-side model; GPU machines run the kernels themselves")
@pytest.mark.parametrize("bits,residual", CONFIGS, ids=CONFIG_IDS)
def test_numpy_model_of_kernels_is_exact(bits, residual):
    for dim in (12, 64, 80, 96, 160):
        ref = _codec(dim, bits, residual, use_kernels=False)
        plan = fused.make_plan(ref, fused.ENCODE)
        assert isinstance(plan, fused.Plan)
        y = np.concatenate([fused.boundary_probe(ref), 3 * np.random.default_rng(dim).standard_normal((7, dim))
                            ]).astype(np.float32)
        r1, r2 = ref._quantize_fn(mx.array(y))
        for search in (fused.SEARCH_BINARY, fused.SEARCH_LINEAR):
            g1, g2 = np_encode(plan, y, search)
            assert np.array_equal(g1, np.asarray(r1)), (dim, search)
            if bits[1]:
                assert np.array_equal(g2, np.asarray(r2)), (dim, search)
        if plan.lanes_ok:
            g1, g2 = np_encode_lanes(plan, y)
            assert np.array_equal(g1, np.asarray(r1)) and (not bits[1] or np.array_equal(g2, np.asarray(r2))), dim
        dplan = fused.make_plan(ref, fused.DECODE)
        got = np_decode(dplan, r1, r2)
        want = np.asarray(ref.dequantize(r1, r2))
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
        splan = fused.make_plan(ref, fused.DECODE, stage1_only=True)
        assert np.array_equal(np_decode(splan, r1, None).view(np.uint32),
                              np.asarray(ref.dequantize(r1, None)).view(np.uint32))


def test_plan_shapes():
    for (b1, b2), residual in CONFIGS:
        for dim in (2, 12, 64, 80, 96, 128, 256, 448):
            p = fused.make_plan(_codec(dim, (b1, b2), residual, use_kernels=False), fused.ENCODE)
            per1 = 32 // b1
            assert p.chunk % per1 == 0 and (not b2 or p.chunk % (32 // b2) == 0)
            assert dim % p.vl == 0 and p.chunk % p.vl == 0
            assert p.tabn <= p.tab.size and p.tab.size >= 8
            lanes = dim % 4 == 0 and 3 not in (b1, b2)
            assert p.lanes_ok == lanes and p.layout == fused.LAYOUT_CHUNK
            d = fused.make_plan(_codec(dim, (b1, b2), residual, use_kernels=False), fused.DECODE)
            assert d.layout == (fused.LAYOUT_LANES if lanes else fused.LAYOUT_CHUNK)


# ---- dispatch and fallback -----------------------------------------------------------------------------
def _y(n, dim, seed=0):
    return mx.array(np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32))


@pytest.mark.skipif(fused.gpu_backend() is not None, reason="checks the CPU-only behaviour")
def test_cpu_dispatch_returns_none():
    codec = _codec(128, (2, 2), "conditional")
    y = _y(9, 128)
    assert fused.quantize_pack(codec, y) is None
    c1, c2 = codec.quantize(y)
    assert fused.unpack_dequantize(codec, c1, c2) is None
    assert fused.unpack_dequantize(codec, c1, None) is None
    r1, r2 = codec._quantize_fn(y)
    assert _same(c1, r1) and _same(c2, r2)
    assert not fused.disabled()


@pytest.fixture
def fake_gpu(monkeypatch):
    """Pretend a CUDA backend exists, with launches that run the reference (or what a test sets)."""
    monkeypatch.setattr(fused, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(fused, "_on_gpu", lambda: True)
    calls = collections.Counter()

    def enc(plan, y2d, dialect, **kw):
        calls["encode"] += 1
        return tuple(mx.array(a) if a is not None else None for a in np_encode(plan, np.asarray(y2d)))

    def dec(plan, c1, c2, dialect, **kw):
        calls["decode"] += 1
        return mx.array(np_decode(plan, c1, c2))

    monkeypatch.setattr(fused, "launch_encode", enc)
    monkeypatch.setattr(fused, "launch_decode", dec)
    return calls


def test_dispatch_uses_kernel_and_checks_once(fake_gpu):
    codec = _codec(96, (3, 2), "shared")
    x = mx.array(np.random.default_rng(3).standard_normal((2, 5, 96)).astype(np.float16))
    y, _ = codec.rotate(x)
    got = fused.quantize_pack(codec, y)
    assert got is not None and got[0].shape == (2, 5, codec.words1) and got[1].shape == (2, 5, codec.words2)
    ref = codec._quantize_fn(y)
    assert _same(got[0], ref[0]) and _same(got[1], ref[1])
    assert fake_gpu["encode"] == 2  # the call and its first-use probe
    fused.quantize_pack(codec, y)
    assert fake_gpu["encode"] == 3  # checked once per configuration
    yh = fused.unpack_dequantize(codec, *got)
    assert yh.shape == (2, 5, 96) and _same(yh, codec._dequantize_fn(*ref))
    y1 = fused.unpack_dequantize(codec, got[0], None)
    assert _same(y1, mx.take(codec._c1_mx, mx.array(np.asarray(
        __import__("rvqstore").unpack_codes(got[0], 3, 96))).astype(mx.uint32)))
    # the codec's public path goes through the kernel and round-trips
    enc = codec.encode(x)
    ref_codec = _codec(96, (3, 2), "shared", use_kernels=False)
    ref_enc = ref_codec.encode(x)
    assert _same(enc.codes1, ref_enc.codes1) and _same(enc.codes2, ref_enc.codes2)
    assert _same(codec.decode(enc), ref_codec.decode(ref_enc))


def test_unsupported_inputs_fall_back_without_latching(fake_gpu):
    codec = _codec(64, (2, 2), "conditional")
    y = _y(4, 64)
    assert fused.quantize_pack(codec, y.astype(mx.float16)) is None
    assert fused.quantize_pack(codec, mx.zeros((0, 64))) is None
    assert fused.quantize_pack(codec, _y(4, 32)) is None
    c1, c2 = codec._quantize_fn(y)
    assert fused.unpack_dequantize(codec, c1.astype(mx.int32), c2) is None
    assert fused.unpack_dequantize(codec, c1, c2[:2]) is None
    assert fake_gpu["encode"] == 0 and fake_gpu["decode"] == 0
    assert not fused.disabled()


def test_failing_kernel_latches_off_and_logs_once(monkeypatch, fake_gpu, caplog):
    calls = collections.Counter()

    def boom(plan, y2d, dialect, **kw):
        calls["boom"] += 1
        raise RuntimeError("nvrtc: simulated compile failure")

    monkeypatch.setattr(fused, "launch_encode", boom)
    codec = _codec(128, (2, 2), "conditional")
    y = _y(33, 128)
    with caplog.at_level(logging.INFO, logger="rvqstore.kernels"):
        for _ in range(3):
            assert fused.quantize_pack(codec, y) is None
            c1, c2 = codec.quantize(y)  # the codec falls back to the reference: same bits
            r1, r2 = codec._quantize_fn(y)
            assert _same(c1, r1) and _same(c2, r2)
    assert calls["boom"] == 1  # latched: never tried again for this configuration
    warnings = [r for r in caplog.records if r.name == "rvqstore.kernels" and r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "simulated compile failure" in warnings[0].getMessage()
    key = fused.config_key(codec, fused.ENCODE)
    assert key in fused.disabled()
    # another configuration (and decode of this one) is unaffected
    other = _codec(128, (2, 2), "shared")
    assert fused.quantize_pack(other, y) is None and calls["boom"] == 2
    assert fused.unpack_dequantize(codec, c1, c2) is not None


def test_wrong_kernel_is_caught_by_first_use_check(monkeypatch, fake_gpu, caplog):
    def wrong(plan, c1, c2, dialect, **kw):
        out = np_decode(plan, c1, c2)
        out[0, 0] = np.nextafter(out[0, 0], np.float32(np.inf))
        return mx.array(out)

    monkeypatch.setattr(fused, "launch_decode", wrong)
    codec = _codec(64, (1, 3), "conditional")
    c1, c2 = codec._quantize_fn(_y(5, 64))
    with caplog.at_level(logging.WARNING, logger="rvqstore.kernels"):
        assert fused.unpack_dequantize(codec, c1, c2) is None
        assert fused.unpack_dequantize(codec, c1, c2) is None
        assert _same(codec.dequantize(c1, c2), codec._dequantize_fn(c1, c2))
    assert len([r for r in caplog.records if r.name == "rvqstore.kernels"]) == 1
    assert fused.config_key(codec, fused.DECODE) in fused.disabled()


def test_use_kernels_false_never_dispatches(monkeypatch, fake_gpu):
    codec = _codec(64, (2, 2), "conditional", use_kernels=False)
    codec.quantize(_y(3, 64))
    assert fake_gpu["encode"] == 0


# ---- GPU parity: the kernels against the reference path on the same device -----------------------------
PARITY = collections.Counter()
PARITY_NS = (1, 5, 33, 4097)
PARITY_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _tally(name, ok):
    PARITY[f"{name}:{'pass' if ok else 'FAIL'}"] += 1
    return ok


def _parity_text() -> str:
    lines = [f"{k:32s} {v}" for k, v in sorted(PARITY.items())]
    total_pass = sum(v for k, v in PARITY.items() if k.endswith(":pass"))
    total_fail = sum(v for k, v in PARITY.items() if k.endswith(":FAIL"))
    return "\n".join(["GPU parity comparisons (kernel vs reference, bit-exact):", *lines,
                      f"total: {total_pass} passed, {total_fail} failed"])


@pytest.fixture(scope="module", autouse=True)
def _parity_report():
    yield
    if PARITY:
        print("\n" + _parity_text())


@pytest.fixture(autouse=True)
def _parity_progress(request):
    yield
    out = os.environ.get("RVQ_PARITY_REPORT")
    if out and PARITY and "gpu" in request.keywords:  # rewritten after every GPU test: survives a timeout
        Path(out).write_text(_parity_text() + "\n")


def _x(n, dim, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32) * rng.choice([1e-3, 1.0, 30.0], size=(n, 1))
    if n > 3:
        x[1] = 0.0  # a zero vector: scale 0, y = 0
        x[2] = rng.laplace(size=dim) * 1e4  # heavy-tailed and large
    return mx.array(x).astype(dtype)


def _parity_one(kc, rc, y, tag):
    """Kernel (through the dispatch) vs the codec's reference path, uncompiled (the same ops as the
    mx.compile'd ones the codec runs, without a JIT compile per configuration and shape)."""
    got = fused.quantize_pack(kc, y)
    assert got is not None, f"kernel fell back: {fused.disabled()}"
    ref = rc._quantize_reference(y)
    ok = _tally(f"encode-codes1{tag}", _same(got[0], ref[0]))
    if rc.bits2:
        ok &= _tally(f"encode-codes2{tag}", _same(got[1], ref[1]))
    dec = fused.unpack_dequantize(kc, ref[0], ref[1])
    assert dec is not None, f"kernel fell back: {fused.disabled()}"
    ok &= _tally(f"decode{tag}", _same(dec, fused._reference_dequantize(rc, ref[0], ref[1])))
    if rc.bits2:
        s1 = fused.unpack_dequantize(kc, ref[0], None)
        ok &= _tally(f"decode-stage1{tag}", _same(s1, fused._reference_dequantize(rc, ref[0], None)))
    return ok


@pytest.mark.gpu
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("bits,residual", CONFIGS, ids=CONFIG_IDS)
def test_gpu_parity(dim, bits, residual):
    kc = _codec(dim, bits, residual, use_kernels=True)
    rc = _codec(dim, bits, residual, use_kernels=False)
    failures = []
    for n in PARITY_NS:
        for dt in PARITY_DTYPES:
            y, _ = kc.rotate(_x(n, dim, dt, seed=n * 31 + dim + sum(bits)))
            if not _parity_one(kc, rc, y, ""):
                failures.append((n, str(dt)))
    # adversarial: y exactly on every boundary, next to it, +-0, denormals, huge, inf, nan
    y = mx.array(fused.boundary_probe(rc, seed=dim))
    if not _parity_one(kc, rc, y, "-adversarial"):
        failures.append("adversarial")
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.parametrize("bits,residual", [((2, 2), "conditional"), ((3, 1), "shared"), ((4, 0), "conditional")])
def test_gpu_parity_odd_layouts(bits, residual):
    """Leading axes, an unaligned (offset) input, a transposed input, and the codec's public API."""
    dim = 128
    kc = _codec(dim, bits, residual, use_kernels=True)
    rc = _codec(dim, bits, residual, use_kernels=False)
    y, _ = kc.rotate(_x(3 * 7, dim, mx.float32, seed=4))
    ok = _parity_one(kc, rc, y.reshape(3, 7, dim), "-leading")
    flat = mx.concatenate([mx.zeros((1,)), y.reshape(-1)])[1:]  # a view whose data starts 4 bytes in
    ok &= _parity_one(kc, rc, flat.reshape(21, dim), "-offset")
    ok &= _parity_one(kc, rc, mx.swapaxes(y.reshape(3, 7, dim), 0, 1), "-transposed")
    # the non-default layouts (encode: lanes; decode: chunk, what 3-bit codes use), where they apply
    dialect = fused.gpu_backend()
    for dd in (128, 80):
        kcd = _codec(dd, bits, residual)
        yd, _ = kcd.rotate(_x(33, dd, mx.float32, seed=dd))
        pe, pd = fused.make_plan(kcd, fused.ENCODE), fused.make_plan(kcd, fused.DECODE)
        r = kcd._quantize_reference(yd)
        if pe.lanes_ok:
            g = fused.launch_encode(pe, yd, dialect, layout=fused.LAYOUT_LANES)
            ok &= _tally("encode-lanes-layout", _same(g[0], r[0]) and (r[1] is None or _same(g[1], r[1])))
        dch = fused.launch_decode(pd, r[0], r[1], dialect, layout=fused.LAYOUT_CHUNK)
        ok &= _tally("decode-chunk-layout", _same(dch, fused._reference_dequantize(kcd, r[0], r[1])))
    # the codec's public API (its compiled reference path) with and without kernels
    x = _x(257, dim, mx.bfloat16, seed=9)
    e1, e2 = kc.encode(x), rc.encode(x)
    ok &= _tally("codec-encode", _same(e1.codes1, e2.codes1) and (e1.codes2 is None or _same(e1.codes2, e2.codes2)))
    ok &= _tally("codec-decode", _same(kc.decode(e1), rc.decode(e2))
                  and _same(kc.decode(e1, dtype=mx.float32), rc.decode(e2, dtype=mx.float32)))
    assert ok
    assert not fused.disabled()
