"""Attention on the packed codes (rvqstore.attention) against decode-then-SDPA on the same codes.

Tolerance: the reference decodes the codes to the cache dtype and runs mx.fast.scaled_dot_product_attention
there; the codes path works in float32 throughout and rounds once at the end. So in float32 the two
agree to float32 rounding of sums over D and T terms (measured <= 1e-6; bound 2e-5 x max|out|), and in
float16 to a few float16 roundings: of each decoded key and value (relative 2^-11 each), of the scores
and of the output; bound 4 x 2^-11 x max|V| (4 half-ulps at the values' scale; measured up to 2.5).
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from rvqstore import RVQKVCache
from rvqstore.attention import hook, ops
from rvqstore.errors import InputShapeError


@pytest.fixture(autouse=True)
def _on_cpu():
    """These tests pin the formulation against float32 references: run them on the CPU, where float32
    matmuls are exact float32 (a GPU backend may use TF32). The GPU kernel has tests/test_attention_gpu.py."""
    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(prev)


def _kv(b, h, t, d, dtype, seed):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, h, t, d)).astype(np.float32)
    v = rng.standard_normal((b, h, t, d)).astype(np.float32)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def _tolerance(dtype, v, ref):
    if dtype == mx.float32:
        return 2e-5 * max(1.0, float(mx.abs(ref).max()))
    return 4 * 2.0 ** -11 * float(mx.abs(v.astype(mx.float32)).max())


def _check(cache, q, K, V, scale, mask, sinks=None):
    ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=scale, mask=mask, sinks=sinks)
    got = cache.attend_on_codes(q, scale=scale, mask=mask, sinks=sinks)
    assert got is not None and got.shape == ref.shape and got.dtype == ref.dtype
    err = float(mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max())
    assert err <= _tolerance(q.dtype, V, ref), err
    return err


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("d,hkv,group,n,window,bits", [
    (64, 2, 1, 37, 0, (2, 2)), (64, 1, 4, 129, 16, (4, 2)), (128, 1, 8, 61, 0, (4, 2)),
    (96, 2, 4, 45, 8, (2, 2)), (80, 1, 8, 33, 4, (2, 2)), (128, 2, 4, 70, 0, (3, 1)), (32, 4, 1, 9, 0, 4),
])
def test_decode_step_matches_decode_then_sdpa(dtype, d, hkv, group, n, window, bits):
    cache = RVQKVCache(bits, dense_window=window, flush_block=8)
    k, v = _kv(1, hkv, n, d, dtype, seed=d + n)
    cache.update_and_fetch(k[:, :, :-1], v[:, :, :-1])
    K, V = cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
    assert (cache.n_dense > 0) == (window > 0) and cache.n_coded > 0
    q = mx.array(np.random.default_rng(n).standard_normal((1, hkv * group, 1, d)).astype(np.float32)).astype(dtype)
    for mask in (None, "causal", create_causal_mask(1, n - 1, window_size=11)):
        _check(cache, q, K, V, d ** -0.5, mask)


@pytest.mark.parametrize("window", [0, 8])
def test_several_queries_masks_batches_and_sinks(window):
    b, hkv, group, d, n, L = 2, 2, 4, 64, 51, 5
    cache = RVQKVCache((2, 2), dense_window=window, flush_block=4)
    k, v = _kv(b, hkv, n, d, mx.float32, seed=3)
    K, V = cache.update_and_fetch(k, v)
    q = mx.array(np.random.default_rng(4).standard_normal((b, hkv * group, L, d)).astype(np.float32))
    sinks = mx.array(np.random.default_rng(5).standard_normal(hkv * group).astype(np.float32))
    additive = mx.where(create_causal_mask(L, n - L), 0.0, -1e9)  # additive float mask
    per_head = mx.broadcast_to(create_causal_mask(L, n - L, window_size=7), (b, hkv * group, L, n))
    for mask in ("causal", create_causal_mask(L, n - L, window_size=7), additive, per_head):
        _check(cache, q, K, V, 0.125, mask)
    _check(cache, q, K, V, 0.125, "causal", sinks=sinks)


def test_all_tokens_in_window_and_resident_mode_defer_to_sdpa():
    cache = RVQKVCache((2, 2), dense_window=64)
    k, v = _kv(1, 1, 10, 64, mx.float32, 0)
    K, V = cache.update_and_fetch(k, v)
    assert cache.n_coded == 0
    _check(cache, mx.ones((1, 2, 1, 64)), K, V, 0.1, None)  # window only: still one softmax, exact inputs
    resident = RVQKVCache((2, 2), mode="resident")
    resident.update_and_fetch(k, v)
    assert resident.attend_on_codes(mx.ones((1, 2, 1, 64)), scale=0.1) is None


def test_bad_queries_and_masks_get_typed_errors():
    cache = RVQKVCache((2, 2))
    k, v = _kv(1, 2, 12, 64, mx.float32, 0)
    cache.update_and_fetch(k, v)
    with pytest.raises(InputShapeError):
        cache.attend_on_codes(mx.ones((1, 3, 1, 64)), scale=1.0)  # 3 heads over 2 KV heads
    with pytest.raises(InputShapeError):
        cache.attend_on_codes(mx.ones((1, 2, 1, 32)), scale=1.0)
    with pytest.raises(InputShapeError):
        cache.attend_on_codes(mx.ones((1, 2, 1, 64)), scale=1.0, mask="sliding")
    with pytest.raises(InputShapeError):
        cache.attend_on_codes(mx.ones((1, 4, 1, 64)), scale=1.0, mask=mx.ones((1, 3, 1, 12), mx.bool_))
    assert cache.offset == 12 and cache.n_coded == 12  # a failed call leaves the cache as it was


def test_rotated_domain_identity():
    # q . k == s_k * (q_rot . y_k): the identity the whole formulation rests on
    cache = RVQKVCache((4, 2))
    k, v = _kv(1, 1, 16, 128, mx.float32, 7)
    K, _ = cache.update_and_fetch(k, v)
    view = cache.codes_view()
    q = mx.array(np.random.default_rng(8).standard_normal((1, 1, 1, 128)).astype(np.float32))
    yk, sk = view.rotated_keys()
    direct = (q @ K.swapaxes(-1, -2))[0, 0, 0]
    via = (ops.rotate_queries(view, q, 1.0) @ yk.swapaxes(-1, -2))[0, 0, 0] * sk[0, 0]
    np.testing.assert_allclose(np.array(via), np.array(direct), rtol=1e-5, atol=1e-5)


# ---- the mlx-lm hook ---------------------------------------------------------------------------------------
_TINY = {
    "llama": dict(model_type="llama", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32),
    "qwen3": dict(model_type="qwen3", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, max_position_embeddings=512, rope_theta=10000.0),
    "gemma3_text": dict(model_type="gemma3_text", num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=32, sliding_window=8, sliding_window_pattern=3,
                        query_pre_attn_scalar=32, max_position_embeddings=512),
}


def _tiny(arch):
    import importlib

    cfg = dict(vocab_size=96, hidden_size=64, intermediate_size=128, rms_norm_eps=1e-5,
               tie_word_embeddings=True, **_TINY[arch])
    mod = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(0)
    model = mod.Model(mod.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    return model, mod


@pytest.mark.parametrize("arch", sorted(_TINY))
def test_hook_serves_each_architecture_from_the_codes(arch, monkeypatch):
    from rvqstore import make_prompt_cache

    model, mod = _tiny(arch)
    cache = make_prompt_cache(model, (4, 2))
    assert hook.hooked(mod) and hook.hooked(sys.modules["mlx_lm.models.base"])
    served, errors = [], []
    real = RVQKVCache.attend_on_codes

    def spy(self, queries, *, scale, mask=None, sinks=None):
        out = real(self, queries, scale=scale, mask=mask, sinks=sinks)
        K, V = self._fetch()
        ref = mx.fast.scaled_dot_product_attention(queries, K, V, scale=scale, mask=mask, sinks=sinks)
        errors.append(float(mx.abs(out - ref).max()))
        served.append(queries.shape[2])
        return out

    monkeypatch.setattr(RVQKVCache, "attend_on_codes", spy)
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]])
    logits = model(tokens, cache=cache)
    for t in (5, 9, 2):
        logits = model(mx.array([[t]]), cache=cache)
    mx.eval(logits)
    rvq_layers = sum(isinstance(c, RVQKVCache) for c in cache)
    assert rvq_layers >= 1 and served.count(1) == 3 * rvq_layers and served.count(12) == rvq_layers
    assert max(errors) < 1e-4


def test_hook_install_is_idempotent_and_uninstall_restores():
    import mlx_lm.models.base as base
    import mlx_lm.models.llama as llama

    hook.install()
    wrapped = base.scaled_dot_product_attention
    hook.install()
    assert base.scaled_dot_product_attention is wrapped and llama.scaled_dot_product_attention is wrapped
    original = wrapped.__wrapped__
    hook.uninstall()
    try:
        assert base.scaled_dot_product_attention is original and llama.scaled_dot_product_attention is original
    finally:
        hook.install()
    assert hook.hooked(llama)


def test_greedy_smollm2_matches_decode_then_sdpa(smollm2, sample_tokens):
    """64 greedy tokens on the bundled model: at every step, attention on codes and decode-then-SDPA over the
    same cache give the same token, and logits within 1e-4 wherever both steps stored the same keys and values
    for the step's own token.

    In lockstep (each step taken with decode-then-SDPA, trimmed back, then taken on the codes, which the
    generation continues from), not as two free runs: in two runs the last-bit differences of the two
    formulations change the next layers' keys by ~1e-6, which now and then moves one across a quantization
    boundary; from that token on the runs hold different codes (measured on this prompt: every logit within
    3e-5 for 21 steps, then a value code of layer 5 differs and the logits by 0.06-0.5). In lockstep the earlier
    tokens' codes are shared, but the step's own token is coded by each path from its own activations, so the
    same boundary crossing can give it a different code in a later layer: seen in 2 to 7 steps of 64, logits
    within 0.06, and how often depends on the machine's BLAS. Such a step is recognised by its own token's
    decoded keys or values differing by more than rounding (a code flip moves a decoded value by a codebook
    step, ~1e-2, against ~1e-6 of rounding); it is held to the looser bound only."""
    from rvqstore import make_prompt_cache
    from rvqstore.generation import prefill

    model, _ = smollm2
    cache = make_prompt_cache(model)
    logits = prefill(model, sample_tokens[:96], cache)

    def own_token_kv():
        return [tuple(x[:, :, -1:, :] for x in c.keys_and_values()) for c in cache]

    exact, flipped = [], []
    for _ in range(64):
        y = mx.argmax(logits, axis=-1)
        with hook.bypass():
            reference = model(y[:, None], cache=cache)[:, -1, :]
            reference_kv = own_token_kv()
            mx.eval(reference, reference_kv)
        for c in cache:
            c.trim(1)
        logits = model(y[:, None], cache=cache)[:, -1, :]
        assert int(mx.argmax(logits, axis=-1).item()) == int(mx.argmax(reference, axis=-1).item())
        kv_gap = max(float(mx.abs(a - b).max().item())
                     for pair, ref in zip(own_token_kv(), reference_kv) for a, b in zip(pair, ref))
        (flipped if kv_gap > 1e-3 else exact).append(float(mx.abs(logits - reference).max().item()))
    assert len(exact) >= 48 and max(exact) < 1e-4, (exact, flipped)
    assert not flipped or max(flipped) < 0.1, flipped
    assert cache[0].offset == 96 + 64 and cache[0].mode == "packed"


def test_resumed_packed_cache_attends_from_the_files_codes(tmp_path):
    """Resume without decoding: a loaded packed cache holds only the file's codes and serves attention
    from them, with the very result the saved cache gives."""
    import rvqstore

    caches = [RVQKVCache((2, 2)) for _ in range(2)]
    for i, c in enumerate(caches):
        c.update_and_fetch(*_kv(1, 2, 77, 64, mx.float16, seed=i))
    rvqstore.save_prompt_cache(tmp_path / "p.rvq", caches)
    loaded = rvqstore.load_prompt_cache(tmp_path / "p.rvq")
    q = mx.array(np.random.default_rng(9).standard_normal((1, 8, 1, 64)).astype(np.float32)).astype(mx.float16)
    for a, b in zip(caches, loaded):
        assert b.mode == "packed" and b._mode.nbytes == 0 and b.n_coded == 77
        assert b.nbytes == b.packed_nbytes  # codes and scales only: nothing was decoded
        assert mx.array_equal(a.attend_on_codes(q, scale=0.125), b.attend_on_codes(q, scale=0.125))


# ---- the CPU formulations: host (numpy) and MLX ops, each against decode-then-SDPA --------------------------
def _engines(view, q, scale, mask, sinks=None):
    """Both formulations on one call: ``{"host": out or None, "ops": out}``."""
    from rvqstore.attention import host

    return {"host": host.attend(view, q, scale, mask, sinks), "ops": ops.attend(view, q, scale, mask, sinks)}


@pytest.mark.parametrize("d,hkv,group,n,window,bits", [
    (64, 3, 3, 41, 0, (2, 2)), (64, 3, 3, 1, 0, (4, 2)), (128, 1, 4, 67, 8, (4, 2)), (64, 2, 1, 23, 4, (2, 2)),
    (128, 2, 3, 19, 0, (3, 1)), (64, 1, 4, 33, 0, (4, 4)), (64, 2, 3, 29, 0, (1, 2)), (64, 1, 1, 17, 0, 2),
])
def test_host_and_ops_formulations_match_decode_then_sdpa(d, hkv, group, n, window, bits):
    """Every config through both engines directly (dispatch would hide one of them): GQA 1/3/4, dims
    64/128, odd lengths, windows, bits 2+2/4+2/4+4/1+2/2 and 3+1 (no group tables: the host path
    declines and the ops path serves)."""
    cache = RVQKVCache(bits, dense_window=window, flush_block=4)
    k, v = _kv(1, hkv, n, d, mx.float32, seed=n + d)
    K, V = cache.update_and_fetch(k, v)
    view = cache.codes_view()
    q = mx.array(np.random.default_rng(n).standard_normal((1, hkv * group, 1, d)).astype(np.float32))
    for mask in (None, "causal", create_causal_mask(1, n - 1, window_size=5)):
        ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=d ** -0.5, mask=mask)
        got = _engines(view, q, d ** -0.5, mask)
        assert (got["host"] is None) == (bits == (3, 1))
        for name, out in got.items():
            if out is not None:
                err = float(mx.abs(out - ref).max())
                assert out.shape == ref.shape and out.dtype == ref.dtype and err <= _tolerance(mx.float32, V, ref), (name, err)


@pytest.mark.parametrize("window", [0, 8])
def test_host_and_ops_with_several_queries_masks_batches_and_sinks(window, monkeypatch):
    from rvqstore.attention import host

    b, hkv, group, d, n, L = 2, 2, 3, 64, 51, 5
    monkeypatch.setattr(host, "BLOCK_VECTORS", b * hkv * 16)  # token blocks of 16, the last one partial (43 coded)
    monkeypatch.setattr(host, "MAX_SCORES", b * hkv * group * n * 2)  # queries in blocks of 2, 2, 1
    cache = RVQKVCache((4, 2), dense_window=window, flush_block=4)
    k, v = _kv(b, hkv, n, d, mx.float16, seed=13)
    K, V = cache.update_and_fetch(k, v)
    view = cache.codes_view()
    q = mx.array(np.random.default_rng(14).standard_normal((b, hkv * group, L, d)).astype(np.float32)).astype(mx.float16)
    sinks = mx.array(np.random.default_rng(15).standard_normal(hkv * group).astype(np.float32)).astype(mx.float16)
    additive = mx.where(create_causal_mask(L, n - L), 0.0, -1e9).astype(mx.float16)
    per_head = mx.broadcast_to(create_causal_mask(L, n - L, window_size=7), (b, hkv * group, L, n))
    for mask, s in (("causal", None), (create_causal_mask(L, n - L, window_size=7), None), (additive, None),
                    (per_head, None), ("causal", sinks)):
        ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=0.125, mask=mask, sinks=s)
        for name, out in _engines(view, q, 0.125, mask, s).items():
            err = float(mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max())
            assert out.dtype == mx.float16 and err <= _tolerance(mx.float16, V, ref), (name, err)


def test_host_path_declines_under_function_transformations():
    """Inside mx.compile arrays cannot be evaluated: the host path returns None and the call is served
    by the MLX-ops formulation, with the same result as the eager (host) call."""
    from rvqstore.attention import host

    cache = RVQKVCache((2, 2))
    K, V = cache.update_and_fetch(*_kv(1, 3, 45, 64, mx.float32, seed=21))
    q = mx.array(np.random.default_rng(22).standard_normal((1, 9, 1, 64)).astype(np.float32))
    seen = []

    def traced(x):
        seen.append(host.attend(cache.codes_view(), x, 0.125))
        return cache.attend_on_codes(x, scale=0.125)

    compiled = mx.compile(traced)(q)
    assert seen == [None]
    eager = cache.attend_on_codes(q, scale=0.125)
    ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=0.125)
    assert float(mx.abs(compiled - ref).max()) <= _tolerance(mx.float32, V, ref)
    assert float(mx.abs(eager - ref).max()) <= _tolerance(mx.float32, V, ref)


def test_host_path_keeps_numpys_blas_to_one_thread_and_restores_it():
    from rvqstore.attention import host_blas

    api = host_blas._functions()
    if sys.platform.startswith("linux"):  # numpy's Linux wheels bundle OpenBLAS: it must be found
        assert api, "numpy's OpenBLAS was not found"
    if api:
        get, set_ = api
        before = get()
        set_(2)
        try:
            with host_blas.one_thread():
                assert get() == 1
            assert get() == 2
        finally:
            set_(before)


def test_short_caches_on_cuda_leave_attention_to_decode_then_sdpa(monkeypatch):
    """dispatch.MIN_TOKENS_ON_CODES_CUDA: on CUDA a cache holding fewer tokens declines attention on its codes, and
    the model's call runs mlx-lm's SDPA on what update_and_fetch handed out (the bypass's result, bit for bit); at
    or above it, or off CUDA, or with the setting at 0 (the default), the codes serve. CUDA is stood in for where
    dispatch asks, so the CPU's host path serves the calls that are not declined."""
    import types

    from rvqstore import make_prompt_cache
    from rvqstore.attention import dispatch

    fake = types.SimpleNamespace(gpu_backend=lambda: "cuda", _on_gpu=lambda: True)
    monkeypatch.setattr(dispatch, "fused", fake)
    model, _ = _tiny("llama")
    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]])
    outs = {}
    for name, threshold in (("declined", 64), ("codes", 0)):
        monkeypatch.setattr(dispatch, "MIN_TOKENS_ON_CODES_CUDA", threshold)
        cache = make_prompt_cache(model, (4, 2))
        model(tokens, cache=cache)
        served = []
        real = RVQKVCache.attend_on_codes
        monkeypatch.setattr(RVQKVCache, "attend_on_codes", lambda self, q, **kw: served.append(
            real(self, q, **kw)) or served[-1])
        step = model(mx.array([[7]]), cache=cache)
        monkeypatch.setattr(RVQKVCache, "attend_on_codes", real)
        for c in cache:
            c.trim(1)
        with hook.bypass():
            reference = model(mx.array([[7]]), cache=cache)
        mx.eval(step, reference)
        outs[name] = (served, bool(mx.array_equal(step, reference)), float(mx.abs(step - reference).max()))
    served, same, _ = outs["declined"]
    assert served and all(o is None for o in served) and same  # 11 tokens < 64: decode-then-SDPA, the bypass's bits
    served, _, diff = outs["codes"]
    assert served and all(o is not None for o in served) and diff < 1e-3  # served from the codes
    assert dispatch.decode_first(0) is False  # the setting at 0: never
    monkeypatch.setattr(dispatch, "MIN_TOKENS_ON_CODES_CUDA", 64)
    assert dispatch.decode_first(63) and not dispatch.decode_first(64)
    fake.gpu_backend = lambda: "metal"  # not CUDA: the setting does not apply
    assert not dispatch.decode_first(10)


