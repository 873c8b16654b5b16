"""Codec state of RVQKVCache (issue 11, rvqstore.cache_state): sink tokens kept in full precision and a
per-head key mean subtracted before coding.

The evaluation's simulation (tools/quality/protocol.py ``SimCache`` with ``Method(sink=1,
center_keys=True)``) is the reference: on float32 inputs the cache hands out bit for bit what it does,
through a real model (SmolLM2) in both modes, with prompts in chunks and single-token steps (so the
compiled step paths run too). Then the contract's corners (a sink longer than the first update, the
window, trim into the sink, typed errors, unchanged caches after refused calls), attention on codes
against decode-then-SDPA, mlx-lm's own save/load, and the CUDA step paths on a stand-in device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from rvqstore import RVQCodec, RVQKVCache, cache_append, cache_fetch, fused
from rvqstore.attention import hook
from rvqstore.errors import CodecConfigError, InputShapeError, InvalidArgumentError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

from quality import methods as M  # noqa: E402
from quality.protocol import SimCache  # noqa: E402


@pytest.fixture(autouse=True)
def _on_cpu():
    """float32 references: run on the CPU (a GPU backend may use TF32 matmuls)."""
    prev = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(prev)


def _kv(t, seed, b=1, h=2, d=64, dtype=mx.float32, offset=3.0):
    """Keys with a common offset per head (what the mean takes out) and values, (B, H, t, D)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, h, t, d)) + offset * rng.standard_normal((b, h, 1, d))
    v = rng.standard_normal((b, h, t, d))
    return mx.array(k.astype(np.float32)).astype(dtype), mx.array(v.astype(np.float32)).astype(dtype)


def _same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(mx.array_equal(a, b, equal_nan=True).item())


def _held(c: RVQKVCache) -> list:
    return [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) if isinstance(a, mx.array) else a
            for a in c.state]


# ---- the evaluation's simulation, through a real model ------------------------------------------------
@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_smollm2_logits_equal_the_simulation_bit_for_bit(smollm2, sample_tokens, mode):
    model, _ = smollm2
    method = M.variant(M.uniform(M.rvq((4, 2)), "RVQ"), sink=1, center_keys=True)
    ids = mx.array(sample_tokens[:40])[None]
    sim = [SimCache(i, method) for i in range(len(model.layers))]
    rvq = [RVQKVCache((4, 2), mode=mode, sink_tokens=1, center_keys=True) for _ in model.layers]
    with hook.bypass():  # both through mlx-lm's SDPA on what the caches hand out
        start = 0
        for n in (20, 1, 1, 9, 1, 1):  # a prompt in chunks, then single-token steps
            a = model(ids[:, start:start + n], cache=sim)
            b = model(ids[:, start:start + n], cache=rvq)
            assert _same(a, b), f"logits differ after {start + n} tokens"
            start += n
    c = rvq[5]
    assert c.n_sink == 1 and c.n_coded == 32 and c.key_mean.dtype == mx.float16
    assert not c._steps_off  # the compiled step paths served the single-token steps
    assert _same(c.key_mean.astype(mx.float32)[:, :, None], sim[5].key_mean)


def test_key_mean_comes_from_the_first_coded_tokens_not_the_sink():
    """Where the first update holds only the sink, the mean waits for the first coded tokens (the
    simulation would take it from the sink token itself: the state design fixes this rule)."""
    c = RVQKVCache((4, 2), sink_tokens=1, center_keys=True)
    k0, v0 = _kv(1, 0)
    c.update_and_fetch(k0, v0)
    assert c.key_mean is None and c.n_sink == 1 and c.n_coded == 0
    k1, v1 = _kv(6, 1)
    c.update_and_fetch(k1, v1)
    assert _same(c.key_mean, mx.mean(k1, axis=2).astype(mx.float16))
    c.update_and_fetch(*_kv(3, 2))
    assert _same(c.key_mean, mx.mean(k1, axis=2).astype(mx.float16))  # fixed once set


