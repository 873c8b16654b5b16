"""The split kernel on tensor cores (kernels/rvq_attend_mma.inc, rvqstore.attention.kernel_mma), CUDA only.

On every backend: which calls it takes (on by default; ``RVQSTORE_TENSOR_CORES=0`` switches it off). On the GPU (tests marked ``gpu``): its partials against the
kernel's model (``partials_reference`` in float32), and whole calls against decode-then-SDPA on fp16.

Tolerances, and why: the kernel's mma operands are fp16 (the rotated queries, the table values and each
weight ``p x value norm``), each rounded once (relative 2^-11), sums in fp32; so its partials differ from
the float32 model by a few 2^-11 relative (scores: 2^-11 x |q| |y| summed over D, moved into ``m``;
weights: 2^-11 each), bound here at 4e-3 relative for ``o``/``l`` and 4e-3 x max|score| for ``m`` -- a
layout error (a wrong token, coordinate or dim) gives errors of order 1. Against decode-then-SDPA on fp16
the bound is the one of tests/test_attention_gpu.py: 4 x 2^-11 x max|V|.
With RVQ_ATTN_PARITY_REPORT=path each comparison appends a line there (tools/results/gpu-parity-attention.txt).
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQKVCache, fused
from rvqstore.attention import kernel, kernel_mma, ops
from gpu_report import record as _record  # noqa: E402


@pytest.fixture(autouse=True)
def tensor_cores_on(monkeypatch):
    """This kernel's tests run it whatever the environment says."""
    monkeypatch.setattr(kernel_mma, "TENSOR_CORES", True)


