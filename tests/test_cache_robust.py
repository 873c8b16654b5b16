"""A refused update_and_fetch leaves the cache exactly as it was; zero-token updates behave like
mlx-lm's KVCache / RotatingKVCache (issue 12, items 1 and 2). Every rvqstore attention cache kind."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from rvqstore import RVQKVCache
from rvqstore.rotating_cache import RVQRotatingKVCache
from rvqstore.errors import CodecConfigError, InputShapeError, InvalidArgumentError, RVQError


def kv(t, b=1, h=2, d=64, seed=0, dtype=mx.float16):
    rng = np.random.default_rng(seed)
    return (mx.array(rng.standard_normal((b, h, t, d)).astype(np.float32)).astype(dtype),
            mx.array(rng.standard_normal((b, h, t, d)).astype(np.float32)).astype(dtype))


def snapshot(c: RVQKVCache) -> dict:
    """Every attribute, arrays by identity (a failed call must not even replace them), plus the
    streams' own attributes."""
    out = {}
    for name, v in vars(c).items():
        if isinstance(v, mx.array):
            out[name] = ("array", id(v))
        elif hasattr(v, "codec") and hasattr(v, "n"):  # a code stream
            out[name] = ("stream", id(v), v.n, id(v.scales), id(v.codes1), id(v.codes2), id(v.codec))
        else:
            out[name] = v
    return out


# (name, rvqstore cache, the mlx-lm cache it stands in for)
KINDS = {
    "packed": (lambda: RVQKVCache((2, 2)), KVCache),
    "resident": (lambda: RVQKVCache((2, 2), mode="resident"), KVCache),
    "packed-window": (lambda: RVQKVCache((2, 2), dense_window=4, flush_block=2), KVCache),
    "resident-window": (lambda: RVQKVCache((2, 2), mode="resident", dense_window=4, flush_block=2), KVCache),
    "rotating": (lambda: RVQRotatingKVCache(6, 2, (2, 2)), lambda: RotatingKVCache(6, 2)),
    "rotating-resident": (lambda: RVQRotatingKVCache(6, 2, (2, 2), mode="resident"), lambda: RotatingKVCache(6, 2)),
}