# ---- the contract's arithmetic ---------------------------------------------------------------------------
def _expected(codec, sink_k, sink_v, coded_k, coded_v, mean, dtype, value_codec=None):
    """What the state design says the cache hands out: [sink, dtype(f32(dec) + f32(mean)), ...]."""
    m = mean.astype(mx.float32)[:, :, None]
    kc = (coded_k.astype(mx.float32) - m).astype(dtype)
    dk = codec.decode(codec.encode(kc, check_finite=False))
    dk = (dk.astype(mx.float32) + m).astype(dtype)
    value_codec = value_codec or codec
    dv = value_codec.decode(value_codec.encode(coded_v, check_finite=False))
    return (mx.concatenate([sink_k.astype(dtype), dk], axis=2), mx.concatenate([sink_v.astype(dtype), dv], axis=2))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=str)
@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_sink_longer_than_the_first_update(dtype, mode):
    c = RVQKVCache((2, 2), mode=mode, sink_tokens=5, center_keys=True)
    parts = [_kv(t, 10 + t, dtype=dtype) for t in (2, 1, 4, 1, 3)]
    for i, (k, v) in enumerate(parts):
        got = c.update_and_fetch(k, v)
    keys = mx.concatenate([p[0] for p in parts], axis=2)
    values = mx.concatenate([p[1] for p in parts], axis=2)
    sdt = mx.bfloat16 if dtype == mx.bfloat16 else mx.float16
    assert (c.offset, c.n_sink, c.n_coded, c.n_dense) == (11, 5, 6, 0)
    assert c.sink_keys.dtype == sdt and _same(c.sink_keys, keys[:, :, :5].astype(sdt))
    assert _same(c.sink_values, values[:, :, :5].astype(sdt))
    # the mean: the tokens the third update coded (its last two), rounded to the state dtype
    assert _same(c.key_mean, mx.mean(keys[:, :, 5:7].astype(mx.float32), axis=2).astype(sdt))
    want = _expected(RVQCodec(64, (2, 2)), c.sink_keys, c.sink_values, keys[:, :, 5:], values[:, :, 5:],
                     c.key_mean, dtype)
    assert _same(got[0], want[0]) and _same(got[1], want[1])


@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_keys_and_values_coded_apart(mode):
    """Different head dims (as latent-attention models) and value bits: the unjoint paths."""
    c = RVQKVCache((4, 2), value_bits=(2, 2), mode=mode, sink_tokens=1, center_keys=True)
    k, _ = _kv(7, 5)
    _, v = _kv(7, 6, d=32)
    c.update_and_fetch(k[:, :, :4], v[:, :, :4])
    got = c.update_and_fetch(k[:, :, 4:], v[:, :, 4:])
    want = _expected(RVQCodec(64, (4, 2)), c.sink_keys, c.sink_values, k[:, :, 1:], v[:, :, 1:], c.key_mean,
                     mx.float32, RVQCodec(32, (2, 2)))
    assert _same(got[0], want[0]) and _same(got[1], want[1])


def test_a_non_finite_key_does_not_spoil_the_mean():
    c = RVQKVCache((4, 2), center_keys=True)
    k, v = _kv(6, 4)
    bad = mx.concatenate([k[:, :, :2], mx.full((1, 2, 1, 64), float("nan")), k[:, :, 3:]], axis=2)
    got = c.update_and_fetch(bad, v)[0]
    assert _same(c.key_mean, mx.mean(mx.concatenate([k[:, :, :2], k[:, :, 3:]], axis=2), axis=2).astype(mx.float16))
    assert bool(mx.all(mx.isnan(got[:, :, 2])).item()) and bool(mx.all(mx.isfinite(got[:, :, 3:])).item())