@pytest.fixture
def cpu_device():
    """The float32 models in full float32: on the CPU whatever the default device."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(before)


def _cache(bits, hkv, n, d, *, b=1, window=0, dtype=mx.float16, seed=0, residual="conditional"):
    rng = np.random.default_rng(seed)
    c = RVQKVCache(bits, residual=residual, dense_window=window, flush_block=8)
    k = mx.array(rng.standard_normal((b, hkv, n, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((b, hkv, n, d)).astype(np.float32)).astype(dtype)
    if n > 1:
        c.update_and_fetch(k[:, :, : n - 1], v[:, :, : n - 1])
    kk, vv = c.update_and_fetch(k[:, :, n - 1:], v[:, :, n - 1:])
    return c, kk, vv


@pytest.mark.parametrize("bits,d,rows,dtype,dialect,want", [
    ((2, 2), 128, 4, mx.float16, "cuda", True),
    ((4, 2), 64, 16, mx.float16, "cuda", True),
    ((1, 1), 64, 4, mx.float16, "cuda", False),    # 64 x 1 bit: half a word per quarter row
    ((2, 2), 96, 4, mx.float16, "cuda", False),    # head dim
    ((2, 2), 256, 4, mx.float16, "cuda", False),
    ((2, 2), 128, 17, mx.float16, "cuda", False),  # rows
    ((2, 2), 128, 4, mx.bfloat16, "cuda", False),  # queries' dtype
    ((2, 2), 128, 4, mx.float16, "metal", False),
])
def test_which_calls_the_tensor_core_kernel_takes(bits, d, rows, dtype, dialect, want):
    c, _, _ = _cache(bits, 1, 40, d)
    assert kernel_mma.takes(c.codes_view(), rows, dtype, dialect) is want


def test_the_simt_kernel_still_serves_what_tensor_cores_do_not(monkeypatch):
    c, _, _ = _cache((2, 2), 1, 40, 128)
    view = c.codes_view()
    assert kernel._served(view, 4, mx.float16, "cuda") == (True, True)
    assert kernel._served(view, 4, mx.float32, "cuda") == (True, False)
    assert kernel._served(view, 12, mx.float16, "cuda") == (True, True)   # up to 16 rows on tensor cores
    assert kernel._served(view, 12, mx.float32, "cuda") == (False, False)  # the SIMT kernel takes 8
    monkeypatch.setattr(kernel_mma, "TENSOR_CORES", False)
    assert kernel._served(view, 4, mx.float16, "cuda") == (True, False)


@pytest.mark.parametrize("bits,residual", [((2, 2), "conditional"), ((2, 2), "shared"), ((1, 1), "conditional"),
                                           ((4, 2), "conditional"), ((4, 4), "shared"), ((2, 0), "conditional"),
                                           ((4, 0), "conditional")])
def test_the_kernel_table_decodes_like_the_codec(bits, residual):
    """The kernel's view of the codes, modelled in numpy: every coordinate looked up in ``table`` the way the
    kernel indexes it (pairs of neighbouring coordinates or single ones) is the codec's decoded value
    rounded to fp16."""
    c, _, _ = _cache(bits, 2, 37, 64 if bits[0] + bits[1] > 2 else 128, residual=residual)
    view = c.codes_view()
    kc = view.key_codec
    b1, b2 = kc.bits1, kc.bits2
    n, d = view.n_coded, kc.dim
    _, c1, c2 = view.key_buffers
    w1 = np.array(c1[:, :, :n]).astype(np.uint64)
    w2 = np.array(c2[:, :, :n]).astype(np.uint64) if b2 else None
    want = np.array(kc.dequantize(c1[:, :, :n], c2[:, :, :n] if b2 else None)).astype(np.float16)
    lut = kernel_mma.table(kc)

    def field(w, bits, coord, width):  # `width` codes of `bits` from coordinate `coord` on
        if not bits:
            return np.zeros(w1.shape[:-1], np.uint64)
        per = 32 // bits
        return (w[..., coord // per] >> np.uint64((coord % per) * bits)) & np.uint64((1 << (bits * width)) - 1)

    got = np.zeros(want.shape, np.uint16)
    pair = b1 + b2 <= 4
    for coord in range(0, d, 2 if pair else 1):
        if pair:
            idx = (field(w1, b1, coord, 2) << np.uint64(2 * b2)) | field(w2, b2, coord, 2)
            word = lut[idx.astype(np.int64)]
            got[..., coord] = word & 0xFFFF
            got[..., coord + 1] = word >> 16
        else:
            idx = (field(w1, b1, coord, 1) << np.uint64(b2)) | field(w2, b2, coord, 1)
            word = lut[idx.astype(np.int64)]
            got[..., coord] = word & 0xFFFF
            assert np.array_equal(word >> 16, word & 0xFFFF)
    assert np.array_equal(got.view(np.float16), want)


@pytest.mark.parametrize("n,L", [(1000, 1), (130, 3), (1, 1), (4097, 2)])
def test_the_strided_split_model_merges_to_the_same_attention(n, L, cpu_device):
    """Dealing blocks of tokens to the splits in turn (the tensor-core kernel) changes which split sums which
    token, not the merged result: both models through the same combine agree. On the CPU: MLX's CUDA backend runs
    float32 matmuls at TF32 precision (~1e-3 relative on the H200, tools/results/suite-gpu.txt), over this
    test's 1e-5 bound."""
    hkv, g, d = 2, 4, 64
    c, _, _ = _cache((2, 2), hkv, n, d, dtype=mx.float32)
    view = c.codes_view()
    q = mx.array(np.random.default_rng(5).standard_normal((1, hkv * g, L, d)).astype(np.float32))
    mask = "causal" if L > 1 else None
    q_rot = ops.rotate_queries(view, q, 0.1).reshape(1, hkv, g * L, d)
    plain = kernel.combine(view, q, 0.1, *kernel.partials_reference(view, q_rot, L, L > 1), mask, None)
    o, ml = kernel.partials_reference(view, q_rot, L, L > 1, kernel_mma.TARGET_GROUPS, kernel_mma.BLOCK)
    strided = kernel.combine(view, q, 0.1, o, ml, mask, None)
    np.testing.assert_allclose(np.array(strided), np.array(plain), rtol=1e-5, atol=1e-6)
    assert o.shape[1] == kernel.split_plan(int(view.key_buffers[0].shape[-1]), hkv, kernel_mma.TARGET_GROUPS)[1]