BAD_INPUTS = [
    ("int32 keys", lambda: (mx.zeros((1, 2, 3, 64), mx.int32), mx.zeros((1, 2, 3, 64), mx.int32)), InputShapeError),
    ("int32 values", lambda: (kv(3)[0], mx.zeros((1, 2, 3, 64), mx.int32)), InputShapeError),
    ("head dim 100", lambda: kv(3, d=100), CodecConfigError),
    ("value head dim 100", lambda: (kv(3)[0], kv(3, d=100)[1]), CodecConfigError),
    ("3-d keys", lambda: (mx.zeros((2, 3, 64), mx.float16), mx.zeros((2, 3, 64), mx.float16)), InputShapeError),
    ("T mismatch", lambda: (kv(3)[0], kv(4)[1]), InputShapeError),
    ("numpy keys", lambda: (np.zeros((1, 2, 3, 64), np.float32), kv(3)[1]), InputShapeError),
    ("zero heads", lambda: kv(3, h=0), InputShapeError),
    ("zero batch", lambda: kv(3, b=0), InputShapeError),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("what,make,err", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_refused_first_call_leaves_fresh_cache_unchanged(kind, what, make, err):
    c = KINDS[kind][0]()
    before = snapshot(c)
    for _ in range(2):  # the same bad call twice: the same typed error both times
        with pytest.raises(err):
            c.update_and_fetch(*make())
        assert snapshot(c) == before
    assert c.empty() and c.geometry is None and c.dtype is None
    k, v = kv(5)  # a valid call now behaves as on a fresh cache
    ko, vo = c.update_and_fetch(k, v)
    fresh = KINDS[kind][0]().update_and_fetch(k, v)
    assert ko.dtype == mx.float16 and ko.shape == (1, 2, 5, 64)
    np.testing.assert_array_equal(np.array(ko), np.array(fresh[0]))
    np.testing.assert_array_equal(np.array(vo), np.array(fresh[1]))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("what,make,err", BAD_INPUTS + [
    ("other head dim", lambda: kv(3, d=32), InputShapeError),
    ("other heads", lambda: kv(3, h=3), InputShapeError),
    ("other batch", lambda: kv(3, b=2), InputShapeError),
], ids=[b[0] for b in BAD_INPUTS] + ["other head dim", "other heads", "other batch"])
def test_refused_call_leaves_filled_cache_unchanged(kind, what, make, err):
    c = KINDS[kind][0]()
    k, v = kv(7, seed=1)
    c.update_and_fetch(k, v)
    before = snapshot(c)
    held = [np.array(a) for a in c.keys_and_values()]
    if err is CodecConfigError:  # the geometry mismatch is what a filled cache reports first
        err = InputShapeError
    with pytest.raises(err):
        c.update_and_fetch(*make())
    assert snapshot(c) == before
    for a, b in zip(c.keys_and_values(), held):
        np.testing.assert_array_equal(np.array(a), b)
    assert issubclass(err, RVQError)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_zero_tokens_on_fresh_cache_matches_mlx_lm(kind, dtype):
    make, make_ref = KINDS[kind]
    k0, v0 = mx.zeros((1, 2, 0, 64), dtype), mx.zeros((1, 2, 0, 32), dtype)
    ref = make_ref()
    rk, rv = ref.update_and_fetch(k0, v0)
    c = make()
    ck, cv = c.update_and_fetch(k0, v0)
    assert (ck.shape, cv.shape, ck.dtype, cv.dtype) == (rk.shape, rv.shape, rk.dtype, rv.dtype)
    assert c.offset == ref.offset == 0 and c.size() == ref.size() == 0
    # then tokens arrive as usual
    k, v = kv(9, dtype=dtype)
    v = v[..., :32]
    ck, cv = c.update_and_fetch(k, v)
    rk, rv = ref.update_and_fetch(k, v)
    assert ck.shape == rk.shape and cv.shape == rv.shape and c.offset == ref.offset == 9
    a, b = np.array(ck.astype(mx.float32)), np.array(rk.astype(mx.float32))
    assert np.sum((a - b) ** 2) / np.sum(b ** 2) < 0.03  # 2+2 bits: ~0.01 relative error


@pytest.mark.parametrize("kind", KINDS)
def test_zero_tokens_on_filled_cache_match_mlx_lm(kind):
    """Plain caches return their history unchanged; rotating ones, like mlx-lm's RotatingKVCache,
    return the window cut to max_size - 1 (what a concatenating update sees)."""
    make, make_ref = KINDS[kind]
    c, ref = make(), make_ref()
    k, v = kv(9, seed=3)
    c.update_and_fetch(k, v)
    ref.update_and_fetch(k, v)
    ko, vo = c.keys_and_values()
    k2, v2 = c.update_and_fetch(k[:, :, :0], v[:, :, :0])
    rk, _ = ref.update_and_fetch(k[:, :, :0], v[:, :, :0])
    assert c.offset == ref.offset == 9 and k2.shape == rk.shape
    a, b = np.array(k2.astype(mx.float32)), np.array(rk.astype(mx.float32))
    assert np.sum((a - b) ** 2) / np.sum(b ** 2) < 0.03
    if isinstance(c, RVQKVCache):
        np.testing.assert_array_equal(np.array(k2), np.array(ko))
        np.testing.assert_array_equal(np.array(v2), np.array(vo))


@pytest.mark.parametrize("kind", KINDS)
def test_trim_takes_integers_only(kind):
    c = KINDS[kind][0]()
    c.update_and_fetch(*kv(5))
    before = snapshot(c)
    for bad in (None, "2", 1.5, float("nan"), True, [1]):
        with pytest.raises(InvalidArgumentError):
            c.trim(bad)
        assert snapshot(c) == before
    assert c.trim(np.int64(2)) == 2  # numpy integers are integers (5 tokens: nothing left a window yet)
    assert c.offset == 3 and c.trim(-4) == 0 and c.offset == 3


def _packed(c):
    ks, kc1, kc2, vs, vc1, vc2 = c.state[:6]
    return (ks, kc1, kc2), (vs, vc1, vc2)


@pytest.mark.parametrize("fault", ["no tuple", "2-d scales", "codes words", "codes dtype", "values scales",
                                   "head dims", "dense shape", "one dense side", "int dtype"])
def test_from_packed_refuses_inconsistent_arrays(fault):
    c = RVQKVCache((2, 2), dense_window=4, flush_block=2)
    c.update_and_fetch(*kv(9))
    (ks, kc1, kc2), (vs, vc1, vc2) = _packed(c)
    kw = dict(keys=(ks, kc1, kc2), values=(vs, vc1, vc2), dense_keys=c._dense_k, dense_values=c._dense_v,
              dtype=c.dtype, head_dims=(64, 64), bits=(2, 2), dense_window=4, flush_block=2)
    RVQKVCache.from_packed(**kw)  # as given: fine
    kw.update({
        "no tuple": dict(values=None),
        "2-d scales": dict(keys=(ks[0], kc1, kc2)),
        "codes words": dict(keys=(ks, kc1[..., :1], kc2)),
        "codes dtype": dict(values=(vs, vc1.astype(mx.int32), vc2)),
        "values scales": dict(values=(vs[:, :, :1], vc1, vc2)),
        "head dims": dict(head_dims=(32, 64)),
        "dense shape": dict(dense_values=c._dense_v[..., :32]),
        "one dense side": dict(dense_values=None),
        "int dtype": dict(dtype=mx.int32),
    }[fault])
    with pytest.raises(InputShapeError):
        RVQKVCache.from_packed(**kw)
