import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache

from rvqstore import RVQCodec, RVQKVCache, convert_prompt_cache
from rvqstore.compat import UnsupportedCacheError
from rvqstore.errors import CodecConfigError, InputShapeError


def kv(t, b=1, h=3, d=64, seed=0):
    rng = np.random.default_rng(seed)
    return (mx.array(rng.standard_normal((b, h, t, d)).astype(np.float32)),
            mx.array(rng.standard_normal((b, h, t, d)).astype(np.float32)))


def feed(cache, k, v, chunks):
    """Feed k/v (B,H,T,D) in the given chunk sizes; return the last fetch."""
    out, pos = None, 0
    for n in chunks:
        out = cache.update_and_fetch(k[:, :, pos:pos + n], v[:, :, pos:pos + n])
        pos += n
    return out


def test_no_bits_attribute():
    # mlx-lm routes any cache with a `bits` attribute to its affine quantized attention
    assert not hasattr(RVQKVCache(), "bits")


@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_fetch_equals_codec_roundtrip_and_is_chunking_invariant(mode):
    k, v = kv(50)
    codec = RVQCodec(64, (2, 2))
    expect_k = np.array(codec.decode(codec.encode(k)))
    for chunks in ([50], [13, 1, 1, 35], [1] * 50):
        c = RVQKVCache((2, 2), mode=mode)
        ko, vo = feed(c, k, v, chunks)
        assert ko.shape == (1, 3, 50, 64) and ko.dtype == k.dtype
        np.testing.assert_array_equal(np.array(ko), expect_k)
        assert c.offset == c.size() == 50 and not c.empty()


@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_dense_window_keeps_recent_tokens_exact(mode):
    k, v = kv(40)
    c = RVQKVCache((2, 2), mode=mode, dense_window=8, flush_block=4)
    ko, vo = feed(c, k, v, [10] + [1] * 30)
    # coded = 4 * floor((40 - 8) / 4) = 32; the last 8 are exact
    assert c.n_coded == 32 and c.n_dense == 8
    np.testing.assert_array_equal(np.array(ko[:, :, 32:]), np.array(k[:, :, 32:]))
    assert not np.array_equal(np.array(ko[:, :, :32]), np.array(k[:, :, :32]))


@pytest.mark.parametrize("mode", ["packed", "resident"])
@pytest.mark.parametrize("window", [0, 8])
def test_trim_then_extend_matches_fresh_cache(mode, window):
    k, v = kv(30, seed=1)
    k2, v2 = kv(5, seed=2)
    a = RVQKVCache((2, 2), mode=mode, dense_window=window, flush_block=4)
    feed(a, k, v, [30])
    assert a.trim(12) == 12 and a.offset == 18
    out_a = a.update_and_fetch(k2, v2)
    b = RVQKVCache((2, 2), mode=mode, dense_window=window, flush_block=4)
    feed(b, k, v, [18])
    out_b = b.update_and_fetch(k2, v2)
    if window == 0:  # with a window, trimming into coded tokens cannot restore their exact values
        np.testing.assert_array_equal(np.array(out_a[0]), np.array(out_b[0]))
        np.testing.assert_array_equal(np.array(out_a[1]), np.array(out_b[1]))
    assert out_a[0].shape == out_b[0].shape == (1, 3, 23, 64)
    assert a.trim(100) == 23 and a.offset == 0


def test_nbytes_counts_what_is_held():
    k, v = kv(300)
    packed = RVQKVCache((2, 2), mode="packed")
    feed(packed, k, v, [300])
    codec = RVQCodec(64, (2, 2))
    # capacity grows in steps of 256 tokens: 512 slots of scales + both code streams, for K and V
    per_token = 2 + 4 * (codec.words1 + codec.words2)
    assert packed.nbytes == 2 * 1 * 3 * 512 * per_token
    assert packed.packed_nbytes == 2 * 1 * 3 * 300 * per_token
    resident = RVQKVCache((2, 2), mode="resident")
    feed(resident, k, v, [300])
    assert resident.nbytes == packed.nbytes + 2 * 3 * 512 * 64 * 4  # plus the float32 decoded copies


def test_masks_match_mlx_lm():
    c, ref = RVQKVCache(), KVCache()
    k, v = kv(7)
    c.update_and_fetch(k, v)
    ref.update_and_fetch(k, v)
    for n in (1, 5):
        for kw in (dict(return_array=False, window_size=None), dict(return_array=True, window_size=None),
                   dict(return_array=False, window_size=3)):
            got, want = c.make_mask(n, **kw), ref.make_mask(n, **kw)
            if isinstance(want, mx.array) or isinstance(got, mx.array):
                np.testing.assert_array_equal(np.array(got), np.array(want))
            else:
                assert got == want