def test_which_calls_take_one_launch(monkeypatch):
    """The merge fused into the tensor-core kernel serves fast-path calls (no window, no sinks) only where it is
    switched on; the decision is made once per configuration and keyed by the switch."""
    c, _, _ = _cache((2, 2), 2, 40, 128)
    view = c.codes_view()
    monkeypatch.setattr(kernel, "_decisions", weakref.WeakKeyDictionary())
    for on in (False, True):
        monkeypatch.setattr(kernel_mma, "FUSED_MERGE", on)
        fast, mma, one, config = kernel._decide(view, 4, mx.float16, False, False, "cuda")
        assert (fast, mma, one) == (True, True, on) and one in config
        assert kernel._decide(view, 4, mx.float16, True, False, "cuda")[:3] == (False, True, False)  # a window
        assert kernel._decide(view, 4, mx.float16, False, True, "cuda")[:3] == (False, True, False)  # sinks
        assert kernel._decide(view, 4, mx.float32, False, False, "cuda")[1:3] == (False, False)  # the SIMT kernel


def test_the_fused_merges_counter_ring(monkeypatch):
    """Each launch of the fused merge takes the next zeroed slot of its stream's ring, for its heads count; the
    ring is at least 8 graphs of MLX's (MLX_MAX_OPS_PER_BUFFER nodes) long, so no two launches that can run at
    once share a slot."""
    monkeypatch.setattr(kernel_mma, "_rings", [])
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "200")
    n = kernel_mma._ring_size()
    assert n == max(kernel_mma.RING_SLOTS, 1600)
    first = [kernel_mma._sem_slot(8) for _ in range(n)]
    assert all(s.shape == (8,) and s.dtype == mx.uint32 and not bool(s.any()) for s in first[:3] + first[-3:])
    assert len({id(s) for s in first}) == n  # n distinct slots, then the ring starts again
    assert kernel_mma._sem_slot(8) is first[0] and kernel_mma._sem_slot(8) is first[1]
    other = kernel_mma._sem_slot(2)  # another heads count: its own ring
    assert other.shape == (2,) and other is not first[2] and kernel_mma._sem_slot(8) is first[2]
    with mx.stream(mx.new_stream(mx.default_device())):  # another stream: its own ring
        assert kernel_mma._sem_slot(8) is not first[3]
    assert kernel_mma._sem_slot(8) is first[3]


def test_the_quick_kernels_are_chosen_by_setting_and_dialect(monkeypatch):
    """The split kernel's quick setup and warp merge follow kernel_mma.QUICK_SPLIT (template T_QUICK, part of the
    plan's key, so switching it makes a new launch); the merge kernel's quick version follows kernel.QUICK_MERGE on
    CUDA only (its bits are recorded there, not on Metal)."""
    c, _, _ = _cache((2, 2), 2, 40, 128)
    view = c.codes_view()
    templates = {}
    for quick in (True, False):
        monkeypatch.setattr(kernel_mma, "QUICK_SPLIT", quick)
        templates[quick] = dict(kernel_mma._plan(view, 256, 2, 4, 1, False, 0.1).template)
    assert templates[True]["T_QUICK"] == 1 and templates[False]["T_QUICK"] == 0
    shape, o_shape = (1, 8, 1, 128), (2, 3, 4, 128)
    for quick in (True, False):
        monkeypatch.setattr(kernel, "QUICK_MERGE", quick)
        for dialect in ("cuda", "metal"):
            t = dict(kernel._merge_args(view, o_shape, shape, mx.float16, dialect)[2])
            assert t["T_QUICK"] == int(quick and dialect == "cuda")


#: the settings of the split kernel that must not change its bits, each setting's values (the last: the first order)
_ARMS = {"QUICK_MAX": (True, False), "LATE_NORMS": (True, False), "BYTE_INDEX_42": (True, False),
         "SHARED_ADDRESS": (3, 2, 1, 0), "TILE_PAIRS": (True, False), "L2_PREFETCH": (8, 2, 0),
         "STAGES": (4, 3, 2, 0)}


