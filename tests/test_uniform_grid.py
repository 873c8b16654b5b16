"""Uniform-grid codebooks (issue 11 item 4): the tables, the codec on them, bad steps, kernel plans.

A grid is a conditional codebook with uniform tables, so every path that reads tables (reference
encode/decode, the group-table decode, the kernels' plans, the header) must take it unchanged.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from rvqstore import RVQCodec, fused
from rvqstore.codebooks import grid_step, uniform_grid
from rvqstore.errors import CodecConfigError

GRIDS = [((4, 2), 0.1), ((3, 2), 0.2), ((4, 3), 0.045), ((2, 2), 0.3), ((3, 0), 0.5), ((1, 1), 0.8), ((4, 4), 0.02)]
IDS = [f"{b[0]}+{b[1]}@{s}" for b, s in GRIDS]
# what runs MLX: few bit widths, since each compiles its own code on a cold machine (seconds each)
RUN = [GRIDS[0], GRIDS[4]]
RUN_IDS = [IDS[0], IDS[4]]


def _points(bits, step):
    """numpy model of the grid: float64 points rounded once to float32, float32 midpoints."""
    L = 1 << sum(bits)
    v = ((np.arange(L) - (L - 1) / 2) * step).astype(np.float32)
    t = ((v[:-1].astype(np.float64) + v[1:]) / 2).astype(np.float32)
    return v, t


@pytest.mark.parametrize("bits,step", GRIDS, ids=IDS)
def test_tables_are_the_grid(bits, step):
    b1, b2 = bits
    g = uniform_grid(b1, b2, step)
    v, t = _points(bits, step)
    assert np.all(np.abs(np.diff(v.astype(np.float64)) - step) < 1e-6 * step + 1e-6)
    assert np.array_equal(v, -v[::-1])  # symmetric about 0
    L2 = 1 << b2
    if b2 == 0:
        assert set(g) == {"c1", "b1"}
        assert np.array_equal(g["c1"], v) and np.array_equal(g["b1"], t)
        return
    assert g["c2"].shape == (1 << b1, L2) and g["b2"].shape == (1 << b1, L2 - 1)
    assert all(a.dtype == np.float32 for a in g.values())
    assert np.array_equal(g["c2"].reshape(-1), v)
    # stage-1 boundaries: the thresholds at the cell edges; stage-2 rows: the thresholds inside the cell
    assert np.array_equal(g["b1"], t[L2 - 1::L2])
    for i in range(1 << b1):
        assert np.array_equal(g["b2"][i], t[i * L2: i * L2 + L2 - 1])
        assert g["c1"][i] == np.float32(v[i * L2:(i + 1) * L2].astype(np.float64).mean())
    # the interleaved list the codec counts over is exactly the grid's thresholds
    assert np.array_equal(RVQCodec(64, bits, step=step)._fine_thresholds, t)


@pytest.mark.parametrize("bits,step", RUN, ids=RUN_IDS)
def test_codec_encodes_and_decodes_the_grid(bits, step):
    dim = 64
    c = RVQCodec(dim, bits, seed=7, step=step)
    assert c.step == step and c.residual == ("conditional" if bits[1] else "none")
    v, t = _points(bits, step)
    rng = np.random.default_rng(sum(bits))
    x = rng.standard_normal((3, 11, dim)).astype(np.float32) + 0.8 * rng.standard_normal(dim).astype(np.float32)
    xm = mx.array(x)
    enc = c.encode(xm)
    y = np.asarray(c.rotate(xm)[0])
    k = (y[..., None] > t).sum(-1)  # index of the nearest grid point (numpy model)
    d = np.abs(y[..., None] - v.astype(np.float64))  # k is the nearest point (away from exact ties)
    clear = np.sort(d, axis=-1)[..., 1] - d.min(-1) > 1e-5
    assert clear.mean() > 0.99 and np.array_equal(k[clear], d.argmin(-1)[clear])
    y_hat = np.asarray(c.dequantize(enc.codes1, enc.codes2))
    assert np.array_equal(y_hat, v[k])
    inside = np.abs(y) < v[-1]
    assert np.max(np.abs(y - y_hat)[inside]) <= step / 2 * (1 + 1e-5)
    # stage 1 alone: the mean of the coarse cell
    y1 = np.asarray(c.dequantize(enc.codes1, None))
    g = uniform_grid(*bits, step)
    assert np.array_equal(y1, g["c1"][k >> bits[1]])
    # the binary search over the table equals the count over all thresholds (eager: no compile)
    assert np.array_equal(np.asarray(c._search_grid(mx.array(y))), np.asarray(RVQCodec._count_above(mx.array(y), t)))
    x_hat = np.asarray(c.decode(enc))
    assert x_hat.shape == x.shape and np.all(np.isfinite(x_hat))


def test_grid_beats_lloyd_max_at_equal_entropy_on_offset_coordinates():
    """The reason for grids: with per-coordinate offsets (the key mean), a grid's error at a lower
    per-coordinate index entropy (what a file with per-coordinate tables pays) is below Lloyd–Max's."""
    dim = 64
    rng = np.random.default_rng(0)
    X = (rng.standard_normal((4096, dim)) + 1.5 * rng.standard_normal(dim)).astype(np.float32)
    grid = RVQCodec(dim, (4, 3), step=0.06)
    y, scales = grid.rotate(mx.array(X))  # the same rotation for both codecs (seed 0)
    y, w = np.asarray(y), np.asarray(scales.astype(mx.float32)) ** 2  # ||x - x_hat||^2 = s^2 ||y - y_hat||^2 / dim

    def err_and_entropy(c):  # numpy model of the conditional codes (the codec's own codes: the tests above)
        k = (y[..., None] > c._fine_thresholds).sum(-1)  # the joint index
        d = ((y - c.centroids2.reshape(-1)[k]) ** 2).sum(-1)
        h = 0.0
        for j in range(dim):
            p = np.bincount(k[:, j]) / len(k)
            p = p[p > 0]
            h -= float((p * np.log2(p)).sum()) / dim
        return float((w * d).sum() / dim / (X.astype(np.float64) ** 2).sum()), h

    e_lm, h_lm = err_and_entropy(RVQCodec(dim, (4, 2)))
    e_grid, h_grid = err_and_entropy(grid)
    # error x 4^entropy: the rate-distortion figure of merit (D ~ 2^(-2R)); measured 0.40 against 0.49
    assert e_grid * 4 ** h_grid < 0.9 * e_lm * 4 ** h_lm, (e_grid, h_grid, e_lm, h_lm)