def test_float32_sink_beyond_float16_stays_float32():
    c = RVQKVCache((4, 2), sink_tokens=2, center_keys=True)
    k, v = _kv(4, 3)
    k = k * mx.array([1e5] + [1.0] * 63)  # coordinate 0 of every key beyond float16's range
    c.update_and_fetch(k, v)
    assert c.sink_keys.dtype == mx.float32 and _same(c.sink_keys, k[:, :, :2])
    assert c.sink_values.dtype == mx.float16
    assert c.key_mean.dtype == mx.float32  # the mean too (|mean| > 65504)
    assert _same(c.keys_and_values()[0][:, :, :2], k[:, :, :2])


@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_window_with_state_and_modes_agree(mode):
    """Positions: sink, coded, window; the window's tokens are exact, the mean set from the first flush."""
    kw = dict(sink_tokens=3, center_keys=True, dense_window=4, flush_block=2)
    c = RVQKVCache((4, 2), mode=mode, **kw)
    ref = RVQKVCache((4, 2), mode="packed", use_kernels=False, **kw)
    ks, vs = [], []
    for i, t in enumerate((5, 1, 1, 1, 6, 1, 1)):
        k, v = _kv(t, 20 + i)
        ks.append(k)
        vs.append(v)
        got, want = c.update_and_fetch(k, v), ref.update_and_fetch(k, v)
        assert _same(got[0], want[0]) and _same(got[1], want[1])
        assert c.offset == c.n_sink + c.n_coded + c.n_dense
    keys = mx.concatenate(ks, axis=2)
    assert (c.n_sink, c.n_coded, c.n_dense) == (3, 8, 5)
    assert _same(got[0][:, :, -5:], keys[:, :, -5:])
    assert _same(got[0][:, :, :3], keys[:, :, :3].astype(mx.float16).astype(mx.float32))
    # the first flush (at 14 tokens: 3 sink + 11 after it, 4 kept in the window, blocks of 2) coded 6
    assert _same(c.key_mean, mx.mean(keys[:, :, 3:9], axis=2).astype(mx.float16))


@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_trim_into_the_sink_and_back(mode):
    kw = dict(sink_tokens=3, center_keys=True, mode=mode)
    c = RVQKVCache((4, 2), **kw)
    k, v = _kv(10, 30)
    c.update_and_fetch(k, v)
    full = c.keys_and_values()
    assert c.trim(4) == 4 and (c.n_sink, c.n_coded) == (3, 3) and c.key_mean is not None
    assert _same(c.keys_and_values()[0], full[0][:, :, :6])  # the mean stays while tokens are coded
    assert c.trim(5) == 5 and (c.offset, c.n_sink, c.n_coded) == (1, 1, 0)
    assert c.key_mean is None  # no coded token left: the mean goes (a file would hold none either)
    assert _same(c.sink_keys, k[:, :, :1].astype(mx.float16))
    # refilled: the same as a fresh cache given the kept token and the new ones
    k2, v2 = _kv(7, 31)
    fresh = RVQKVCache((4, 2), **kw)
    fresh.update_and_fetch(k[:, :, :1], v[:, :, :1])
    got, want = c.update_and_fetch(k2, v2), fresh.update_and_fetch(k2, v2)
    assert _same(got[0], want[0]) and _same(got[1], want[1]) and _same(c.key_mean, fresh.key_mean)


# ---- arguments, refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(sink_tokens=-1), dict(sink_tokens=True), dict(sink_tokens=2.0),
                                 dict(sink_tokens=1 << 31), dict(center_keys=1), dict(center_keys="yes")])
def test_bad_settings_are_refused(bad):
    with pytest.raises(CodecConfigError):
        RVQKVCache(**bad)


def test_refused_update_leaves_the_cache_unchanged():
    c = RVQKVCache((4, 2), sink_tokens=2, center_keys=True)
    c.update_and_fetch(*_kv(5, 40))
    before, offset = _held(c), c.offset
    k, v = _kv(3, 41)
    for bad in ((k[..., :32], v[..., :32]), (k, v[:, :1]), (k.astype(mx.int32), v)):
        with pytest.raises(InputShapeError):
            c.update_and_fetch(*bad)
    after = _held(c)
    assert c.offset == offset and all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
                                      for a, b in zip(before, after))