def test_the_maxima_and_norms_orders_are_chosen_by_setting(monkeypatch):
    """kernel_mma.QUICK_MAX, LATE_NORMS, BYTE_INDEX_42, SHARED_ADDRESS, TILE_PAIRS, L2_PREFETCH and STAGES become the
    templates' T_QMAX, T_LATEN, T_I42, T_LDS, T_PING, T_L2PF and T_STAGES and are part of the plan's key (switching one makes a new launch, the
    variants' same-run arms)."""
    c, _, _ = _cache((2, 2), 2, 40, 128)
    view = c.codes_view()
    for name, param in (("QUICK_MAX", "T_QMAX"), ("LATE_NORMS", "T_LATEN"), ("BYTE_INDEX_42", "T_I42"),
                        ("SHARED_ADDRESS", "T_LDS"), ("TILE_PAIRS", "T_PING"), ("L2_PREFETCH", "T_L2PF"),
                        ("STAGES", "T_STAGES")):
        plans = {}
        for on in _ARMS[name]:
            monkeypatch.setattr(kernel_mma, name, on)
            plans[on] = kernel_mma._plan(view, 256, 2, 4, 1, False, 0.1)
            assert dict(plans[on].template)[param] == int(on)
            # only 2+2's 256-byte table (T_LDS 3) and the rings of tiles (T_STAGES 2 on) ask for dynamic shared memory
            ring = 16 * kernel_mma.stage_words(plans[on].template)
            assert ring == 0 or (name == "STAGES" and on >= 2)
            assert plans[on].smem == (65536 if (name, on) == ("SHARED_ADDRESS", 3) else 0) + ring
        assert len({id(p) for p in plans.values()}) == len(_ARMS[name])


def test_the_template_is_the_plans_and_takes_overrides_by_name(monkeypatch):
    """kernel_mma.template gives what a plan launches with (the module's settings) and replaces named arguments for
    tools that compile other configurations; a name the kernel does not take is refused."""
    c, _, _ = _cache((2, 2), 2, 40, 128)
    assert kernel_mma._plan(c.codes_view(), 256, 2, 4, 1, False, 0.1).template == kernel_mma.template(2, 2, 128, 4)
    monkeypatch.setattr(kernel_mma, "STAGES", 3)
    t = dict(kernel_mma.template(4, 2, 64, 8, T_PING=1, T_LDS=0))
    assert (t["T_B1"], t["T_B2"], t["T_D"], t["T_R"], t["T_STAGES"], t["T_PING"], t["T_LDS"]) == (4, 2, 64, 8, 3, 1, 0)
    with pytest.raises(ValueError, match="T_RING"):
        kernel_mma.template(2, 2, 128, 4, T_RING=2)


@pytest.mark.parametrize("bits,d,rows,stages,lds,words,dynamic", [
    # key words 2 x (2 + 2), value words 4 x (1 + 1), norm words 2 x 1; the table (256 pair entries x 8 uint4) beside it
    ((2, 2), 128, 4, 3, 2, 3 * 32 * 18, 256 * 8 * 16 + 16 * 3 * 32 * 18),
    # 2 x (4 + 2), 4 x (2 + 1), 2 x 1; 64 entries at 256 bytes (byte-built offsets)
    ((4, 2), 128, 4, 3, 2, 3 * 32 * 26, 64 * 16 * 16 + 16 * 3 * 32 * 26),
    ((2, 2), 128, 16, 2, 2, 2 * 32 * 20, 256 * 8 * 16 + 16 * 2 * 32 * 20),  # rows first: norm words 2 x 2
    ((2, 0), 64, 4, 4, 2, 4 * 32 * 8, 16 * 8 * 16 + 16 * 4 * 32 * 8),     # 2 x 1, 4 x 1, 2 x 1; 16 pair entries
    ((2, 2), 64, 4, 3, 2, 3 * 32 * 14, 32768 + 21504),  # 54,272: above 48,000, MLX lifts the limit itself
    ((2, 0), 128, 4, 2, 2, 2 * 32 * 10, 2048 + 10240),  # 12,288 + the static arrays: within 48 KB
    ((4, 2), 64, 4, 4, 2, 4 * 32 * 16, 48016),          # 8,192 + 32,768 = 40,960: raised past MLX's threshold
    ((2, 2), 128, 4, 1, 2, 0, 0),               # one tile: no ring, the table static
    ((2, 2), 128, 4, 1, 3, 0, 65536),           # 2+2's 256-byte table alone
])
def test_a_warps_ring_of_tiles_holds_each_threads_words(bits, d, rows, stages, lds, words, dynamic):
    """stage_words: a warp's ring is stages x 32 lanes x the words a lane loads per tile (kernels/rvq_attend_mma.inc,
    SLOT); the launch's dynamic shared memory is the table and the four warps' rings, raised just above MLX's 48,000
    bytes where the static arrays could take the total past 48 KB without MLX lifting the limit; none where the
    kernel takes no ring and keeps its table static."""
    t = [("T_B1", bits[0]), ("T_B2", bits[1]), ("T_D", d), ("T_R", rows), ("T_SWAP", 1), ("T_LATEN", 1),
         ("T_PING", 0), ("T_LDS", lds), ("T_I42", 1), ("T_STAGES", stages)]
    assert kernel_mma.stage_words(t) == words
    assert kernel_mma.dynamic_shared_bytes(t) == dynamic
    for off in (("T_LATEN", 0), ("T_PING", 1)):
        assert kernel_mma.stage_words(dict(t) | dict([off])) == 0


