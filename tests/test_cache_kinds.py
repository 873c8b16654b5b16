"""The RVQ rotating cache against mlx-lm's RotatingKVCache, and the per-layer cache-kind mapping."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (ArraysCache, BatchKVCache, CacheList, ChunkedKVCache, KVCache,
                                 RotatingKVCache)

from rvqstore import RVQKVCache, convert_prompt_cache
from rvqstore.compat import UnsupportedCacheError
from rvqstore.errors import CodecConfigError
from rvqstore.rotating_cache import RVQRotatingKVCache


def _attend(cache, q, k, v, window_size):
    mask = cache.make_mask(q.shape[2], window_size=window_size)
    keys, values = cache.update_and_fetch(k, v)
    return keys, mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask=mask)


@pytest.mark.parametrize("keep,chunks,window_size", [
    (0, [5] * 10, None),                          # chunked prefill past the window
    (0, [40, 1, 1, 1, 7, 1, 30, 1], None),        # one-shot prefill longer than the window, then decode
    (4, [40, 1, 1, 1, 7, 1, 30, 1], None),        # with attention sinks
    (4, [1] * 40, None),                          # token by token (mlx-lm's in-place ring path)
    (0, [1] * 30 + [9, 1, 1], 8),                 # a mask window smaller than the cache
    (0, [3] * 12, 8),
])
@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_attention_matches_mlx_lm_rotating_cache(keep, chunks, window_size, mode):
    """Same keys in view, same masks: attention outputs differ by the 4+4 codec error only."""
    mx.random.seed(1)
    ref, rvq = RotatingKVCache(16, keep), RVQRotatingKVCache(16, keep, bits=(4, 4), mode=mode)
    for s in chunks:
        q, k, v = (mx.random.normal((1, 2, s, 64)) for _ in range(3))
        ka, oa = _attend(ref, q, k, v, window_size)
        kb, ob = _attend(rvq, q, k, v, window_size)
        assert kb.shape == ka.shape
        assert float(mx.abs(oa - ob).max()) < 0.05  # vs ~1 for a wrong key set or mask
        assert rvq.offset == ref.offset
    assert rvq.n_held <= 16  # never more than the window after an update, whatever the chunk
    assert rvq.size() == ref.size()


def test_window_memory_is_bounded_and_matches_conversion():
    mx.random.seed(2)
    k, v = mx.random.normal((1, 2, 100, 64)), mx.random.normal((1, 2, 100, 64))
    c = RVQRotatingKVCache(32, 2, bits=(2, 2))
    c.update_and_fetch(k, v)
    assert (c.n_held, c.offset) == (32, 100)
    ref = RotatingKVCache(32, 2)
    ref.update_and_fetch(k, v)
    conv = convert_prompt_cache([ref], bits=(2, 2))[0]
    assert isinstance(conv, RVQRotatingKVCache) and (conv.offset, conv.n_held) == (100, 32)
    for a, b in zip(conv.state, c.state):
        assert mx.array_equal(a, b)
    # 2+2 at head dim 64: 34 bytes per vector vs 128 in float16
    assert c.packed_nbytes == 2 * 2 * 32 * 34


def test_trim_rules():
    mx.random.seed(3)
    kv = lambda n: (mx.random.normal((1, 1, n, 64)), mx.random.normal((1, 1, n, 64)))  # noqa: E731
    c = RVQRotatingKVCache(16, 0, bits=(2, 2))
    c.update_and_fetch(*kv(10))
    assert c.is_trimmable() and c.trim(4) == 4 and c.offset == 6 and c.n_held == 6
    c.update_and_fetch(*kv(30))  # wrapped: 36 seen, 16 held
    assert c.trimmable_to() == 35  # the next token needs the 15 before it: one token can go back
    assert c.trim(5) == 1 and c.offset == 35
    assert not c.is_trimmable() and c.trim(3) == 0 and c.offset == 35


def test_bad_settings_and_kinds():
    with pytest.raises(CodecConfigError, match="keep"):
        RVQRotatingKVCache(4, 4)
    with pytest.raises(CodecConfigError, match="max_size"):
        RVQRotatingKVCache(0)
    with pytest.raises(UnsupportedCacheError, match="layer 2 uses a ChunkedKVCache"):
        convert_prompt_cache([KVCache(), ArraysCache(2), ChunkedKVCache(8)])
    with pytest.raises(UnsupportedCacheError, match="layer 0, child 1 uses a BatchKVCache"):
        convert_prompt_cache([CacheList(KVCache(), BatchKVCache([0]))])
    out = convert_prompt_cache([CacheList(ArraysCache(2), KVCache()), RotatingKVCache(8, 0)])
    assert isinstance(out[0], CacheList) and isinstance(out[0][0], ArraysCache) and isinstance(out[0][1], RVQKVCache)
    assert isinstance(out[1], RVQRotatingKVCache) and out[1].max_size == 8


def test_max_kv_size_for_models_without_make_cache():
    from types import SimpleNamespace

    from rvqstore import make_prompt_cache

    caches = make_prompt_cache(SimpleNamespace(layers=[0, 0, 0]), bits=(2, 2), max_kv_size=32)
    assert [(type(c).__name__, c.max_size, c.keep) for c in caches] == [("RVQRotatingKVCache", 32, 4)] * 3
    assert all(type(c) is RVQKVCache for c in make_prompt_cache(SimpleNamespace(layers=[0, 0])))
    with pytest.raises(CodecConfigError, match="layer 0 is a sliding-window layer"):
        make_prompt_cache(SimpleNamespace(layers=[0]), max_kv_size=32, dense_window=8)


def test_models_that_touch_raw_cache_arrays_are_refused_by_name():
    from types import SimpleNamespace

    from rvqstore import make_prompt_cache

    fake = SimpleNamespace(args=SimpleNamespace(model_type="deepseek_v32"), layers=[0], make_cache=lambda: [])
    with pytest.raises(UnsupportedCacheError, match="layer 0, child 1 of a deepseek_v32 model is a KVCache"):
        make_prompt_cache(fake)


def test_rotating_cache_refuses_bad_input_unchanged():
    from rvqstore.errors import InputShapeError

    c = RVQRotatingKVCache(8, 1, bits=(2, 2))
    k = mx.random.normal((1, 2, 5, 64))
    c.update_and_fetch(k, k)
    before = [mx.array(a) for a in c.state]
    for bad in ((k.astype(mx.int32), k), (k, k[..., :5, :32][:, :, :4]), (mx.random.normal((1, 3, 2, 64)),) * 2,
                (mx.random.normal((1, 2, 2, 24)),) * 2):
        with pytest.raises(InputShapeError):
            c.update_and_fetch(*bad)
    assert c.offset == 5 and all(mx.array_equal(a, b).item() for a, b in zip(before, c.state))
    empty = mx.zeros((1, 2, 0, 64))
    assert c.update_and_fetch(empty, empty)[0].shape == (1, 2, 5, 64) and c.offset == 5
    fresh = RVQRotatingKVCache(8)
    with pytest.raises(CodecConfigError):  # an unsupported head dim on first use
        fresh.update_and_fetch(mx.zeros((1, 1, 2, 7)), mx.zeros((1, 1, 2, 7)))
    assert fresh.empty()


@pytest.mark.parametrize("mode", ["packed", "resident"])
def test_conversion_of_a_wrapped_ring_then_attention_matches(mode):
    """mlx-lm's in-place ring (single-token updates past the window, sinks kept) converts to the same window."""
    mx.random.seed(4)
    ref = RotatingKVCache(12, 2)
    for _ in range(30):
        k = mx.random.normal((1, 2, 1, 64))
        ref.update_and_fetch(k, k * 0.5)
    conv = convert_prompt_cache([ref], bits=(4, 4), mode=mode)[0]
    assert (conv.offset, conv.n_held) == (30, 12)
    want = ref._temporal_order(ref.keys)
    assert float(mx.abs(conv.keys_and_values()[0] - want).max()) < 0.05
    for s in (1, 5, 1):
        q, k, v = (mx.random.normal((1, 2, s, 64)) for _ in range(3))
        _, oa = _attend(ref, q, k, v, None)
        _, ob = _attend(conv, q, k, v, None)
        assert float(mx.abs(oa - ob).max()) < 0.05