@pytest.mark.parametrize("step", [0.0, -0.1, math.inf, -math.inf, math.nan, 1e-45, 1e38, "0.1", None.__class__, True,
                                  np.float32(0)])
def test_bad_steps_are_typed_errors(step):
    with pytest.raises(CodecConfigError):
        RVQCodec(64, (4, 2), step=step)
    with pytest.raises(CodecConfigError):
        uniform_grid(4, 2, step)


def test_grid_needs_conditional_tables():
    with pytest.raises(CodecConfigError, match="conditional"):
        RVQCodec(64, (2, 2), residual="shared", step=0.3)
    RVQCodec(64, (2, 0), residual="shared", step=0.3)  # single stage: no residual kind to clash with
    with pytest.raises(CodecConfigError):
        uniform_grid(5, 0, 0.1)
    with pytest.raises(CodecConfigError):
        uniform_grid(2, -1, 0.1)


def test_header_round_trip_and_step_recognition():
    rng = np.random.default_rng(3)
    for bits in ((4, 2), (3, 3), (2, 0), (4, 4)):
        for step in np.exp(rng.uniform(math.log(1e-3), math.log(2.0), 25)):  # tables only: no MLX compile
            c = RVQCodec(64, bits, seed=11, step=float(step))
            r = RVQCodec.from_header(c.to_header())
            for a in ("centroids1", "boundaries1", "centroids2", "boundaries2", "signs"):
                assert np.array_equal(getattr(c, a), getattr(r, a)), a
            # recognized: the recovered step rebuilds exactly these tables
            assert r.step is not None and abs(r.step - step) <= 1e-6 * step
            assert RVQCodec(64, bits, seed=11, step=r.step).to_header() == c.to_header()
    assert grid_step(uniform_grid(2, 2, 0.3)["c1"], *list(uniform_grid(2, 2, 0.3).values())[1:]) == 0.3
    assert RVQCodec.from_header(RVQCodec(64, (4, 2)).to_header()).step is None  # Lloyd–Max is no grid
    x = mx.array(rng.standard_normal((5, 64)).astype(np.float32))
    c = RVQCodec(64, (4, 2), step=0.05)  # another step of a compiled bit width: no new compile
    r = RVQCodec.from_header(c.to_header())
    e = c.encode(x)
    assert np.array_equal(np.asarray(c.decode(e)), np.asarray(r.decode(e)))
    assert "step=0.05" in repr(c) and "step" not in repr(RVQCodec(64))