def test_bad_shapes_and_settings():
    c = RVQKVCache()
    k, v = kv(4)
    c.update_and_fetch(k, v)
    with pytest.raises(InputShapeError):
        c.update_and_fetch(k[:, :2], v[:, :2])  # head count changed
    with pytest.raises(InputShapeError):
        RVQKVCache().update_and_fetch(k[0], v[0])  # not 4-D
    with pytest.raises(CodecConfigError):
        RVQKVCache().update_and_fetch(*kv(2, d=100))  # unsupported head dim
    for bad in (dict(mode="fast"), dict(dense_window=-1), dict(flush_block=0), dict(bits=(5, 1))):
        with pytest.raises(CodecConfigError):
            RVQKVCache(**bad)


def test_conversion_from_mlx_lm_caches():
    k, v = kv(20)
    plain = KVCache()
    plain.update_and_fetch(k, v)
    conv = convert_prompt_cache([plain], bits=(2, 2))[0]
    codec = RVQCodec(64, (2, 2))
    np.testing.assert_array_equal(np.array(conv.keys_and_values()[0]), np.array(codec.decode(codec.encode(k))))
    q = QuantizedKVCache(group_size=64, bits=8)
    q.update_and_fetch(k, v)
    convq = convert_prompt_cache([q])[0]
    assert convq.offset == 20
    err = float(mx.sum((convq.keys_and_values()[0] - k) ** 2) / mx.sum(k * k))
    assert err < 0.012
    with pytest.raises(UnsupportedCacheError, match="layer 1 uses a ChunkedKVCache"):
        convert_prompt_cache([RotatingKVCache(max_size=8), ChunkedKVCache(8)])


def test_state_and_save_while_every_token_is_still_in_the_window(tmp_path):
    from rvqstore import load_prompt_cache, save_prompt_cache

    k, v = kv(10)
    c = RVQKVCache((2, 2), dense_window=64)
    c.update_and_fetch(k, v)
    ks, kc1, kc2, vs, vc1, vc2, dk, dv = c.state
    assert ks.shape == (1, 3, 0) and kc1.shape[2] == 0 and dk.shape == (1, 3, 10, 64)
    save_prompt_cache(tmp_path / "w.rvq", [c], tokens=list(range(10)))
    back = load_prompt_cache(tmp_path / "w.rvq")[0]
    assert back.offset == 10 and back.n_dense == 10
    assert mx.array_equal(back.keys_and_values()[0], k).item()


@pytest.mark.parametrize("bad", [{"mode": "turbo"}, {"dense_window": "8"}, {"flush_block": 0}, [1, 2]])
def test_crafted_cache_options_in_a_file_raise_a_format_error(tmp_path, bad):
    from rvqstore import load_prompt_cache, save_prompt_cache
    from rvqstore.format import FormatError, open_rvq, write_rvq
    from rvqstore.format.writer import Section

    k, v = kv(5)
    c = RVQKVCache((2, 2))
    c.update_and_fetch(k, v)
    good = tmp_path / "good.rvq"
    save_prompt_cache(good, [c])
    with open_rvq(good) as f:  # rewrite the same content with a hostile `cache` map
        header = {key: f.header.raw[key] for key in ("n_tokens", "layers", "quantizer", "model", "metadata")}
        sections = [Section(s.name, s.layer, s.kind, np.array(f.read_section(s.name)), s.dtype) for s in f.sections]
    header["cache"] = bad
    bad_path = tmp_path / "bad.rvq"
    write_rvq(bad_path, header, sections)
    with pytest.raises(FormatError, match="header.cache"):
        load_prompt_cache(bad_path)


@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_compiled_step_path_matches_unfused_path(mode):
    # one-token updates take rvqstore.cache_steps (one compiled call each); the result is bit-identical
    k, v = kv(40, seed=7)
    fast, slow = RVQKVCache((2, 2), mode=mode), RVQKVCache((2, 2), mode=mode)
    slow._steps_off = True
    for c in (fast, slow):
        feed(c, k, v, [9] + [1] * 31)
    assert not fast._steps_off
    for a, b in zip(fast.state, slow.state):
        assert (a is None and b is None) or mx.array_equal(a, b)
    for a, b in zip(fast.keys_and_values(), slow.keys_and_values()):
        assert mx.array_equal(a, b)