def _packed(c: RVQKVCache) -> dict:
    s = c.state
    return dict(keys=s[0:3], values=s[3:6], dense_keys=s[6], dense_values=s[7], dtype=c.dtype, head_dims=(64, 64))


def test_from_packed_rebuilds_and_refuses_mismatches():
    c = RVQKVCache((4, 2), sink_tokens=2, center_keys=True, dense_window=2, flush_block=2)
    c.update_and_fetch(*_kv(9, 50))
    kw = dict(sink_tokens=2, center_keys=True, dense_window=2, flush_block=2)
    sink, mean = (c.sink_keys, c.sink_values), c.key_mean
    d = RVQKVCache.from_packed(**_packed(c), sink=sink, key_mean=mean, **kw)
    assert (d.offset, d.n_sink, d.n_coded, d.n_dense) == (c.offset, c.n_sink, c.n_coded, c.n_dense)
    assert all(_same(a, b) for a, b in zip(d.keys_and_values(), c.keys_and_values()))
    nxt = _kv(1, 51)
    assert all(_same(a, b) for a, b in zip(d.update_and_fetch(*nxt), c.update_and_fetch(*nxt)))
    c.trim(1)
    bad = [dict(sink=None, key_mean=mean),  # the sink must be there
           dict(sink=(sink[0][:, :, :1], sink[1][:, :, :1]), key_mean=mean),  # S != min(offset, sink_tokens)
           dict(sink=(sink[0], sink[1][..., :32]), key_mean=mean),  # value head dim
           dict(sink=(sink[0], sink[1][:, :1]), key_mean=mean),  # heads
           dict(sink=sink[0], key_mean=mean),  # not a pair
           dict(sink=sink, key_mean=None),  # coded tokens need the mean
           dict(sink=sink, key_mean=mean[..., :32]),  # mean shape
           dict(sink=sink, key_mean=mean.astype(mx.int32)),  # mean dtype
           dict(sink=sink, key_mean=mx.full(mean.shape, float("nan"), mx.float16))]
    for b in bad:
        with pytest.raises(InputShapeError):
            RVQKVCache.from_packed(**_packed(c), **b, **kw)
    with pytest.raises(InputShapeError):  # a mean without centering
        RVQKVCache.from_packed(**_packed(c), sink=sink, key_mean=mean, sink_tokens=2, dense_window=2, flush_block=2)
    with pytest.raises(InputShapeError):  # state given to a cache without any
        RVQKVCache.from_packed(**_packed(c), sink=sink, key_mean=None, dense_window=2, flush_block=2)
    with pytest.raises(CodecConfigError):
        RVQKVCache.from_packed(**_packed(c), sink=sink, key_mean=mean, sink_tokens=-2, center_keys=True)


def test_default_cache_keeps_its_state_layout():
    c = RVQKVCache((4, 2))
    c.update_and_fetch(*_kv(3, 60))
    assert len(c.state) == 8 and len(c.meta_state) == 9
    assert (c.sink_tokens, c.center_keys, c.n_sink, c.sink_keys, c.key_mean) == (0, False, 0, None, None)
    with pytest.raises(InvalidArgumentError):  # no settings in its state: mlx-lm's files cannot rebuild it
        RVQKVCache.from_state(c.state)


def test_memory_and_repr_count_the_state():
    c = RVQKVCache((4, 2), sink_tokens=2, center_keys=True)
    plain = RVQKVCache((4, 2))
    k, v = _kv(6, 70)
    c.update_and_fetch(k, v)
    plain.update_and_fetch(k[:, :, 2:], v[:, :, 2:])
    state = 2 * (1 * 2 * 2 * 64 * 2) + 1 * 2 * 64 * 2  # float16 sink keys + values, float16 mean
    assert c.packed_nbytes == plain.packed_nbytes + state
    assert c.nbytes == plain.nbytes + state
    r = repr(c)
    assert "sink_tokens=2" in r and "center_keys=True" in r and "sink=2" in r
    assert "sink" not in repr(plain) and "center" not in repr(plain)