@pytest.mark.parametrize("env,value,want", [
    ("RVQSTORE_STAGES", "3", 3), ("RVQSTORE_STAGES", "9", 0), ("RVQSTORE_STAGES", "three", 0),
    ("RVQSTORE_STAGES", "", 0), ("RVQSTORE_L2_PREFETCH", "4", 4), ("RVQSTORE_L2_PREFETCH", "-1", 0),
])
def test_integer_settings_from_the_environment_fall_back_to_off(monkeypatch, env, value, want):
    """A bad RVQSTORE_STAGES or RVQSTORE_L2_PREFETCH leaves the setting off instead of failing at import."""
    monkeypatch.setenv(env, value)
    assert kernel_mma._setting(env, range(0, 5 if env == "RVQSTORE_STAGES" else 17)) == want


# ---- on the GPU ------------------------------------------------------------------------------------------
MMA_CASES = [
    # (bits, residual, d, hkv, group, L, n, b, window)
    ((2, 2), "conditional", 128, 8, 4, 1, 1000, 1, 0),
    ((2, 2), "conditional", 128, 2, 8, 1, 4097, 1, 0),
    ((4, 2), "conditional", 128, 8, 4, 1, 777, 1, 16),
    ((4, 2), "conditional", 64, 3, 3, 1, 129, 2, 0),
    ((2, 2), "conditional", 64, 2, 1, 1, 1, 1, 0),
    ((2, 2), "shared", 128, 2, 4, 2, 333, 1, 0),
    ((1, 1), "conditional", 128, 1, 8, 1, 513, 1, 8),
    ((4, 0), "conditional", 64, 2, 2, 2, 70, 1, 0),
    ((2, 0), "conditional", 128, 2, 4, 1, 300, 1, 0),
    ((4, 4), "conditional", 128, 4, 4, 4, 2048, 1, 0),
    ((2, 4), "conditional", 128, 8, 1, 1, 33000, 1, 0),
    ((2, 2), "conditional", 128, 2, 4, 3, 17, 1, 0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: f"{c[0][0]}+{c[0][1]}-{c[1][:4]}-d{c[2]}-h{c[3]}g{c[4]}"
                         f"-L{c[5]}-n{c[6]}-b{c[7]}-w{c[8]}")
@pytest.mark.parametrize("swapped", [True, False], ids=["swap", "rows"])
def test_gpu_tensor_core_kernel_parity(case, swapped, monkeypatch):
    """Both layouts of the tensor-core kernel (query rows as the mma's columns, up to 8 rows; as its rows)."""
    bits, residual, d, hkv, g, L, n, b, window = case
    monkeypatch.setattr(kernel_mma, "SWAPPED", swapped)
    c, K, V = _cache(bits, hkv, n, d, b=b, window=window, residual=residual, seed=n)
    view = c.codes_view()
    assert kernel_mma.takes(view, g * L, mx.float16, fused.gpu_backend())
    q = mx.array(np.random.default_rng(d).standard_normal((b, hkv * g, L, d)).astype(np.float32)).astype(mx.float16)
    scale = d ** -0.5
    o, ml = kernel_mma.launch(view, q, L, L > 1, scale)
    with mx.stream(mx.cpu):  # the model in exact float32
        q_rot = ops.rotate_queries(view, q.astype(mx.float32), scale).reshape(b, hkv, g * L, d)
        ro, rml = kernel.partials_reference(view, q_rot, L, L > 1, kernel_mma.TARGET_GROUPS,
                                             kernel_mma.BLOCK if kernel_mma.STRIDED else None)
        s_max = float(mx.abs(q_rot).max()) * 4.0 * d * float(view.key_buffers[0][..., : view.n_coded].astype(mx.float32).max())
        mx.eval(ro, rml)
    err_o = float(mx.abs(o - ro).max()) / (float(mx.abs(ro).max()) + 1e-30)
    m, rm = np.array(ml[..., 0]), np.array(rml[..., 0])
    same_inf = bool(np.array_equal(np.isinf(m), np.isinf(rm)))
    fin = np.isfinite(rm)
    err_m = float(np.abs(m[fin] - rm[fin]).max()) if fin.any() else 0.0
    m_scale = float(np.abs(rm[fin]).max()) + 1.0 if fin.any() else 1.0
    err_l = float(mx.abs(ml[..., 1] - rml[..., 1]).max() / (mx.abs(rml[..., 1]).max() + 1e-30))
    ok = err_o < 4e-3 and err_l < 4e-3 and err_m < 4e-3 * m_scale and same_inf
    layout = "swap" if swapped and g * L <= 8 else "rows"
    _record("mma-partials", ok, f"{case} {layout} rel_err o={err_o:.2e} l={err_l:.2e} abs_err m={err_m:.2e} "
            f"(m scale {m_scale:.1f}, score bound {s_max:.1f})")
    assert ok, (err_o, err_l, err_m, same_inf)
    # the whole call (tensor-core kernel + merge kernel or combine; or the merge fused) vs decode-then-SDPA, fp16
    real, real_fused = kernel_mma.launch, kernel_mma.launch_fused
    calls = []
    monkeypatch.setattr(kernel_mma, "launch", lambda *a, **kw: calls.append("split") or real(*a, **kw))
    monkeypatch.setattr(kernel_mma, "launch_fused", lambda *a, **kw: calls.append("fused") or real_fused(*a, **kw))
    mask = "causal" if L > 1 else None
    ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=scale, mask=mask)
    bound = 4 * 2.0 ** -11 * float(mx.abs(V.astype(mx.float32)).max())
    for fuse in (False, True):
        monkeypatch.setattr(kernel_mma, "FUSED_MERGE", fuse)
        calls.clear()
        got = c.attend_on_codes(q, scale=scale, mask=mask)
        err = float(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max())
        _record("mma-attend-fp16-vs-sdpa", err <= bound and bool(calls),
                f"{case} {'+'.join(calls)} max_abs_err={err:.2e} bound={bound:.2e}")
        assert calls == ["fused" if fuse and not window else "split"] and err <= bound and not kernel.disabled()