@pytest.mark.parametrize("inplace", [False, True])
def test_resident_steps_stage_their_codes_and_read_back_the_same(monkeypatch, inplace):
    # a resident cache writes single steps' codes into its buffers in blocks (_Stream.stage), or on CUDA in
    # place from the launch that decodes them (cache_append.INPLACE); whatever reads them (state, trim, a
    # prefill) sees exactly what a packed cache wrote step by step
    from rvqstore import cache_append, fused

    monkeypatch.setattr(cache_append, "INPLACE", inplace)
    in_place = inplace and fused.gpu_backend() == "cuda" and fused._on_gpu()
    k, v = kv(70, seed=5)
    res, pk = RVQKVCache((2, 2), mode="resident"), RVQKVCache((2, 2))
    for c in (res, pk):
        feed(c, k, v, [9] + [1] * 40)
    # 40 steps: two blocks written, 8 staged; or every step written in place, nothing staged
    assert bool(res._keys._staged) != in_place and res.n_coded == pk.n_coded == 49
    for a, b in zip(res.state, pk.state):
        assert (a is None and b is None) or mx.array_equal(a, b)
    assert not res._keys._staged
    for c in (res, pk):  # staged steps, then a trim, then a prefill-sized update
        feed(c, k[:, :, 49:], v[:, :, 49:], [1, 1, 1])
        c.trim(2)
        feed(c, k[:, :, 50:], v[:, :, 50:], [10])
    assert res.offset == pk.offset == 60
    for a, b in zip(res.state, pk.state):
        assert (a is None and b is None) or mx.array_equal(a, b)
    for a, b in zip(res.keys_and_values(), pk.keys_and_values()):
        assert mx.array_equal(a, b)


def test_repeated_update_shapes_skip_the_full_check_but_nothing_else(monkeypatch):
    # a decode step repeats the last update's shapes and dtype: check_update runs once for them; any other
    # shape, dtype or type is checked again (and refused where it must be, leaving the cache as it was)
    import rvqstore.cache as cache_module

    checks = []
    real = cache_module.check_update
    monkeypatch.setattr(cache_module, "check_update", lambda *a: checks.append(1) or real(*a))
    k, v = kv(8)
    c = RVQKVCache((2, 2))
    c.update_and_fetch(k[:, :, :4], v[:, :, :4])
    c.update_and_fetch(k[:, :, 4:5], v[:, :, 4:5])
    c.update_and_fetch(k[:, :, 5:6], v[:, :, 5:6])
    assert len(checks) == 2  # the first update, then the first one-token update
    for bad_k, bad_v in ((k[:, :, 6:7].astype(mx.int32), v[:, :, 6:7]), (np.array(k[:, :, 6:7]), v[:, :, 6:7]),
                         (k[:, :, 6:7], v[:, :, 6:7].astype(mx.int32))):
        with pytest.raises(InputShapeError):
            c.update_and_fetch(bad_k, bad_v)
    assert c.offset == 6 and len(checks) == 5
    c.update_and_fetch(k[:, :, 6:7].astype(mx.float16), v[:, :, 6:7].astype(mx.float16))  # another dtype: checked
    c.update_and_fetch(k[:, :, 7:8], v[:, :, 7:8])  # the cache's dtype, shapes checked: skipped
    assert c.offset == 8 and len(checks) == 6
    ref = RVQKVCache((2, 2))
    feed(ref, k, v, [4, 1, 1])
    ref.update_and_fetch(k[:, :, 6:7].astype(mx.float16), v[:, :, 6:7].astype(mx.float16))
    ref.update_and_fetch(k[:, :, 7:8], v[:, :, 7:8])
    for a, b in zip(c.keys_and_values(), ref.keys_and_values()):
        assert mx.array_equal(a, b)


def test_keys_and_values_code_jointly_only_with_the_same_tables():
    # decided once per cache when its streams are made (_set_streams), from_packed's codecs included
    k, v = kv(6)
    c = RVQKVCache((2, 2))
    c.update_and_fetch(k, v)
    assert c._is_joint and c._steps_apply
    for value_codec, joint in ((RVQCodec(64, (2, 2), step=0.2), False), (RVQCodec(64, (2, 2)), True)):
        ks, kc1, kc2, vs, vc1, vc2 = c.state[:6]
        enc = value_codec.encode(v)
        back = RVQKVCache.from_packed(keys=(ks, kc1, kc2), values=(enc.scales, enc.codes1, enc.codes2),
                                      dense_keys=None, dense_values=None, dtype=mx.float32, head_dims=(64, 64),
                                      value_codec=value_codec, bits=(2, 2))
        assert back._is_joint is joint
        back.update_and_fetch(k[:, :, :1], v[:, :, :1])
        kk, vv = back.keys_and_values()
        want = value_codec.decode(value_codec.encode(mx.concatenate([v, v[:, :, :1]], axis=2)))
        assert mx.array_equal(vv, want)