def test_prefill_sized_calls_on_the_cpu_are_served_from_the_codes():
    """On the CPU the host formulation takes calls of any number of queries (a prefill chunk, here 40, more
    than MAX_QUERIES_ON_CODES), in bounded query blocks, and matches decode-then-SDPA; where it declines
    (3-bit stages: no group tables) a call that long goes to decode-then-SDPA (None), a short one to the
    MLX-ops formulation."""
    from rvqstore.attention import dispatch

    hkv, group, d, n, L = 2, 3, 64, 90, 40
    assert L > dispatch.MAX_QUERIES_ON_CODES
    k, v = _kv(1, hkv, n, d, mx.float32, seed=21)
    q = mx.array(np.random.default_rng(22).standard_normal((1, hkv * group, L, d)).astype(np.float32))
    for bits in ((2, 2), (3, 1)):
        cache = RVQKVCache(bits, flush_block=4)
        K, V = cache.update_and_fetch(k, v)
        got = cache.attend_on_codes(q, scale=d ** -0.5, mask="causal")
        if bits == (3, 1):
            assert got is None
            short = cache.attend_on_codes(q[:, :, -3:], scale=d ** -0.5, mask="causal")
            ref = mx.fast.scaled_dot_product_attention(q[:, :, -3:], K, V, scale=d ** -0.5, mask="causal")
            assert short is not None and float(mx.abs(short - ref).max()) <= _tolerance(mx.float32, V, ref)
            continue
        ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=d ** -0.5, mask="causal")
        assert got is not None and got.shape == ref.shape
        assert float(mx.abs(got - ref).max()) <= _tolerance(mx.float32, V, ref)