FUSED_CASES = [c for c in MMA_CASES if not c[8]]  # no window: the calls the fused merge serves


@pytest.mark.gpu
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: f"{c[0][0]}+{c[0][1]}-d{c[2]}-h{c[3]}g{c[4]}-L{c[5]}"
                         f"-n{c[6]}-b{c[7]}")
def test_gpu_fused_merge_equals_split_then_merge(case):
    """One launch (split kernel, merge by its last threadgroup per head) against the split kernel + the merge
    kernel: the same sums but one (the denominator, summed across lanes instead of in split order), so they
    agree to a unit of fp16 rounding of the output; and run again (the counters were left at zero), the fused
    call gives the same bits."""
    bits, residual, d, hkv, g, L, n, b, _ = case
    c, K, V = _cache(bits, hkv, n, d, b=b, residual=residual, seed=n + 1)
    view = c.codes_view()
    q = mx.array(np.random.default_rng(n).standard_normal((b, hkv * g, L, d)).astype(np.float32)).astype(mx.float16)
    scale, causal = d ** -0.5, L > 1
    vsg = kernel._folded_signs(view.value_codec, 1.0 / d)
    fused_out = kernel_mma.launch_fused(view, q, L, causal, scale, vsg)
    o, ml = kernel_mma.launch(view, q, L, causal, scale)
    two = kernel.merge(view, o, ml, (b, hkv * g, L, d), mx.float16, "cuda")
    again = kernel_mma.launch_fused(view, q, L, causal, scale, vsg)
    mx.eval(fused_out, two, again)
    diff = float(mx.abs(fused_out.astype(mx.float32) - two.astype(mx.float32)).max())
    unit = 2.0 ** -10 * float(mx.abs(two.astype(mx.float32)).max())
    same = bool(mx.array_equal(fused_out, again))
    _record("mma-fused-merge", diff <= unit and same, f"{case} max_abs_diff={diff:.2e} unit={unit:.2e} "
            f"repeat_identical={same}")
    assert diff <= unit and same


