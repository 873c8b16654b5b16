"""tools/quality (the evaluation behind docs/quality.md): metrics on cases with known answers, bit
accounting, the rotated-affine baseline, bit allocation, and the whole path end to end on a tiny
random-weight model (the real-model figures come from tools/eval_quality.py, not from tests)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

from quality import allocate as A  # noqa: E402
from quality import catalog  # noqa: E402
from quality import methods as M  # noqa: E402
from quality import metrics as Q  # noqa: E402
from quality import protocol as P  # noqa: E402
from quality.store import RunStore  # noqa: E402
from quality.texts import DEFAULT_TEXTS, Text, load_tokens, text_from_arg  # noqa: E402
from rvqstore import RVQKVCache  # noqa: E402


def rand(shape, seed, scale=1.0):
    return mx.array((scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32))


def log_softmax(x):
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


# ---- metrics -----------------------------------------------------------------------------------------

def test_compare_known_answers():
    lp = log_softmax(rand((20, 30), 0))
    t = mx.array(np.random.default_rng(1).integers(0, 30, 20), dtype=mx.int32)
    same = Q.compare(lp, lp, t)
    assert np.all(same.kl == 0) and np.all(same.agree) and np.array_equal(same.nll, same.nll_ref)
    other = log_softmax(rand((20, 30), 2))
    s = Q.compare(lp, other, t)
    p, a, b = np.exp(np.array(lp, np.float64)), np.array(lp, np.float64), np.array(other, np.float64)
    np.testing.assert_allclose(s.kl, np.sum(p * (a - b), axis=-1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(s.nll, -b[np.arange(20), np.array(t)], rtol=1e-5)
    assert np.array_equal(s.agree, np.argmax(a, -1) == np.argmax(b, -1))


def test_ppl_delta_is_exact_for_a_constant_loss_shift_and_zero_for_none():
    nll_ref = np.random.default_rng(3).uniform(0.5, 3.0, 300)
    zeros = np.zeros(300)
    same = Q.TokenScores(zeros, nll_ref, nll_ref, np.ones(300, bool))
    assert Q.ppl_delta_ci([same]) == (0.0, 0.0, 0.0)
    shifted = Q.TokenScores(zeros, nll_ref + 0.1, nll_ref, np.ones(300, bool))
    d, lo, hi = Q.ppl_delta_ci([shifted, shifted])
    assert d == pytest.approx(math.expm1(0.1)) and lo == pytest.approx(d) and hi == pytest.approx(d)


def test_bootstrap_interval_covers_the_point_and_widens_with_noise():
    rng = np.random.default_rng(4)
    nll_ref = rng.uniform(0.5, 3.0, 512)
    widths = []
    for noise in (0.05, 0.5):
        s = Q.TokenScores(np.zeros(512), nll_ref + 0.02 + noise * rng.standard_normal(512), nll_ref, np.ones(512, bool))
        d, lo, hi = Q.ppl_delta_ci([s])
        assert lo < d < hi
        widths.append(hi - lo)
    assert widths[1] > 3 * widths[0]


def test_blocks_stay_in_range():
    idx = Q._blocks(100, np.random.default_rng(0), 32)
    assert len(idx) == 100 and idx.min() >= 0 and idx.max() < 100


def test_pooled_summary_weighs_texts_equally():
    a = Q.TokenScores(np.full(10, 1.0), np.ones(10), np.ones(10), np.ones(10, bool))
    b = Q.TokenScores(np.full(90, 3.0), np.ones(90), np.ones(90), np.zeros(90, bool))
    s = Q.summarize([a, b])
    assert s["tok_kl"] == pytest.approx(2.0) and s["top1_agree"] == pytest.approx(0.5) and s["n_scored"] == 100


# ---- methods and bits -------------------------------------------------------------------------------------

@pytest.mark.parametrize("q,bits", [(M.rvq((2, 2)), 4.25), (M.rvq((4, 1)), 5.25), (M.rvq((1, 1)), 2.25),
                                    (M.rotated_affine(4, 64), 4.5), (M.rotated_affine(2, 32), 3.0),
                                    (M.rotated_affine(3, 64), 3.5), (M.affine(8, 64), 8.5), (M.float16(), 16.0)])
def test_stored_bits(q, bits):
    assert q.bits == bits


def test_method_bits_average_slots_and_count_sink_tokens():
    m = M.per_side(M.rvq((4, 1)), M.rvq((2, 1)), "x")
    assert m.bits(30, 1000) == pytest.approx((5.25 + 3.25) / 2)
    s = M.uniform(M.rvq((2, 2)), "x", sink=4)
    assert s.bits(30, 100) == pytest.approx((4 * 16 + 96 * 4.25) / 100)
    table = {(l, side): (4, 2) if l == 0 else (2, 2) for l in range(3) for side in M.SIDES}
    assert M.allocated(table, "a", "f").bits(3, 10) == pytest.approx((6.25 + 2 * 4.25) / 3)


def test_method_bits_are_what_a_cache_with_codec_state_holds():
    """Method.bits of a method with the sink token and the key mean: the bytes RVQKVCache keeps for
    them (packed codes + norms, sink keys/values and the mean at 16 bits), per coordinate."""
    rng = np.random.default_rng(3)
    n, h, d = 40, 2, 64
    for sink, center in ((1, True), (3, False), (0, True)):
        m = M.variant(M.per_side(M.rvq((4, 1)), M.rvq((2, 2)), "x"), sink=sink, center_keys=center)
        caches = [RVQKVCache((4, 1), value_bits=(2, 2), sink_tokens=sink, center_keys=center) for _ in range(3)]
        for c in caches:
            k, v = (mx.array(rng.standard_normal((1, h, n, d)).astype(np.float32)) for _ in range(2))
            c.update_and_fetch(k, v)
        held = sum(c.packed_nbytes for c in caches) * 8 / (3 * n * h * d * 2)
        assert m.bits(3, n) == pytest.approx(held, rel=1e-9), (sink, center)


def test_rotated_affine_is_an_isometry_around_the_quantizer():
    x = rand((2, 50, 64), 5)
    q = M.rotated_affine(4, 64)
    err = mx.sum(mx.square(x - q.fn(x))).item()
    y = mx.hadamard_transform(x, scale=1 / 8)
    y16 = y.astype(mx.float16)
    wq, s, b = mx.quantize(y16, group_size=64, bits=4)
    y_hat = mx.dequantize(wq, s, b, group_size=64, bits=4).astype(mx.float32)
    assert err == pytest.approx(mx.sum(mx.square(y - y_hat)).item(), rel=1e-3)


def test_rotation_helps_affine_on_outlier_channels():
    x = np.random.default_rng(6).standard_normal((3, 200, 64)).astype(np.float32)
    x[..., 5] *= 30.0  # one outlier channel, as keys have
    x = mx.array(x)

    def rel(q):
        return float(mx.mean(mx.sum(mx.square(x - q.fn(x)), -1) / mx.sum(mx.square(x), -1)).item())

    assert rel(M.rotated_affine(4, 64)) < 0.5 * rel(M.affine(4, 64))
    assert rel(M.rotated_affine(8, 64)) < 1e-3


def test_rvq_quantizer_matches_the_codec():
    from rvqstore import RVQCodec

    x = rand((2, 3, 17, 64), 7)
    c = RVQCodec(64, (2, 2))
    assert np.array_equal(np.array(M.rvq((2, 2)).fn(x)), np.array(c.decode(c.encode(x))))


# ---- allocation ---------------------------------------------------------------------------------------------

def _sens(n=6):
    return {(l, s): (8.0 if l == 0 else 1.0) * (4.0 if s == "k" else 1.0) for l in range(n) for s in M.SIDES}


@pytest.mark.parametrize("budget", [3.0, 4.5, 6.0])
def test_allocation_meets_the_budget_and_beats_uniform(budget):
    sens = _sens()
    table = A.allocate(sens, budget)
    assert A.average_bits(table) <= budget + 1e-9
    uniform = max((o for o in A.OPTIONS if M.rvq(o).bits <= budget), key=lambda o: M.rvq(o).bits)
    assert A.predicted(sens, table) < A.predicted(sens, {k: uniform for k in sens})
    # a more sensitive slot never gets fewer bits than a less sensitive one
    for a in sens:
        for b in sens:
            if sens[a] > sens[b]:
                assert M.rvq(table[a]).bits >= M.rvq(table[b]).bits


def test_allocation_refuses_an_impossible_budget():
    with pytest.raises(ValueError, match="below the cheapest"):
        A.allocate(_sens(), 2.0)


def test_profile_roundtrip(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"slots": {"0:k": 0.5, "0:v": 0.25}}))
    assert catalog.load_profile(p) == {(0, "k"): 0.5, (0, "v"): 0.25}
    with pytest.raises(ValueError, match="needs --profile"):
        catalog.group("alloc")
    with pytest.raises(ValueError, match="unknown method group"):
        catalog.group("nope")


# ---- texts --------------------------------------------------------------------------------------------------

def test_bundled_texts_exist_with_notice():
    for t in DEFAULT_TEXTS:
        assert t.path.stat().st_size > 10_000, t
    assert [t.held_aside for t in DEFAULT_TEXTS].count(True) == 1
    notice = (ROOT / "tools" / "texts" / "NOTICE.md").read_text()
    assert all(t.path.name in notice for t in DEFAULT_TEXTS)
    assert text_from_arg("held-x=/a/b.txt").held_aside and not text_from_arg("/a/prose.txt").held_aside
    assert text_from_arg("/a/prose.txt").name == "prose"


class CharTokenizer:
    def encode(self, s):
        return [ord(c) % 128 for c in s]

    def get_vocab(self):  # for the model fingerprint of saved files
        return {chr(i): i for i in range(128)}


def test_short_text_is_refused(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("short")
    with pytest.raises(ValueError, match="only 5 tokens"):
        load_tokens(CharTokenizer(), Text("t", f), 6)


# ---- end to end on a tiny random-weight model -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    from tiny_models import build

    model, _ = build("llama")
    return model


@pytest.mark.parametrize("protocol", P.PROTOCOLS)
def test_exact_method_reproduces_the_reference(tiny, protocol):
    ids = [int(i) for i in np.random.default_rng(8).integers(3, 128, 48)]
    ref = P.reference(tiny, ids, protocol, chunk=8)
    exact = M.Method("exact", "x", lambda l, s: M.Quantizer("exact", 32.0, lambda x: x))
    run = P.run_method(tiny, ids, exact, ref, protocol, chunk=8)
    assert len(run.scores.kl) == 24 and np.all(run.scores.kl < 1e-6) and np.all(run.scores.agree)
    assert run.k_err == 0.0 and run.v_err == 0.0


def test_more_bits_less_kl_and_error_and_sink_exact(tiny):
    ids = [int(i) for i in np.random.default_rng(9).integers(3, 128, 64)]
    ref = P.reference(tiny, ids)
    runs = {b: P.run_method(tiny, ids, M.uniform(M.rvq(b, 16), "r"), ref) for b in ((1, 1), (4, 4))}
    assert runs[(4, 4)].scores.kl.mean() < runs[(1, 1)].scores.kl.mean() / 10
    assert runs[(4, 4)].k_err < runs[(1, 1)].k_err / 100
    # keeping all 64 tokens as sink tokens leaves only float16 rounding
    sink = P.run_method(tiny, ids, M.uniform(M.rvq((1, 1), 16), "r", sink=64), ref)
    assert sink.k_err < 1e-6 and sink.scores.kl.mean() < 1e-6


def test_evaluate_pools_tuning_texts_and_reports_the_held_aside_apart(tiny, tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import eval_quality as EQ
    from quality.report import render, write_report

    rng = np.random.default_rng(10)
    texts = []
    for name in ("a", "b", "held-c"):
        f = tmp_path / f"{name}.txt"
        f.write_text("".join(chr(c) for c in rng.integers(97, 123, 80)))
        texts.append(text_from_arg(f"{name}={f}"))
    methods = [M.uniform(M.rvq((2, 2), 16), "RVQ"), M.uniform(M.float16(), "fp16")]  # mx.quantize needs groups >= 32
    store = RunStore(tmp_path / "runs")
    res = EQ.evaluate(tiny, CharTokenizer(), texts, methods, n_tokens=64, protocols=("half", "stream"), chunk=16,
                      store=store, log=lambda s: None)
    assert len(res["rows"]) == 4 and len(list((tmp_path / "runs").glob("*.npz"))) == 12
    r = next(r for r in res["rows"] if r["name"] == "2+2" and r["protocol"] == "half")
    per = [r["texts"][n]["tok_kl"] for n in ("a", "b")]
    assert r["pooled"]["tok_kl"] == pytest.approx(sum(per) / 2)  # the held-aside text is not pooled
    assert r["texts"]["held-c"]["tok_kl"] > 0
    assert set(r["disk"]["texts"]) == {"a", "b", "held-c"} and set(r["disk"]["pooled"]) == {"none", "auto"}
    assert "disk" not in next(x for x in res["rows"] if x["name"] == "float16")  # no file form

    class NotRun:  # a second evaluation reuses every stored run: the model is never called
        layers = tiny.layers

        def __call__(self, *a, **k):
            raise AssertionError("model called")

    again = EQ.evaluate(NotRun(), CharTokenizer(), texts, methods, n_tokens=64, protocols=("half", "stream"),
                        chunk=16, store=store, log=lambda s: None)
    assert again["rows"] == res["rows"]
    res["argv"] = "--test"
    md = render(res)
    assert "| 2+2 | 5.00 |" in md and "KL held-c" in md
    pytest.importorskip("matplotlib")
    write_report(res, tmp_path / "docs")
    assert (tmp_path / "docs" / "quality.png").stat().st_size > 10_000


# ---- bits on disk ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny32():
    """The tiny llama with head dim 32 (mx.quantize groups of at least 32 fit the head dim)."""
    import tiny_models

    tiny_models.CONFIGS["llama32"] = dict(tiny_models.CONFIGS["llama"], head_dim=32)
    try:
        return tiny_models.build("llama32")[0]
    finally:
        del tiny_models.CONFIGS["llama32"]


def test_bits_on_disk_are_real_file_sizes_and_follow_per_side_bits(tiny32):
    from quality.disk_bits import bits_on_disk

    ids = [int(i) for i in np.random.default_rng(12).integers(3, 128, 96)]
    tok = CharTokenizer()
    d = {b: bits_on_disk(tiny32, tok, ids, M.uniform(M.rvq(b, 32), "r"), ("none", "auto")) for b in ((4, 2), (1, 1))}
    for b, got in d.items():
        fixed = M.rvq(b, 32).bits
        assert fixed < got["none"] < fixed + 3.0  # the header is counted, and small against 96 tokens
        assert got["auto"] <= got["none"] * 1.01  # zstd where it saves >= 2 % (a frame's header fields cost a little)
    # per-side settings reach the file: two files that differ only in the values' bits differ by their codes
    sides = [M.per_side(M.rvq((4, 2), 32), M.rvq(v, 32), "s") for v in ((1, 1), (2, 2))]
    a, b = (bits_on_disk(tiny32, tok, ids, m, ("none",))["none"] for m in sides)
    assert b - a == pytest.approx(sides[1].bits(2, 48) - sides[0].bits(2, 48), abs=0.15)  # + their tables


def test_affine_bits_on_disk_count_codes_scales_biases_and_zstd(tiny32):
    from quality.disk_bits import bits_on_disk, file_form

    ids = [int(i) for i in np.random.default_rng(13).integers(3, 128, 64)]
    for q in (M.rotated_affine(4, 32, 32), M.affine(8, 32, 32)):
        d = bits_on_disk(tiny32, None, ids, M.uniform(q, "a"))
        assert d["raw"] == pytest.approx(q.bits) and d["best"] <= d["zstd"] <= d["raw"]  # 4 + 32/32, 8 + 32/32
    # codec state (sink tokens, key mean) is part of the .rvq format: an RVQ method with it has a file form,
    # an affine one (mlx-lm's arrays hold no such state) has none
    assert file_form(M.variant(M.uniform(M.rvq((2, 2), 32), "r"), sink=1), 2) == "rvq"
    assert file_form(M.variant(M.uniform(M.rotated_affine(4, 32, 32), "a"), sink=1), 2) is None
    assert file_form(M.uniform(M.float16(), "f"), 2) is None


def test_disk_summary_pools_tuning_texts_and_compares_like_for_like():
    from quality.disk_bits import on_disk, summarize_disk

    rvq_row = {"disk": summarize_disk({"a": {"none": 4.3, "auto": 4.0}, "b": {"none": 4.3, "auto": 4.2},
                                       "held": {"none": 4.3, "auto": 3.0}}, ["a", "b"])}
    assert on_disk(rvq_row) == pytest.approx(4.1) and on_disk(rvq_row, stat="max") == pytest.approx(4.2)
    assert on_disk(rvq_row, text="held") == 3.0 and on_disk(rvq_row, "best") is None
    aff = {"disk": summarize_disk({"a": {"raw": 4.5, "zstd": 4.2}, "b": {"raw": 4.5, "zstd": 4.0}}, ["a", "b"])}
    assert on_disk(aff, "auto") == pytest.approx(4.1) and on_disk(aff, "none") == pytest.approx(4.5)
    assert on_disk({"name": "x"}) is None


@pytest.mark.parametrize("protocol,chunk", [("half", 128), ("stream", 7), ("stream", 1)])
def test_protocols_score_the_second_half_like_one_full_pass(tiny, protocol, chunk):
    ids = [int(i) for i in np.random.default_rng(11).integers(3, 128, 50)]
    full = tiny(mx.array(ids)[None])[0]
    full = full - mx.logsumexp(full, axis=-1, keepdims=True)
    from mlx_lm.models.cache import KVCache

    lp = P.next_token_logprobs(tiny, ids, [KVCache() for _ in tiny.layers], protocol, chunk)
    assert lp.shape == (25, 128)
    # float32 rounding on the CPU; MLX's CUDA backend runs float32 matmuls at TF32 precision (10-bit
    # mantissa: differences up to ~3e-3 measured on the H200, tools/results/suite-gpu.txt)
    atol = 1e-4 if mx.default_device() == mx.cpu else 1e-2
    np.testing.assert_allclose(np.array(lp), np.array(full[24:49]), atol=atol)
    with pytest.raises(ValueError, match="protocol must be one of"):
        P.next_token_logprobs(tiny, ids, [], "whole")


@pytest.mark.model
def test_real_model_short_text(smollm2):
    """The bundled SmolLM2 on 96 tokens of the prose text: the exact path reproduces the reference,
    and more bits give less token KL and key error (real activations, the same code as the tool)."""
    model, tok = smollm2
    ids = load_tokens(tok, DEFAULT_TEXTS[0], 96)
    ref = P.reference(model, ids)
    exact = P.run_method(model, ids, M.Method("exact", "x", lambda l, s: M.Quantizer("x", 32.0, lambda x: x)), ref)
    assert float(exact.scores.kl.max()) < 1e-5
    lo, hi = (P.run_method(model, ids, M.uniform(M.rvq(b), "r"), ref) for b in ((2, 1), (4, 2)))
    assert 0 < hi.scores.kl.mean() < lo.scores.kl.mean() and hi.k_err < lo.k_err / 10


# ---- uniform grids: methods, files with compress="best", the estimate used while fitting -------------
def test_grid_quantizer_is_the_codec_on_a_uniform_grid():
    from rvqstore import RVQCodec
    from rvqstore.bit_allocation import grid_bits

    q = M.grid(0.3, 64)
    assert q.step == 0.3 and q.rvq_bits == grid_bits(0.3) == (4, 1)
    assert q.bits == RVQCodec(64, (4, 1), step=0.3).bits_per_coordinate
    x = rand((2, 3, 50, 64), 40)
    codec = RVQCodec(64, (4, 1), step=0.3)
    assert mx.array_equal(q.fn(x), codec.decode(codec.encode(x)))
    # the error in the rotated, normalized coordinates is step^2/12: relative error about the same
    err = float(mx.mean(mx.sum(mx.square(q.fn(x) - x), -1) / mx.sum(mx.square(x), -1)).item())
    assert err == pytest.approx(0.3 ** 2 / 12, rel=0.1)
    m = M.grid_per_side(0.1, 0.3, "g")
    assert m.plan(0, "k").step == 0.1 and m.plan(5, "v").step == 0.3 and m.name == "grid K s0.1 / V s0.3"


def test_rans_estimate_matches_the_writer_encoder():
    """The size used while fitting steps (no coding) against the real rANS encoder, both table forms."""
    from quality.disk_bits import rans_estimate

    from rvqstore.format import rans

    rng = np.random.default_rng(41)
    for bits, scale in ((4, 0.6), (2, 1.0), (1, 1.0)):
        y = rng.standard_normal((3000, 64)) * scale + np.linspace(-1, 1, 64)  # per-coordinate offsets
        codes = np.clip(np.floor(y / 0.5 + (1 << bits) / 2), 0, (1 << bits) - 1).astype(np.uint8)
        words = rans.pack(codes, bits, 64)
        real = min(len(rans.encode(words.tobytes(), bits, 64, contexts=c)) for c in (1, 0))
        assert rans_estimate(words, bits, 64) == pytest.approx(real, rel=0.002)


def test_grid_files_best_is_measured_and_estimated_from_auto(tiny32):
    """Grid caches saved for real: "best" (rANS sections) is smaller than "auto" for grid codes, and
    the estimate from the "auto" file lands within 0.3% of the real "best" file."""
    from quality.disk_bits import ESTIMATED_BEST, bits_on_disk

    ids = [int(i) for i in np.random.default_rng(14).integers(3, 128, 512)]
    m = M.grid_per_side(0.15, 0.4, "g", dim=32)
    d = bits_on_disk(tiny32, CharTokenizer(), ids, m, ("none", "auto", "best", ESTIMATED_BEST))
    assert d["best"] < d["auto"] <= d["none"] * 1.01, d
    assert d[ESTIMATED_BEST] == pytest.approx(d["best"], rel=0.003)
    coarser = bits_on_disk(tiny32, CharTokenizer(), ids, M.grid_per_side(0.3, 0.8, "g", dim=32), ("best",))
    assert coarser["best"] < d["best"] - 0.5  # a doubled step: about a bit less per coordinate


def test_codec_state_files_are_real_and_the_estimate_before_them_was_close(tiny32, monkeypatch):
    """A grid method with the sink token and the key mean is sized by saving a real cache that holds the
    state (format 1.2 codec-state); the estimate the presets were first fitted with (the coded tokens'
    file plus the state sections, disk_bits.state_estimate) lands within 0.5% of it, and the state's
    bytes are counted: the file is larger than the same codes' without the sink section, header
    entries and mean."""
    from quality import disk_bits as D

    ids = [int(i) for i in np.random.default_rng(15).integers(3, 128, 256)]
    base = M.grid_per_side(0.15, 0.4, "g", dim=32)
    m = M.variant(base, sink=1, center_keys=True)
    assert D.state_measured(m) and D.cache_holds_state()
    real = D.bits_on_disk(tiny32, CharTokenizer(), ids, m, ("auto", "best"))
    with monkeypatch.context() as mp:
        mp.setattr(D, "cache_holds_state", lambda: False)
        assert not D.state_measured(m)
        est = D.bits_on_disk(tiny32, CharTokenizer(), ids, m, ("auto", "best"))
    for mode in ("auto", "best"):
        assert est[mode] == pytest.approx(real[mode], rel=0.005), (mode, est, real)
    sink_only = D.bits_on_disk(tiny32, CharTokenizer(), ids, M.variant(base, sink=1), ("auto",))["auto"]
    plain = D.bits_on_disk(tiny32, CharTokenizer(), ids, base, ("auto",))["auto"]
    n_coords = 2 * 256 * 2 * 32 * 2  # layers x tokens x kv heads x head dim x sides
    per_position = plain * n_coords / 8 / 256
    sink_bytes = 2 * 2 * 2 * 32 * 2  # layers x sides x kv heads x head dim x 2 bytes
    added = (sink_only - plain) * n_coords / 8  # the sink sections, their header rows, less one coded position
    assert sink_bytes - per_position < added < sink_bytes + 4 * 200


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
def test_affine_codes_are_read_back_from_mx_quantize_words(bits):
    """The baseline's codes given to the rANS size estimate are the codes mx.quantize stored."""
    from quality.disk_bits import _affine_codes

    x = rand((3, 64), 50 + bits).astype(mx.float16)
    wq, s, b = mx.quantize(x, group_size=32, bits=bits)
    codes = _affine_codes(wq, bits, 64)
    assert codes.shape == (3, 64) and codes.min() >= 0 and codes.max() < (1 << bits)
    rep = lambda a: np.repeat(np.array(a.astype(mx.float32)), 32, axis=1)  # noqa: E731
    want = np.array(mx.dequantize(wq, s, b, group_size=32, bits=bits).astype(mx.float32))
    assert np.allclose(codes * rep(s) + rep(b), want, atol=4e-3)