def test_calls_the_kernels_do_not_take_on_cuda_use_the_mlx_ops_formulation_only_on_long_caches(monkeypatch):
    """dispatch.MIN_TOKENS_FOR_OPS_CUDA: on CUDA (stood in for where dispatch asks; the host path off, no kernel)
    a call on a cache shorter than the threshold declines (decode-then-SDPA serves it); at or above it the MLX-ops
    formulation serves, with ops.attend's result; on Metal the threshold does not apply."""
    import types

    from rvqstore.attention import dispatch

    fake = types.SimpleNamespace(gpu_backend=lambda: "cuda", _on_gpu=lambda: True)
    monkeypatch.setattr(dispatch, "fused", fake)
    monkeypatch.setattr(dispatch.host, "on_cpu", lambda: False)
    monkeypatch.setattr(dispatch.kernel, "attend", lambda *a, **kw: None)
    hkv, group, d, n = 2, 4, 64, 70
    cache = RVQKVCache((4, 2), flush_block=4)
    k, v = _kv(1, hkv, n, d, mx.float32, seed=31)
    cache.update_and_fetch(k, v)
    view = cache.codes_view()
    q = mx.array(np.random.default_rng(32).standard_normal((1, hkv * group, 3, d)).astype(np.float32))
    assert dispatch.MIN_TOKENS_FOR_OPS_CUDA > n
    assert dispatch.attend(view, q, 0.125, "causal") is None
    monkeypatch.setattr(dispatch, "MIN_TOKENS_FOR_OPS_CUDA", n)
    got = dispatch.attend(view, q, 0.125, "causal")
    assert got is not None and mx.array_equal(got, ops.attend(view, q, 0.125, "causal"))
    monkeypatch.setattr(dispatch, "MIN_TOKENS_FOR_OPS_CUDA", n + 1)
    fake.gpu_backend = lambda: "metal"
    assert dispatch.attend(view, q, 0.125, "causal") is not None


