"""tools/eval_quality.py: its metrics on cases with known answers, and the whole evaluation path
end to end on a small slice of the bundled model and text."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import eval_quality as EQ  # noqa: E402


def rand(shape, seed, scale=1.0):
    return mx.array((scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32))


@pytest.fixture(scope="module")
def qkv():
    """9 query heads over 3 KV heads (GQA as in SmolLM2), 40 tokens, dim 64, queries at 10 positions."""
    t = 40
    q, k, v = rand((9, 10, 64), 1), rand((3, t, 64), 2), rand((3, t, 64), 3)
    pos = mx.array(EQ.query_positions(t, 10))
    return q, k, v, pos


# ---- per-vector error -----------------------------------------------------------------------------

def test_relative_error_known_answers():
    x = rand((3, 50, 64), 0)
    assert float(mx.max(EQ.relative_errors(x, x)).item()) == 0.0
    np.testing.assert_allclose(np.array(EQ.relative_errors(x, 0.9 * x)), 0.01, rtol=1e-4)
    np.testing.assert_allclose(np.array(EQ.relative_errors(x, mx.zeros_like(x))), 1.0, rtol=1e-6)


# ---- attention metrics ------------------------------------------------------------------------------

def test_identity_reconstruction_is_perfect(qkv):
    q, k, v, pos = qkv
    a = EQ.attention_sums(q, k, v, k, v, pos, 0.125)
    assert a["kl"] == 0.0 and a["out_err"] == 0.0
    assert a["slope_num"] / a["slope_den"] == pytest.approx(1.0, abs=1e-6)
    assert a["rows"] == 90


@pytest.mark.parametrize("c", [0.5, 0.9, 1.3])
def test_scaled_keys_give_slope_c_and_scaled_values_give_error(qkv, c):
    q, k, v, pos = qkv
    a = EQ.attention_sums(q, k, v, c * k, v, pos, 0.125)
    assert a["slope_num"] / a["slope_den"] == pytest.approx(c, rel=1e-5)
    assert a["kl"] > 0
    b = EQ.attention_sums(q, k, v, k, c * v, pos, 0.125)  # exact probabilities, values off by c
    assert b["kl"] == 0.0
    assert b["out_err"] / b["out_norm"] == pytest.approx((1 - c) ** 2, rel=1e-4)


def test_window_covering_the_context_makes_any_reconstruction_exact(qkv):
    q, k, v, pos = qkv
    a = EQ.attention_sums(q, k, v, rand(k.shape, 9), rand(v.shape, 10), pos, 0.125, window=k.shape[1])
    assert a["kl"] == 0.0 and a["out_err"] == 0.0


def _reference_attention(q, k, v, kh, vh, pos, scale, window):
    """Plain numpy (float64) restatement of the metrics, head by head."""
    q, k, v, kh, vh = (np.array(a, dtype=np.float64) for a in (q, k, v, kh, vh))
    pos = np.array(pos)
    hq, hkv, t = q.shape[0], k.shape[0], k.shape[1]
    kl = err = norm = num = den = 0.0
    for h in range(hq):
        g = h // (hq // hkv)
        for i, p_ in enumerate(pos):
            vis = np.arange(t) <= p_
            s = scale * k[g][vis] @ q[h, i]
            sh = scale * kh[g][vis] @ q[h, i]
            vv, vhh = v[g][vis], vh[g][vis].copy()
            if window:
                near = (p_ - np.arange(t)[vis]) < window
                sh[near] = s[near]
                vhh[near] = vv[near]
            p = np.exp(s - s.max()); p /= p.sum()
            ph = np.exp(sh - sh.max()); ph /= ph.sum()
            kl += np.sum(p * (np.log(p) - np.log(ph)))
            o, oh = p @ vv, ph @ vhh
            err += np.sum((o - oh) ** 2)
            norm += np.sum(o ** 2)
            c, ch = s - s.mean(), sh - sh.mean()
            num += c @ ch
            den += c @ c
    return kl, err / norm, num / den


@pytest.mark.parametrize("window", [0, 7])
def test_attention_metrics_match_a_plain_reference(qkv, window):
    q, k, v, pos = qkv
    kh, vh = k + rand(k.shape, 4, 0.3), v + rand(v.shape, 5, 0.3)
    a = EQ.attention_sums(q, k, v, kh, vh, pos, 0.125, window=window)
    kl, out_rel, slope = _reference_attention(q, k, v, kh, vh, pos, 0.125, window)
    assert a["kl"] == pytest.approx(kl, rel=1e-3)
    assert a["out_err"] / a["out_norm"] == pytest.approx(out_rel, rel=1e-3)
    assert a["slope_num"] / a["slope_den"] == pytest.approx(slope, rel=1e-4)


# ---- bits accounting ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,group,expect", [(2, 64, 2.5), (2, 32, 3.0), (3, 64, 3.5), (4, 64, 4.5),
                                               (4, 32, 5.0), (8, 64, 8.5), (8, 32, 9.0)])
def test_affine_bits_accounting_exact(bits, group, expect):
    # b bits per value + one float16 scale and one float16 bias per group
    assert EQ.affine_method(bits, group).bits == expect


@pytest.mark.parametrize("bits,expect", [((1, 1), 2.25), ((2, 2), 4.25), ((3, 3), 7.25), ((4, 1), 5.25),
                                         ((3, 0), 3.75), ((4, 0), 4.25)])
def test_rvq_bits_accounting(bits, expect):
    # 16-bit norm per 64 coordinates; 3-bit codes pack 10 per 32-bit word (7 words for 64 codes)
    assert EQ.rvq_method(bits).bits == expect


def test_affine_and_rvq_reconstructions_behave():
    x = rand((3, 256, 64), 6)
    a4 = float(mx.mean(EQ.relative_errors(x, EQ.affine_method(4, 64).reconstruct(x, 0, "k"))).item())
    a8 = float(mx.mean(EQ.relative_errors(x, EQ.affine_method(8, 64).reconstruct(x, 0, "k"))).item())
    assert a8 < a4 < 0.02
    m = EQ.rvq_method((2, 2))
    e = float(mx.mean(EQ.relative_errors(x, m.reconstruct(x, 0, "k"))).item())
    assert e == pytest.approx(m.predicted, rel=0.15)


def test_keep_first_and_mean_subtraction():
    x = rand((3, 10, 64), 7)
    xh = mx.zeros_like(x)
    kept = EQ.keep_first(x, xh, 3)
    assert np.array_equal(np.array(kept[:, :3]), np.array(x[:, :3])) and not np.any(np.array(kept[:, 3:]))
    assert EQ.keep_first(x, xh, 0) is xh
    # subtracting the exact mean of constant vectors leaves nothing to quantize: exact reconstruction
    const = mx.broadcast_to(x[:, :1], x.shape)
    m = EQ.mean_subtracted_method(EQ.rvq_method((1, 1)), {(0, "k"): const[:, :1]})
    assert float(mx.max(mx.abs(m.reconstruct(const, 0, "k") - const)).item()) == 0.0


def test_peer_bits_if_available():
    if EQ.peer_available() is not None:
        pytest.skip("veloxquant-mlx not installed")
    assert EQ.peer_method(2).bits == 4.25 and EQ.peer_method(3).bits == 7.25


# ---- language-model metrics ------------------------------------------------------------------------

def test_lm_metrics_known_answers():
    v = 50
    uniform = mx.full((8, v), -math.log(v))
    r = EQ.lm_metrics(uniform, uniform, list(range(8)))
    assert r["ppl"] == pytest.approx(v, rel=1e-5) and r["top1_agree"] == 1.0 and abs(r["tok_kl"]) < 1e-6
    logits = rand((8, v), 8)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    t = [int(i) for i in np.array(mx.argmax(lp, axis=-1))]
    r = EQ.lm_metrics(lp, lp, t)
    expect = math.exp(-float(np.mean(np.max(np.array(lp), axis=-1))))
    assert r["ppl"] == pytest.approx(expect, rel=1e-5) and r["tok_kl"] == pytest.approx(0.0, abs=1e-6)


# ---- end to end on the real model (small slice) -------------------------------------------------------

@pytest.mark.model
def test_capture_matches_the_model(smollm2):
    model, tok = smollm2
    tokens = EQ.load_text_tokens(tok, 24)
    cap = EQ.capture(model, tokens, chunk=10)  # chunked like prefill
    n_layers = len(model.layers)
    assert cap.keys.shape == (n_layers, 3, 24, 64) and cap.queries.shape == (n_layers, 9, 24, 64)
    assert cap.scale == pytest.approx(64 ** -0.5)
    # layer 0 recomputed by hand: RMSNorm of the embeddings, projections, RoPE at offset 0
    attn = model.layers[0].self_attn
    x = model.layers[0].input_layernorm(model.model.embed_tokens(mx.array(tokens)[None]))
    q = attn.rope(attn.q_proj(x).reshape(1, 24, 9, 64).transpose(0, 2, 1, 3))[0]
    k = attn.rope(attn.k_proj(x).reshape(1, 24, 3, 64).transpose(0, 2, 1, 3))[0]
    v = attn.v_proj(x).reshape(1, 24, 3, 64).transpose(0, 2, 1, 3)[0]
    for got, want in ((cap.queries[0], q), (cap.keys[0], k), (cap.values[0], v)):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


@pytest.mark.model
def test_evaluation_end_to_end_on_a_slice(smollm2, tmp_path):
    model, tok = smollm2
    keep = {"float16", "RVQ 2+2 cond", "RVQ 2+2 cond +window 16", "affine 4b g64", "RVQ 2+2 cond +mean K"}
    # 192 tokens: the 96-token first half exceeds window + flush block, so some tokens get coded
    res = EQ.run(model, tok, n_tokens=192, n_queries=8, ppl="main", peer=False, layers=[0, 29], window=16,
                 select=lambda m: m.name in keep, log=lambda s: None)
    S = {s["name"]: s for s in res["summaries"]}
    assert set(S) == keep
    assert S["float16"]["k_err"] < 1e-6 and S["float16"]["attn_kl"] < 1e-5
    assert S["float16"]["score_slope"] == pytest.approx(1.0, abs=1e-4)
    r = S["RVQ 2+2 cond"]
    assert len(r["k_err_layers"]) == 2 and 0.004 < r["k_err"] < 0.02 and 0.004 < r["v_err"] < 0.02
    assert 0 < r["attn_kl"] and 0.9 < r["score_slope"] < 1.05
    w = S["RVQ 2+2 cond +window 16"]  # same codes, exact recent keys: less attention error
    assert w["k_err"] == r["k_err"] and 0 < w["attn_kl"] < r["attn_kl"]
    # perplexity of the 96 second-half tokens against the float32 cache
    assert res["ppl_ref"]["ppl"] > 1.0 and 0 < res["ppl_ref"]["top1_acc"] <= 1.0
    for name in ("RVQ 2+2 cond", "RVQ 2+2 cond +window 16", "affine 4b g64", "RVQ 2+2 cond +mean K"):
        assert math.isfinite(S[name]["ppl"]) and 0.5 < S[name]["top1_agree"] <= 1.0 and S[name]["tok_kl"] > 0
    assert "ppl" not in S["float16"]  # float16 is not in the default perplexity list
    res["argv"] = "--test"
    EQ.analyse(res)
    md = EQ.render_markdown(res)
    assert "| RVQ 2+2 cond | 4.25 |" in md and "## How to reproduce" in md
    pytest.importorskip("matplotlib")
    EQ.plot(res["summaries"], res["ppl_ref"], tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 10_000


@pytest.mark.model
def test_identity_cache_reproduces_the_reference(smollm2):
    """The simulated-cache path with an exact reconstruction gives the float32 cache's numbers."""
    model, tok = smollm2
    tokens = EQ.load_text_tokens(tok, 64)
    ref, out = EQ.evaluate_perplexity(model, tokens, [EQ.identity_method()])
    r = out["float32 (reference)"]
    assert abs(r["ppl_delta"]) < 1e-6 and r["top1_agree"] == 1.0 and abs(r["tok_kl"]) < 1e-6