@pytest.mark.gpu
def test_gpu_fused_merge_many_calls_at_once():
    """300 independent calls built first and evaluated together (MLX runs the kernels of a CUDA graph at once
    where nothing orders them): each equals the same call evaluated alone, bit for bit -- no two launches in
    flight shared a counter, and every counter was back at zero for the next."""
    c, _, _ = _cache((2, 2), 8, 3000, 128, seed=5)
    view = c.codes_view()
    vsg = kernel._folded_signs(view.value_codec, 1.0 / 128)
    qs = [mx.array(np.random.default_rng(i).standard_normal((1, 32, 1, 128)).astype(np.float32)).astype(mx.float16)
          for i in range(6)]
    alone = []
    for q in qs:
        alone.append(kernel_mma.launch_fused(view, q, 1, False, 0.088, vsg))
        mx.eval(alone[-1])
    outs = [kernel_mma.launch_fused(view, qs[i % 6], 1, False, 0.088, vsg) for i in range(300)]
    mx.eval(outs)
    bad = sum(not bool(mx.array_equal(o, alone[i % 6])) for i, o in enumerate(outs))
    _record("mma-fused-merge-concurrent", bad == 0, f"300 calls at once, {bad} differ from the call alone")
    assert bad == 0


@pytest.mark.gpu
@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: f"{c[0][0]}+{c[0][1]}-{c[1][:4]}-d{c[2]}-h{c[3]}g{c[4]}"
                         f"-L{c[5]}-n{c[6]}-b{c[7]}-w{c[8]}")
@pytest.mark.parametrize("swapped", [True, False], ids=["swap", "rows"])
def test_gpu_quick_maxima_and_late_norms_keep_every_bit(case, swapped, monkeypatch):
    """The split kernel skipping the maxima's shuffles where no score passes its row's running maximum
    (kernel_mma.QUICK_MAX), converting the norms late (LATE_NORMS) and building 4+2's table indices by bytes
    (BYTE_INDEX_42), reading the table by shared address (SHARED_ADDRESS 3, 2 and 1), taking two tiles a turn
    (TILE_PAIRS), asking L2 for tiles ahead (L2_PREFETCH 8 and 2) and copying tiles ahead into rings of shared
    memory (STAGES 4, 3 and 2) computes what the first order did: the partials
    o, m and l bit for bit, each setting against its first order's arm."""
    bits, residual, d, hkv, g, L, n, b, window = case
    monkeypatch.setattr(kernel_mma, "SWAPPED", swapped)
    c, _, _ = _cache(bits, hkv, n, d, b=b, window=window, residual=residual, seed=n + 5)
    view = c.codes_view()
    q = mx.array(np.random.default_rng(n + 6).standard_normal((b, hkv * g, L, d)).astype(np.float32)).astype(mx.float16)
    scale, causal = d ** -0.5, L > 1
    results = []
    for name, arms in _ARMS.items():
        parts, default = {}, getattr(kernel_mma, name)
        for on in arms:
            monkeypatch.setattr(kernel_mma, name, on)
            parts[on] = kernel_mma.launch(view, q, L, causal, scale)
            mx.eval(parts[on])
        monkeypatch.setattr(kernel_mma, name, default)
        for on in arms[:-1]:
            same = all(bool(mx.array_equal(x, y, equal_nan=True)) for x, y in zip(parts[on], parts[arms[-1]]))
            results.append((f"{name}={int(on)}", same))
    layout = "swap" if swapped and g * L <= 8 else "rows"
    ok = all(same for _, same in results)
    _record("mma-quick-max-late-norms", ok, f"{case} {layout} " + " ".join(f"{n} identical={s}" for n, s in results))
    assert ok, results