# ---- attention on codes ------------------------------------------------------------------------------------
def _sdpa(c, q, scale, mask, sinks=None):
    k, v = c.keys_and_values()
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


@pytest.mark.parametrize("window", [0, 4])
def test_attention_on_codes_with_state_matches_decode_then_sdpa(window):
    c = RVQKVCache((4, 2), sink_tokens=2, center_keys=True, dense_window=window, flush_block=2)
    c.update_and_fetch(*_kv(20, 80, offset=6.0))
    rng = np.random.default_rng(81)
    for n in (1, 3, 6):
        c.update_and_fetch(*_kv(n, 82 + n, offset=6.0))
        t = c.offset
        q = mx.array(rng.standard_normal((1, 6, n, 64)).astype(np.float32))
        masks = [None, "causal", create_causal_mask(n, t - n), create_causal_mask(n, t - n, window_size=5)]
        for mask in masks[1 if n > 1 else 0:]:
            got = c.attend_on_codes(q, scale=0.125, mask=mask)
            want = _sdpa(c, q, 0.125, mask)
            assert got is not None
            assert float(mx.abs(got - want).max()) <= 2e-5 * float(mx.abs(want).max()), (n, mask)
    # learned attention sinks do not shift with the keys: decode-then-SDPA serves those calls
    assert c.attend_on_codes(q, scale=0.125, mask="causal", sinks=mx.zeros((6,))) is None


@pytest.mark.parametrize("n", [1, 3])
def test_gpu_kernel_model_with_state_matches_decode_then_sdpa(n):
    """The GPU kernel's split partials (its MLX-ops model) merged by kernel.combine with the sink in the
    window: what a GPU step computes for a cache with state (causal calls whose queries sit in the window)."""
    from rvqstore.attention import kernel, ops

    c = RVQKVCache((4, 2), sink_tokens=2, center_keys=True, dense_window=4, flush_block=2)
    c.update_and_fetch(*_kv(300, 120, offset=6.0))
    c.update_and_fetch(*_kv(n, 121, offset=6.0))
    q = mx.array(np.random.default_rng(122).standard_normal((1, 6, n, 64)).astype(np.float32))
    mask = None if n == 1 else "causal"
    assert c._state.attention_mask(mask, n, c.n_coded, c.n_dense) == mask  # the kernel takes this call
    view = c.codes_view()
    q_rot = ops.rotate_queries(view, q, 0.125).reshape(1, 2, 3 * n, 64)
    o, ml = kernel.partials_reference(view, q_rot, n, mask is not None)
    got = kernel.combine(view, q, 0.125, o, ml, mask, None)
    want = _sdpa(c, q, 0.125, mask)
    assert float(mx.abs(got - want).max()) <= 2e-5 * float(mx.abs(want).max())


def test_attention_on_codes_with_sink_tokens_and_learned_sinks():
    c = RVQKVCache((4, 2), sink_tokens=1)
    c.update_and_fetch(*_kv(12, 90))
    q = mx.array(np.random.default_rng(91).standard_normal((1, 4, 1, 64)).astype(np.float32))
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    got = c.attend_on_codes(q, scale=0.125, sinks=sinks)
    want = _sdpa(c, q, 0.125, None, sinks)
    assert float(mx.abs(got - want).max()) <= 2e-5 * float(mx.abs(want).max())


