"""The split-K attention kernel (kernels/rvq_attend.inc) on a GPU backend, and its model on every backend.

On the CPU: ``partials_reference`` (the kernel's outputs computed with MLX ops, same splits) merged by
``combine`` equals the MLX-ops formulation; the dispatch falls back and latches off when the kernel
fails. On a GPU (tests marked ``gpu``): the kernel's partials equal the model's to float32 rounding
(relative 1e-5: the kernel sums the D products and the tokens of a split in another order), and the
whole call equals decode-then-SDPA within the float16 bound of tests/test_attention.py. With
RVQ_ATTN_PARITY_REPORT=path each GPU comparison appends a line there (tools/results/gpu-parity-attention.txt).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQKVCache, fused
from rvqstore.attention import hook, kernel, ops
from gpu_report import record as _record  # noqa: E402


def _cache(bits, hkv, n, d, *, b=1, window=0, dtype=mx.float32, seed=0, residual="conditional"):
    rng = np.random.default_rng(seed)
    c = RVQKVCache(bits, residual=residual, dense_window=window, flush_block=8)
    k = mx.array(rng.standard_normal((b, hkv, n, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((b, hkv, n, d)).astype(np.float32)).astype(dtype)
    c.update_and_fetch(k[:, :, : n - 1], v[:, :, : n - 1])
    kk, vv = c.update_and_fetch(k[:, :, n - 1:], v[:, :, n - 1:])
    return c, kk, vv


def _queries(b, hq, L, d, dtype=mx.float32, seed=1):
    return mx.array(np.random.default_rng(seed).standard_normal((b, hq, L, d)).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("n,L,window,sinks", [(1000, 1, 0, False), (300, 1, 16, True), (130, 3, 8, False)])
def test_kernel_model_and_combine_equal_the_ops_formulation(n, L, window, sinks):
    hkv, g, d = 2, 4, 64
    c, _, _ = _cache((2, 2), hkv, n, d, window=window)
    view = c.codes_view()
    q = _queries(1, hkv * g, L, d)
    sk = mx.array(np.random.default_rng(2).standard_normal(hkv * g).astype(np.float32)) if sinks else None
    mask = "causal" if L > 1 else None
    with mx.stream(mx.cpu):  # float32 matmuls (a GPU backend may use TF32 for them)
        q_rot = ops.rotate_queries(view, q, 0.1).reshape(1, hkv, g * L, d)
        o, ml = kernel.partials_reference(view, q_rot, L, L > 1)
        assert o.shape[1] == kernel.split_plan(int(view.key_buffers[0].shape[-1]), hkv)[1]
        got = kernel.combine(view, q, 0.1, o, ml, mask, sk)
        ref = ops.attend(view, q, 0.1, mask, sk)
        mx.eval(got, ref)
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-6)


def test_split_plan_covers_every_token_once():
    for n in (1, 127, 128, 129, 1000, 32768, 131072):
        for bh in (1, 8, 64):
            chunk, splits = kernel.split_plan(n, bh)
            assert chunk % kernel.THREADS == 0 and (splits - 1) * chunk < n <= splits * chunk


@pytest.mark.parametrize("dk", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("bits", [(1, 1), (2, 2), (4, 2), (2, 4), (4, 4), (4, 0)])
def test_key_lanes_split_each_token_into_whole_word_steps(dk, rows, bits):
    """Each lane's coordinates are a multiple of 4 and of the word step; a step never straddles a word of
    either stage; forcing 1 gives the one-thread-per-token phase; an unfit forced count is not taken."""
    per_word = min(32 // bits[0], 32 // bits[1] if bits[1] else 32)
    for forced in (None, 1, 2, 8, 32):
        lanes, step = kernel.key_lanes(dk, rows, *bits, forced)
        cpl = dk // lanes
        assert 32 % lanes == 0 and dk % lanes == 0 and cpl % 4 == 0
        assert cpl % step == 0 and per_word % step == 0 and step >= 4
        if forced == 1:
            assert lanes == 1
        elif forced is not None and dk % (4 * forced) == 0:
            assert lanes == forced
    lanes, _ = kernel.key_lanes(dk, rows, *bits)
    # the register budget is kept wherever some lane count allows it
    if any(dk % (4 * kl) == 0 and rows * dk // kl <= kernel.KEY_REGISTERS for kl in (2, 4, 8, 16, 32)):
        assert rows * dk // lanes <= kernel.KEY_REGISTERS
    assert kernel.uses_pairs(*bits, lanes) == (sum(bits) <= kernel.PAIR_MAX_BITS and lanes > 1)
    assert not kernel.uses_pairs(*bits, 1)


def test_staged_code_words_stay_within_the_shared_memory_budget():
    """The 8B geometry stages its words at 2+2 (GQA 4 and 8) and 4+2 (GQA 4); shapes whose staging would
    pass the budget do not stage; switching staging off is obeyed."""
    assert kernel.stages_codes(2, 2, 128, 128, 4, 16, 8) and kernel.stages_codes(2, 2, 128, 128, 8, 16, 16)
    assert kernel.stages_codes(4, 2, 128, 128, 4, 64, 8)
    assert not kernel.stages_codes(4, 4, 256, 256, 8, 256, 32)
    for bits in ((1, 1), (2, 2), (4, 2), (4, 4)):
        for d in (64, 128, 256):
            for rows in (1, 4, 8):
                kl = kernel.key_lanes(d, rows, *bits)[0]
                if kernel.stages_codes(*bits, d, d, rows, 256, kl):
                    assert kernel.shared_bytes(*bits, d, d, rows, 256, kl, True) <= kernel.SHARED_BYTES
                # staging adds the words of one tile: 128 tokens x the words of a key and a value row
                words = 2 * (-(-d // (32 // bits[0])) + -(-d // (32 // bits[1])))
                extra = kernel.shared_bytes(*bits, d, d, rows, 256, kl, True) - kernel.shared_bytes(
                    *bits, d, d, rows, 256, kl, False)
                assert extra == 4 * (kernel.THREADS * words - 2) if kl > 1 else extra < 4 * kernel.THREADS * words
    old = kernel.STAGE_CODES
    try:
        kernel.STAGE_CODES = False
        assert not kernel.stages_codes(2, 2, 128, 128, 4, 16, 8)
    finally:
        kernel.STAGE_CODES = old


def test_value_coordinates_per_thread_keep_whole_rows(monkeypatch):
    """8 coordinates per thread only where asked and the value head dim is a multiple of 8 (80, 96, 128 yes;
    36 no); 4 where asked."""
    monkeypatch.setattr(kernel, "VALUE_COORDS", 8)
    for dv, want in ((36, 4), (64, 8), (80, 8), (96, 8), (128, 8), (256, 8)):
        assert kernel.value_coords(dv) == want
    monkeypatch.setattr(kernel, "VALUE_COORDS", 4)
    assert kernel.value_coords(128) == 4 and kernel.value_coords(36) == 4


def test_failing_kernel_falls_back_and_latches_off(monkeypatch, caplog):
    with mx.stream(mx.cpu):
        c, K, V = _cache((2, 2), 1, 40, 64)
        q = _queries(1, 4, 1, 64)
    for stream in (c._keys, c._values):  # only the attention kernel is faked: the codec stays on MLX ops
        stream.codec.use_kernels = False
    monkeypatch.setattr(fused, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(fused, "_on_gpu", lambda: True)
    monkeypatch.setattr(kernel, "_disabled", {})
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(kernel, "launch", broken)
    monkeypatch.setattr(kernel, "_verified", set())
    with mx.stream(mx.cpu):  # exact float32 matmuls for the comparison (a GPU may use TF32)
        with caplog.at_level("WARNING", logger="rvqstore.kernels"):
            a = c.attend_on_codes(q, scale=0.125)
            b = c.attend_on_codes(q, scale=0.125)
        assert len(calls) == 1 and "cuda" in kernel.disabled()
        assert sum("attention kernel" in r.message for r in caplog.records) == 1
        ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=0.125)
        np.testing.assert_allclose(np.array(a), np.array(ref), rtol=1e-5, atol=1e-6)
        assert mx.array_equal(a, b)


def test_kernel_declines_what_it_does_not_take():
    c, _, _ = _cache((3, 1), 1, 20, 64)
    assert kernel.supported(c.codes_view(), 4) == "3-bit codes"
    c, _, _ = _cache((2, 2), 1, 20, 64)
    assert kernel.supported(c.codes_view(), 16) is not None and kernel.supported(c.codes_view(), 8) is None


# ---- on the GPU ------------------------------------------------------------------------------------------
GPU_CASES = [
    # (bits, residual, d, hkv, group, L, n, b, window)
    ((2, 2), "conditional", 128, 8, 4, 1, 1000, 1, 0),
    ((2, 2), "conditional", 128, 2, 8, 1, 4097, 1, 0),
    ((4, 2), "conditional", 128, 8, 4, 1, 777, 1, 16),
    ((4, 2), "conditional", 64, 3, 3, 1, 129, 2, 0),
    ((2, 2), "conditional", 64, 2, 1, 1, 1, 1, 0),
    ((2, 2), "shared", 96, 2, 4, 2, 333, 1, 0),
    ((1, 1), "conditional", 256, 1, 8, 1, 513, 1, 8),
    ((4, 0), "conditional", 80, 2, 2, 2, 70, 1, 0),
    ((4, 4), "conditional", 128, 4, 2, 4, 2048, 1, 0),
    ((2, 4), "conditional", 128, 8, 1, 1, 33000, 1, 0),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"{c[0][0]}+{c[0][1]}-{c[1][:4]}-d{c[2]}-h{c[3]}g{c[4]}"
                         f"-L{c[5]}-n{c[6]}-b{c[7]}-w{c[8]}")
def test_gpu_kernel_parity(case):
    bits, residual, d, hkv, g, L, n, b, window = case
    dialect = fused.gpu_backend()
    c, K, V = _cache(bits, hkv, n, d, b=b, window=window, residual=residual, seed=n)
    view = c.codes_view()
    assert kernel.supported(view, g * L) is None
    q = _queries(b, hkv * g, L, d, seed=d)
    q_rot = ops.rotate_queries(view, q, d ** -0.5).reshape(b, hkv, g * L, d)
    o, ml = kernel.launch(view, q_rot, L, L > 1, dialect)
    with mx.stream(mx.cpu):  # the model in exact float32 (GPU matmuls may run in TF32)
        ro, rml = kernel.partials_reference(view, q_rot, L, L > 1)
        mx.eval(ro, rml)
    scale_o = float(mx.abs(ro).max()) + 1e-30
    err_o = float(mx.abs(o - ro).max()) / scale_o
    m, rm = np.array(ml[..., 0]), np.array(rml[..., 0])
    same_inf = bool(np.array_equal(np.isinf(m), np.isinf(rm)))
    fin = np.isfinite(rm)
    err_m = float(np.abs(m[fin] - rm[fin]).max()) if fin.any() else 0.0
    err_l = float(mx.abs(ml[..., 1] - rml[..., 1]).max() / (mx.abs(rml[..., 1]).max() + 1e-30))
    ok = err_o < 1e-5 and err_l < 1e-5 and err_m < 1e-4 and same_inf
    _record("partials", ok, f"{case} rel_err o={err_o:.2e} l={err_l:.2e} abs_err m={err_m:.2e}")
    assert ok, (err_o, err_l, err_m, same_inf)
    # the whole call (kernel + combine) vs decode-then-SDPA, float16 inputs
    c16, K16, V16 = _cache(bits, hkv, n, d, b=b, window=window, residual=residual, seed=n, dtype=mx.float16)
    q16 = q.astype(mx.float16)
    mask = "causal" if L > 1 else None
    got = c16.attend_on_codes(q16, scale=d ** -0.5, mask=mask)
    ref = mx.fast.scaled_dot_product_attention(q16, K16, V16, scale=d ** -0.5, mask=mask)
    err = float(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max())
    bound = 4 * 2.0 ** -11 * float(mx.abs(V16.astype(mx.float32)).max())
    _record("attend-fp16-vs-sdpa", err <= bound, f"{case} max_abs_err={err:.2e} bound={bound:.2e}")
    assert err <= bound and not kernel.disabled()


@pytest.mark.gpu
@pytest.mark.parametrize("bits,d,hkv,g", [((2, 2), 128, 8, 4), ((4, 2), 128, 2, 8), ((2, 2), 64, 4, 2)])
def test_gpu_kernel_variants_equal_the_model(monkeypatch, bits, d, hkv, g):
    """Every kernel layout (1 to 32 lanes per token in the key phase, pair tables and staged code words on
    and off, 4 or 8 coordinates per thread in the value phase) gives the model's partials."""
    dialect = fused.gpu_backend()
    c, _, _ = _cache(bits, hkv, 1500, d, seed=7)
    view = c.codes_view()
    q_rot = ops.rotate_queries(view, _queries(1, hkv * g, 1, d, seed=3), d ** -0.5).reshape(1, hkv, g, d)
    with mx.stream(mx.cpu):
        ro, rml = kernel.partials_reference(view, q_rot, 1, False)
        mx.eval(ro, rml)
    scale_o = float(mx.abs(ro).max())
    for lanes, pairs, stage, vpl in ((1, False, False, 4), (1, False, True, 8), (2, True, True, 4),
                                     (8, True, True, 8), (8, True, True, 4), (8, False, False, 8), (32, True, False, 4)):
        monkeypatch.setattr(kernel, "VALUE_COORDS", vpl)
        monkeypatch.setattr(kernel, "KEY_LANES", lanes)
        monkeypatch.setattr(kernel, "PAIR_TABLES", pairs)
        monkeypatch.setattr(kernel, "STAGE_CODES", stage)
        o, ml = kernel.launch(view, q_rot, 1, False, dialect)
        err_o = float(mx.abs(o - ro).max()) / scale_o
        err_l = float(mx.abs(ml[..., 1] - rml[..., 1]).max() / mx.abs(rml[..., 1]).max())
        m, rm = np.array(ml[..., 0]), np.array(rml[..., 0])
        fin = np.isfinite(rm)  # splits past the coded tokens are empty (-inf) in both
        err_m = float(np.abs(m[fin] - rm[fin]).max())
        ok = err_o < 1e-5 and err_l < 1e-5 and err_m < 1e-4 and np.array_equal(np.isinf(m), np.isinf(rm))
        kl = kernel.key_lanes(d, g, *bits, lanes)[0]
        staged = kernel.stages_codes(*bits, d, d, g, kernel.decode_table(view.key_codec)[1], kl)
        _record("kernel-variant", ok, f"{bits} d={d} rows={g} lanes={kl} pairs={kernel.uses_pairs(*bits, kl)} "
                f"staged={staged} value_coords={kernel.value_coords(d)} rel_err o={err_o:.2e} l={err_l:.2e} abs_err m={err_m:.2e}")
        assert ok, (lanes, pairs, stage, vpl, err_o, err_l, err_m)


@pytest.mark.gpu
def test_gpu_greedy_random_model_matches_decode_then_sdpa():
    """48 greedy tokens of a random-weight llama (GQA 4, head dim 128, fp16) on the GPU: codes == SDPA."""
    from tiny_models import gpu_llama

    from rvqstore import make_prompt_cache

    model = gpu_llama()
    prompt = mx.array(np.random.default_rng(0).integers(0, 512, (1, 200)))

    def run():
        cache = make_prompt_cache(model, (4, 2))
        logits = model(prompt, cache=cache)[:, -1]
        out = []
        for _ in range(48):
            y = mx.argmax(logits, axis=-1)
            out.append(int(y.item()))
            logits = model(y[None], cache=cache)[:, -1]
        return out

    codes = run()
    with hook.bypass():
        ref = run()
    first = next((i for i, (a, b) in enumerate(zip(codes, ref)) if a != b), None)
    _record("greedy-random-llama-48", codes == ref, f"first difference at {first}")
    assert codes == ref