@pytest.mark.gpu
@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: f"{c[0][0]}+{c[0][1]}-{c[1][:4]}-d{c[2]}-h{c[3]}g{c[4]}"
                         f"-L{c[5]}-n{c[6]}-b{c[7]}-w{c[8]}")
@pytest.mark.parametrize("swapped", [True, False], ids=["swap", "rows"])
def test_gpu_quick_split_and_merge_against_the_first_versions(case, swapped, monkeypatch):
    """The split kernel with its setup's loads issued at once, the queries rotated by shuffles and (up to 4 rows)
    the warps merged in one round (kernel_mma.QUICK_SPLIT) against its first version: the same m and l bits (the
    same rotated queries, scores and softmax), o within 2^-20 of its scale (each warp's product is rounded
    before its sum, where a compiler may fuse the first version's; identical in every case recorded); the merge
    kernel reading the splits side by side and un-rotating by shuffles (kernel.QUICK_MERGE) gives its first
    version's bits on the same partials."""
    bits, residual, d, hkv, g, L, n, b, window = case
    monkeypatch.setattr(kernel_mma, "SWAPPED", swapped)
    c, _, _ = _cache(bits, hkv, n, d, b=b, window=window, residual=residual, seed=n + 2)
    view = c.codes_view()
    q = mx.array(np.random.default_rng(n + 3).standard_normal((b, hkv * g, L, d)).astype(np.float32)).astype(mx.float16)
    scale, causal, shape = d ** -0.5, L > 1, (b, hkv * g, L, d)
    parts = {}
    for quick in (True, False):
        monkeypatch.setattr(kernel_mma, "QUICK_SPLIT", quick)
        parts[quick] = kernel_mma.launch(view, q, L, causal, scale)
        mx.eval(parts[quick])
    merged = {}
    for quick in (True, False):
        monkeypatch.setattr(kernel, "QUICK_MERGE", quick)
        merged[quick] = kernel.merge(view, *parts[True], shape, mx.float16, "cuda")
        mx.eval(merged[quick])
    (o1, ml1), (o0, ml0) = parts[True], parts[False]
    same_ml = bool(mx.array_equal(ml1, ml0, equal_nan=True))
    err_o = float(mx.abs(o1 - o0).max()) / (float(mx.abs(o0).max()) + 1e-30)
    same_merge = bool(mx.array_equal(merged[True], merged[False], equal_nan=True))
    fin = np.isfinite(np.array(ml0)) & np.isfinite(np.array(ml1))
    d_ml = float(np.abs(np.array(ml1) - np.array(ml0))[fin].max()) if fin.any() else 0.0
    ok = same_ml and err_o <= 2.0 ** -20 and same_merge
    layout = "swap" if swapped and g * L <= 8 else "rows"
    _record("mma-quick-split-merge", ok, f"{case} {layout} ml identical={same_ml} (max diff {d_ml:.1e}) "
            f"o rel diff={err_o:.1e} "
            f"merge identical={same_merge}")
    assert ok, (same_ml, err_o, same_merge)