# ---- mlx-lm's prompt-cache files and make_prompt_cache ------------------------------------------------------
def test_mlx_lm_save_and_load_round_trip(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    caches = [RVQKVCache((4, 2), sink_tokens=2, center_keys=True, mode="resident", dense_window=2, flush_block=2),
              RVQKVCache((2, 2), value_bits=(2, 1), step=0.3, value_step=0.4, sink_tokens=1, center_keys=True),
              RVQKVCache((4, 2), center_keys=True)]  # empty
    for c in caches[:2]:
        c.update_and_fetch(*_kv(9, 100))
    path = str(tmp_path / "lm.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path)
    for a, b in zip(caches, loaded):
        assert type(b) is RVQKVCache and a.meta_state == b.meta_state and a.mode == b.mode
        if a.offset:
            assert all(_same(x, y) for x, y in zip(a.keys_and_values(), b.keys_and_values()))
        nxt = _kv(2, 101)
        assert all(_same(x, y) for x, y in zip(a.update_and_fetch(*nxt), b.update_and_fetch(*nxt)))
    with pytest.raises(InvalidArgumentError):
        RVQKVCache.from_state(caches[0].state[:-1])  # no settings


def test_make_prompt_cache_gives_full_attention_layers_the_state():
    from tiny_models import build

    import rvqstore
    from rvqstore.rotating_cache import RVQRotatingKVCache

    model, _ = build("gemma3_text")
    caches = rvqstore.make_prompt_cache(model, sink_tokens=1, center_keys=True)
    full = [c for c in caches if type(c) is RVQKVCache]
    assert full and all(c.sink_tokens == 1 and c.center_keys for c in full)
    assert any(isinstance(c, RVQRotatingKVCache) for c in caches)  # sliding layers: their own `keep` sinks
    ids = mx.array([[3, 17, 5, 9, 40, 2, 11, 8]])
    ref = model(ids, cache=rvqstore.make_prompt_cache(model))
    out = model(ids, cache=caches)
    assert out.shape == ref.shape and bool(mx.all(mx.isfinite(out)).item())
    assert all(c.n_sink == 1 and c.key_mean is not None for c in full)


# ---- the CUDA step paths, on a stand-in device ---------------------------------------------------------------
def _stand_in_kernels(monkeypatch):
    """The fused append / unpack launches replaced by MLX-ops models of what they compute, on a
    stand-in CUDA device: the cache's wiring around them (mean subtracted before the append, added to
    the unpack's output and the resident copy) is what is tested."""
    from kernel_models import swap_launches

    fused.reset()  # the codec's own kernels latch off on the stand-in (no CUDA): reset before and after
    monkeypatch.setattr(fused, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(fused, "_on_gpu", lambda: True)
    swap_launches(monkeypatch)
    calls = {"append": 0, "fetch": 0}

    def counted(f, kind):
        def run(*a, **kw):
            out = f(*a, **kw)
            calls[kind] += out is not None
            return out
        return run

    for mod, name, kind in ((cache_append, "append", "append"), (cache_append, "append_copy", "append"),
                            (cache_append, "append_inplace", "append"), (cache_fetch, "fetch", "fetch")):
        monkeypatch.setattr(mod, name, counted(getattr(mod, name), kind))
    return calls


@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_cuda_step_paths_with_state_on_a_stand_in_device(monkeypatch, mode):
    kw = dict(sink_tokens=2, center_keys=True)
    ref = RVQKVCache((2, 2), mode=mode, use_kernels=False, **kw)
    steps = [_kv(t, 110 + i) for i, t in enumerate((6, 1, 1, 1, 3))]
    want = [ref.update_and_fetch(k, v) for k, v in steps]
    calls = _stand_in_kernels(monkeypatch)
    try:
        c = RVQKVCache((2, 2), mode=mode, **kw)
        for (k, v), w in zip(steps, want):
            got = c.update_and_fetch(k, v)
            assert _same(got[0], w[0]) and _same(got[1], w[1])
        assert calls["append"] >= 4 and (mode == "resident" or calls["fetch"] >= 4)
        assert not cache_append.disabled() and not cache_fetch.disabled()
    finally:
        fused.reset()
