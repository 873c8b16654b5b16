"""Scales that decode beyond the output dtype are refused (issue 12, item 8).

The rule (rvqstore.codec, "Scales"): a scale is NaN, or finite with 0 <= s <= max_scale(dtype) =
F * (1 - 2^-8) / A. The encoder gives out-of-range vectors a NaN scale; readers reject the rest.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQCodec, RVQKVCache, load_prompt_cache, save_prompt_cache
from rvqstore.codec import EncodedVectors
from rvqstore.errors import InvalidScaleError, NonFiniteInputError
from rvqstore.format import FormatError, MalformedSectionError, open_rvq
from rvqstore.format.quantizer import decode_layers

DTYPES = [mx.float16, mx.bfloat16, mx.float32]
CONFIGS = [((4, 2), "conditional"), ((2, 2), "shared"), ((4, 4), "conditional"), ((3, 0), "conditional")]


def _bf16(values) -> mx.array:
    return mx.array(np.array(values, np.float32)).astype(mx.bfloat16)


@pytest.mark.parametrize("bits,residual", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_worst_case_codes_at_the_bound_decode_finite_and_near_the_top(bits, residual, dtype):
    """The bound is safe (finite for the codes that decode largest) and tight (within ~1% of F)."""
    dim = 64
    codec = RVQCodec(dim, bits, residual=residual)
    # y_hat aligned with one column of the inverse rotation: x_hat_0 = scale * A exactly
    col = np.array(mx.hadamard_transform(mx.eye(dim), scale=1.0))[:, 0] * codec.signs[0]
    y = mx.array((col * 1e3).astype(np.float32)[None])  # far out: the extreme codes on each side
    c1, c2 = codec.quantize(y)
    s = codec.max_scale(dtype)
    s_bf16 = float((np.array([s], np.float32).view(np.uint32) >> 16 << 16).view(np.float32)[0])  # truncated: <= s
    out = codec.decode(EncodedVectors(_bf16([s_bf16]), c1, c2, dtype))
    top = float(mx.max(mx.abs(out.astype(mx.float32))).item())
    big = float(mx.finfo(dtype).max)
    assert np.isfinite(top) and top <= big
    assert top >= 0.98 * big * (1 - 2 ** -8) * s_bf16 / s


@pytest.mark.parametrize("dtype", DTYPES)
def test_check_scales_rule(dtype):
    codec = RVQCodec(64, (4, 2))
    s = codec.max_scale(dtype)
    codec.check_scales(_bf16([0.0, -0.0, np.nan, 1.0, s * 0.99]), dtype)
    for bad in (np.inf, -np.inf, -1.0, s * 1.02):
        with pytest.raises(InvalidScaleError):
            codec.check_scales(_bf16([1.0, bad]), dtype)
    with pytest.raises(InvalidScaleError, match="float16"):
        codec.check_scales(_bf16([1e6]), mx.float16)
    codec.check_scales(_bf16([1e6]), mx.float32)


def test_encoder_gives_out_of_range_vectors_a_nan_scale():
    codec = RVQCodec(64, (4, 2))
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float16)
    x[1] = 65504.0  # finite in float16, but its norm (524032) is far beyond what float16 decodes to
    x = mx.array(x)
    with pytest.raises(NonFiniteInputError, match="norm"):
        codec.encode(x)
    enc = codec.encode(x, check_finite=False)
    sc = np.array(enc.scales.astype(mx.float32))
    assert np.isnan(sc[1]) and np.all(np.isfinite(sc[[0, 2]]))
    out = np.array(codec.decode(enc).astype(mx.float32))
    assert np.all(np.isnan(out[1])) and np.all(np.isfinite(out[[0, 2]]))
    codec.check_scales(enc.scales, mx.float16)  # what the encoder writes is what readers accept
    # the same values in float32 are in range there
    enc32 = codec.encode(x.astype(mx.float32))
    assert np.all(np.isfinite(np.array(codec.decode(enc32))))


def _filled_cache(dtype=mx.float16) -> RVQKVCache:
    rng = np.random.default_rng(1)
    c = RVQKVCache((4, 2))
    k = mx.array(rng.standard_normal((1, 2, 6, 64)).astype(np.float32)).astype(dtype)
    c.update_and_fetch(k, k * 0.5)
    return c


@pytest.mark.parametrize("bad", [np.inf, 1e6, -2.0])
def test_from_packed_refuses_out_of_range_scales(bad):
    c = _filled_cache()
    ks, kc1, kc2, vs, vc1, vc2, _, _ = c.state
    ks = mx.array(ks)
    ks[0, 1, 3] = bad
    with pytest.raises(InvalidScaleError):
        RVQKVCache.from_packed(keys=(ks, kc1, kc2), values=(vs, vc1, vc2), dense_keys=None, dense_values=None,
                               dtype=mx.float16, head_dims=(64, 64), bits=(4, 2))
    # the same arrays are fine for a float32 cache when the value is finite and positive
    if np.isfinite(bad) and bad > 0:
        RVQKVCache.from_packed(keys=(ks, kc1, kc2), values=(vs, vc1, vc2), dense_keys=None, dense_values=None,
                               dtype=mx.float32, head_dims=(64, 64), bits=(4, 2))


@pytest.mark.parametrize("bad", [np.inf, 1e6])
def test_file_with_an_out_of_range_scale_fails_verify_and_load(tmp_path, bad):
    """A file whose checksums are all valid but that holds +Inf (or 1e6 with float16 keys)."""
    c = _filled_cache()
    c._keys.scales[0, 0, 2] = bad  # in memory, so the writer checksums it like any other value
    path = tmp_path / "bad.rvq"
    save_prompt_cache(path, [c], tokens=list(range(6)))
    with open_rvq(path) as f:
        f.verify()  # container level: every checksum is right
        with pytest.raises(FormatError, match="scale"):
            f.verify(decode=decode_layers)
    with pytest.raises(MalformedSectionError, match="layer 0 keys: 1 scale"):  # a FormatError naming the file
        load_prompt_cache(path)
    good = tmp_path / "good.rvq"
    save_prompt_cache(good, [_filled_cache()], tokens=list(range(6)))
    with open_rvq(good) as f:
        f.verify(decode=decode_layers)
    assert load_prompt_cache(good)[0].offset == 6


@pytest.mark.parametrize("bits,residual", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bit_pattern_check_is_the_rule_on_every_bfloat16(bits, residual, dtype):
    """refused_scales works on bit patterns; on all 65,536 bfloat16 values it refuses exactly what the
    rule's float comparison (NaN, or 0 <= s <= max_scale) refuses."""
    codec = RVQCodec(64, bits, residual=residual)
    every = mx.array(np.arange(1 << 16, dtype=np.uint16)).view(mx.bfloat16)
    s = every.astype(mx.float32)
    rule = ~mx.isnan(s) & ~((s >= 0) & (s <= codec.max_scale(dtype)))
    got = codec.refused_scales(every, dtype)
    assert got.dtype == mx.bool_ and bool(mx.array_equal(got, rule).item())
    n = int(mx.sum(rule).item())
    assert 0x8000 < n < 0x10000 - 2 * 0x7F  # every negative non-zero, both infinities, the values above the bound