def test_calls_in_too_many_query_blocks_on_the_cpu_go_to_decode_then_sdpa(monkeypatch):
    """dispatch.MAX_QUERY_BLOCKS_ON_CPU: the host formulation gathers every code row again per block of queries, so
    a call it would run in more blocks than the limit declines (None: decode-then-SDPA); up to it, it is served."""
    from rvqstore.attention import dispatch, host

    hkv, group, d, n, L = 1, 2, 64, 40, 24
    cache = RVQKVCache((2, 2), flush_block=4)
    k, v = _kv(1, hkv, n, d, mx.float32, seed=41)
    K, V = cache.update_and_fetch(k, v)
    q = mx.array(np.random.default_rng(42).standard_normal((1, hkv * group, L, d)).astype(np.float32))
    monkeypatch.setattr(host, "MAX_SCORES", hkv * group * n * 3)  # 3 queries per block: 8 blocks
    assert host.query_blocks(1, hkv * group, n, L) == 8
    monkeypatch.setattr(dispatch, "MAX_QUERY_BLOCKS_ON_CPU", 7)
    assert cache.attend_on_codes(q, scale=0.125, mask="causal") is None
    assert cache.attend_on_codes(q[:, :, -18:], scale=0.125, mask="causal") is not None  # 6 blocks, > 16 queries
    monkeypatch.setattr(dispatch, "MAX_QUERY_BLOCKS_ON_CPU", 8)
    got = cache.attend_on_codes(q, scale=0.125, mask="causal")
    ref = mx.fast.scaled_dot_product_attention(q, K, V, scale=0.125, mask="causal")
    assert got is not None and float(mx.abs(got - ref).max()) <= _tolerance(mx.float32, V, ref)
