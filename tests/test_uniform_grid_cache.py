"""Uniform-grid caches (issue 11 item 4): settings plumbed to the codecs, files saved with ``best``
(entropy-coded sections) that load and resume bit-identically, and the places that must not mistake a
grid for Lloyd–Max tables of the same bits (joint encoding, fresh caches on resume, the prefix store)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import rvqstore
from rvqstore import RVQCodec, RVQKVCache
from rvqstore.errors import CodecConfigError
from rvqstore.format import open_rvq
from rvqstore.format.quantizer import decode_layers
from rvqstore.generation import prefill
from rvqstore.rotating_cache import RVQRotatingKVCache

TOKENS = [int(i) for i in np.random.default_rng(1).integers(3, 128, 40)]


@pytest.fixture(scope="module")
def llama():
    from tiny_models import build

    return build("llama")[0]


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)  # bits, so NaN == NaN


def _state(c) -> list[np.ndarray]:
    return [_np(a) for a in c.state if a is not None]


def test_settings_reach_the_codecs_and_are_refused_when_bad():
    c = RVQKVCache((4, 2), value_bits=(4, 1), step=0.1, value_step=0.2)
    k = mx.array(np.random.default_rng(0).standard_normal((1, 2, 5, 16)).astype(np.float32))
    c.update_and_fetch(k, k)
    assert (c._keys.codec.step, c._values.codec.step) == (0.1, 0.2)
    assert c._keys.codec.same_code(RVQCodec(16, (4, 2), step=0.1))
    assert "step=0.1" in repr(c) and "value_step=0.2" in repr(c) and "value_bits=(4, 1)" in repr(c)
    assert RVQKVCache((4, 2), step=0.1).value_step == 0.1  # values follow the keys unless told
    for bad in (dict(step=0.0), dict(step=float("nan")), dict(value_step=-1.0), dict(step="0.1"),
                dict(step=0.1, residual="shared"), dict(step=1e-45)):
        with pytest.raises(CodecConfigError):
            RVQKVCache((4, 2), **bad)
    with pytest.raises(CodecConfigError, match="one codec"):
        RVQRotatingKVCache(8, 2, (4, 2), step=0.1, value_step=0.2)


def test_equal_bits_other_tables_are_not_coded_jointly():
    """Keys and values of the same bits but different steps must each get their own codec's codes
    (the joint one-call encode applies only to identical codes)."""
    rng = np.random.default_rng(2)
    k = mx.array(rng.standard_normal((1, 2, 6, 16)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 6, 16)).astype(np.float32))
    c = RVQKVCache((4, 2), step=0.1, value_step=0.13)
    c.update_and_fetch(k, v)
    assert not c._joint()
    want = RVQCodec(16, (4, 2), step=0.13).encode(v)
    got = c.state[3:6]
    assert all(np.array_equal(_np(a), _np(b)) for a, b in zip(got, (want.scales, want.codes1, want.codes2)))
    same = RVQKVCache((4, 2), step=0.1)
    same.update_and_fetch(k, v)
    assert same._joint()


def test_saved_with_best_loads_and_resumes_bit_identically(llama, tmp_path):
    caches = rvqstore.make_prompt_cache(llama, (4, 2), step=0.1, value_step=0.12)
    prefill(llama, TOKENS, caches)
    path = tmp_path / "grid.rvq"
    rvqstore.save_prompt_cache(path, caches, tokens=TOKENS, model=llama, compress="best")
    with open_rvq(path) as f:
        assert "rans" in {s.codec for s in f.header.sections}  # grid codes are worth entropy coding
        kc, vc = f.codec_for(0, "keys"), f.codec_for(0, "values")
        assert (kc.step, vc.step) == (0.1, 0.12)  # recognized from the stored tables
        assert kc.same_code(caches[0]._keys.codec) and vc.same_code(caches[0]._values.codec)
        f.verify(decode=decode_layers)
    back = rvqstore.load_prompt_cache(path, model=llama)
    for a, b in zip(caches, back):
        assert (b.step, b.value_step) == (0.1, 0.12)
        assert all(np.array_equal(x, y) for x, y in zip(_state(a), _state(b)))
    r = rvqstore.resume(path, TOKENS + [5, 6], llama)
    assert r.reused == len(TOKENS)
    # the resumed caches go on exactly as the in-memory ones: same codes for new tokens, same logits
    nxt = mx.array([[5]])
    want = llama(nxt, cache=caches)
    got = llama(nxt, cache=r.cache)
    assert np.array_equal(np.array(want), np.array(got))
    for a, b in zip(caches, r.cache):
        assert all(np.array_equal(x, y) for x, y in zip(_state(a), _state(b)))
    # a prompt sharing nothing resumes into fresh caches of the same codes, not Lloyd–Max ones
    fresh = rvqstore.resume(path, [7, 8, 9], llama)
    assert fresh.reused == 0 and all((c.step, c.value_step) == (0.1, 0.12) for c in fresh.cache)


def test_sliding_window_layers_take_the_step(tmp_path):
    from tiny_models import build

    model = build("gemma3_text")[0]
    caches = rvqstore.make_prompt_cache(model, (4, 2), step=0.1)
    assert any(type(c) is RVQRotatingKVCache for c in caches)
    assert all(c.step == 0.1 for c in caches)
    prefill(model, TOKENS, caches)  # 40 tokens: past the 16-token window
    path = tmp_path / "w.rvq"
    rvqstore.save_prompt_cache(path, caches, tokens=TOKENS, model=model, compress="best")
    back = rvqstore.load_prompt_cache(path, model=model)
    for a, b in zip(caches, back):
        assert type(a) is type(b) and b.step == 0.1
        assert all(np.array_equal(x, y) for x, y in zip(_state(a), _state(b)))


def test_prefix_store_refuses_grid_codes(llama, tmp_path):
    from rvqstore.store import StoreConfigError

    caches = rvqstore.make_prompt_cache(llama, (4, 2), step=0.1)
    prefill(llama, TOKENS[:8], caches)
    store = rvqstore.PrefixStore(str(tmp_path / "s"), model=llama, bits=(4, 2), block_size=8)
    with pytest.raises(StoreConfigError, match="uniform grid"):
        store.put(TOKENS[:8], caches)


def test_gpu_attention_kernel_takes_only_one_table_for_both_sides():
    """The attention kernel decodes keys and values with one table: grids of other steps (equal bits)
    must send the call elsewhere (pure planning: runs on the CPU)."""
    from rvqstore.attention import kernel

    k = mx.array(np.random.default_rng(3).standard_normal((1, 2, 20, 64)).astype(np.float32))
    for value_step, want in ((0.4, "keys and values coded differently"), (None, None)):
        c = RVQKVCache((2, 2), step=0.3, value_step=value_step)
        c.update_and_fetch(k, k)
        assert kernel.supported(c.codes_view(), 4) == want