def test_scale_rule_follows_the_grid():
    c = RVQCodec(64, (4, 2), step=0.1)
    assert c.decode_bound == pytest.approx(31.5 * 0.1, rel=1e-6)
    assert c.max_scale(mx.float16) == pytest.approx(65504 * (1 - 2 ** -8) / c.decode_bound, rel=1e-6)
    assert c.bits_per_coordinate == RVQCodec(64, (4, 2)).bits_per_coordinate  # fixed width in memory


# ---- GPU path selection: the plan a grid gets, and the kernels' numpy model on it ----------------------------
@pytest.mark.parametrize("bits,step", RUN, ids=RUN_IDS)
def test_kernel_plan_takes_grids_as_conditional_tables(bits, step):
    from test_kernels import np_decode, np_encode  # the kernels' algorithm in numpy (exact on the CPU)

    dim = 64
    c = RVQCodec(dim, bits, seed=2, step=step, use_kernels=False)
    enc_plan = fused.make_plan(c, fused.ENCODE)
    dec_plan = fused.make_plan(c, fused.DECODE)
    assert isinstance(enc_plan, fused.Plan) and isinstance(dec_plan, fused.Plan)
    want = fused.MODE_CONDITIONAL if bits[1] else fused.MODE_SINGLE
    assert enc_plan.mode == dec_plan.mode == want
    v, t = _points(bits, step)
    assert np.array_equal(np.asarray(enc_plan.tab)[:enc_plan.tabn], t)
    assert np.array_equal(np.asarray(dec_plan.tab)[:dec_plan.tabn], v)
    noise = 2 * np.random.default_rng(1).standard_normal((9, dim))
    y = np.concatenate([fused.boundary_probe(c), noise]).astype(np.float32)
    r1, r2 = c._quantize_fn(mx.array(y))
    g1, g2 = np_encode(enc_plan, y)
    assert np.array_equal(g1, np.asarray(r1)) and (not bits[1] or np.array_equal(g2, np.asarray(r2)))
    assert np.array_equal(np_decode(dec_plan, r1, r2).view(np.uint32), np.asarray(c.dequantize(r1, r2)).view(np.uint32))


def test_grid_codec_dispatches_to_the_kernels_on_a_gpu(monkeypatch):
    """On a (stand-in) CUDA device a grid codec's encode/decode go through the fused kernels' launches,
    pass their first-use check against the reference, and give the reference's codes."""
    from test_kernels import np_decode, np_encode

    calls = {"encode": 0, "decode": 0}

    def enc(plan, y2d, dialect, **kw):
        calls["encode"] += 1
        return tuple(mx.array(a) if a is not None else None for a in np_encode(plan, np.asarray(y2d)))

    def dec(plan, c1, c2, dialect, **kw):
        calls["decode"] += 1
        return mx.array(np_decode(plan, c1, c2))

    fused.reset()
    monkeypatch.setattr(fused, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(fused, "_on_gpu", lambda: True)
    monkeypatch.setattr(fused, "launch_encode", enc)
    monkeypatch.setattr(fused, "launch_decode", dec)
    try:
        c = RVQCodec(64, (4, 2), seed=4, step=0.1)
        ref = RVQCodec(64, (4, 2), seed=4, step=0.1, use_kernels=False)
        x = mx.array(np.random.default_rng(6).standard_normal((3, 9, 64)).astype(np.float32))
        e, r = c.encode(x), ref.encode(x)
        assert calls["encode"] >= 1 and not fused.disabled()
        assert np.array_equal(np.asarray(e.codes1), np.asarray(r.codes1))
        assert np.array_equal(np.asarray(e.codes2), np.asarray(r.codes2))
        assert np.array_equal(np.asarray(c.decode(e)), np.asarray(ref.decode(r)))
        assert calls["decode"] >= 1 and not fused.disabled()
    finally:
        fused.reset()
