"""rvqstore.presets and per-side bits in RVQKVCache: budgets kept, caches built, and a snapshot
of a per-side cache saved, reloaded bit for bit and resumed with its settings."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rvqstore  # noqa: E402
from rvqstore import CodecConfigError, RVQCodec, RVQKVCache, presets  # noqa: E402
from rvqstore.generation import prefill  # noqa: E402


@pytest.mark.parametrize("name,budget", [("near-lossless", 6.0), ("balanced", 4.5), ("small", 3.0)])
def test_presets_keep_their_budget_and_favour_keys(name, budget):
    p = presets.get(name)
    assert p.bits_per_coordinate(64) <= budget
    assert RVQCodec(64, p.key_bits).predicted_relative_error() < RVQCodec(64, p.value_bits).predicted_relative_error()


def test_unknown_preset_is_a_typed_error():
    with pytest.raises(CodecConfigError, match="unknown preset 'tiny'.*balanced"):
        presets.get("tiny")
    with pytest.raises(CodecConfigError):
        presets.get(None)


def test_bad_value_bits_refused_before_any_state():
    with pytest.raises(CodecConfigError):
        RVQKVCache((4, 1), value_bits=(5, 0))


def test_per_side_cache_codes_each_side_with_its_codec():
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.standard_normal((1, 2, 20, 64)).astype(np.float32)) for _ in range(2))
    c = RVQKVCache((4, 1), value_bits=(2, 1))
    kk, vv = c.update_and_fetch(k, v)
    ck, cv = RVQCodec(64, (4, 1)), RVQCodec(64, (2, 1))
    assert np.array_equal(np.array(kk), np.array(ck.decode(ck.encode(k))))
    assert np.array_equal(np.array(vv), np.array(cv.decode(cv.encode(v))))
    same = RVQKVCache((4, 1))
    assert same.value_bits == (4, 1)


@pytest.fixture(scope="module")
def tiny():
    from tiny_models import build

    return build("llama")[0]


def test_preset_snapshot_roundtrip_and_resume(tiny, tmp_path):
    caches = presets.make_cache(tiny, "balanced")
    assert all(type(c) is RVQKVCache and c.value_bits == (2, 1) and c.codec_bits == (4, 1) for c in caches)
    toks = [int(i) for i in np.random.default_rng(1).integers(3, 128, 30)]
    prefill(tiny, toks, caches)
    path = tmp_path / "p.rvq"
    rvqstore.save_prompt_cache(path, caches, tokens=toks, model=tiny)
    back = rvqstore.load_prompt_cache(path, model=tiny)
    for a, b in zip(caches, back):
        assert (b.codec_bits, b.value_bits) == ((4, 1), (2, 1))
        for x, y in zip(a.keys_and_values(), b.keys_and_values()):
            assert np.array_equal(np.array(x), np.array(y))
    r = rvqstore.resume(path, toks + [5, 6], tiny)
    assert r.reused == 30 and all(c.value_bits == (2, 1) for c in r.cache)


def test_profile_allocates_per_layer_within_the_budget(tiny, tmp_path):
    n = len(tiny.layers)
    sens = {(l, s): (5.0 if l == 0 else 1.0) * (3.0 if s == "k" else 1.0) for l in range(n) for s in "kv"}
    p = presets.get("balanced")
    bits = p.layer_bits(n, sens)
    avg = sum(RVQCodec(64, kb).bits_per_coordinate + RVQCodec(64, vb).bits_per_coordinate for kb, vb in bits) / (2 * n)
    assert avg <= 4.5 and bits[0][0] != bits[1][1]
    caches = presets.make_cache(tiny, "balanced", profile=sens)
    assert [(c.codec_bits, c.value_bits) for c in caches] == bits
    f = tmp_path / "prof.json"
    f.write_text('{"slots": {"0:k": 1.0, "0:v": 0.5}}')
    with pytest.raises(CodecConfigError, match="another model"):
        presets.make_cache(tiny, "balanced", profile=f)
    f.write_text("not json")
    with pytest.raises(CodecConfigError, match="not a sensitivity profile"):
        presets.make_cache(tiny, "balanced", profile=f)