def test_a_refused_scale_is_named_in_the_error():
    codec = RVQCodec(64, (4, 2))
    with pytest.raises(InvalidScaleError, match=r"^2 scale\(s\) .* first -1\.0$"):
        codec.check_scales(_bf16([[1.0, -1.0], [np.nan, np.inf]]), mx.float16)


@pytest.mark.parametrize("layer,side", [(0, "keys"), (2, "values"), (3, "keys")])
def test_a_load_checks_every_layers_scales_in_one_pass_and_names_the_refused_one(tmp_path, layer, side):
    """A load checks the whole file's scales in one reduction (rvqstore.codec.scales_pass); where it refuses, the
    error names the first refused layer and side as the per-layer check does."""
    caches = [_filled_cache() for _ in range(4)]
    getattr(caches[layer], f"_{side}").scales[0, 1, 3] = np.inf
    path = tmp_path / "bad.rvq"
    save_prompt_cache(path, caches, tokens=list(range(6)))
    with pytest.raises(MalformedSectionError, match=f"layer {layer} {side}: 1 scale"):
        load_prompt_cache(path)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scales_pass_is_the_per_array_check_over_all_of_them(dtype):
    """scales_pass(checks) is True exactly when check_scales passes on every entry (random patterns, a few
    refused ones in one entry, empty scales, a wrong dtype)."""
    from rvqstore.codec import scales_pass

    rng = np.random.default_rng(5)
    codecs = [RVQCodec(64, b, residual=r) for b, r in CONFIGS]
    for trial in range(40):
        checks = []
        for c in codecs:
            top = min(c.max_scale(dtype), float(np.finfo(np.float32).max) / 2)
            v = np.abs(rng.standard_normal(int(rng.integers(0, 9)))) * top * 0.9
            if trial % 3 == 0 and v.size and rng.random() < 0.5:
                v[int(rng.integers(v.size))] = rng.choice([np.inf, -1.0, c.max_scale(dtype) * 1.1])
            checks.append((c, _bf16(np.minimum(v, np.finfo(np.float32).max)), dtype))
        one_by_one = True
        for c, s, d in checks:
            try:
                c.check_scales(s, d)
            except InvalidScaleError:
                one_by_one = False
        assert scales_pass(checks) == one_by_one
    assert scales_pass([]) and not scales_pass([(codecs[0], mx.zeros((2,), mx.float32), dtype)])
