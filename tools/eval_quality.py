"""Quality of the TurboQuant-RVQ codec on real keys, values and queries of the bundled model.

Captures post-RoPE keys, values and queries of SmolLM2-135M-Instruct (30 layers, 3 KV heads,
9 query heads, head_dim 64) over the first ``--tokens`` tokens of the bundled Python Language
Reference excerpt (``rvqstore/data/python_docs_excerpt.txt``, PSF License), then measures every
configuration of the codec against anchors (float16, mlx-lm's affine ``mx.quantize``, and the peer
``veloxquant-mlx`` ``turboquant_rvq`` quantizer when installed):

* effective bits per coordinate (scales, norms and packing waste counted);
* relative error E[||x - x_hat||^2 / ||x||^2] of keys and values, per layer and overall;
* attention with the real queries (GQA, causal): output relative error, KL of attention rows, and
  the least-squares slope of quantized on true scores;
* end to end: perplexity, top-1 agreement and next-token KL against the float32 cache, scoring the
  second half of the text with the first half cached through each method.

Writes ``docs/quality.md`` and ``docs/quality.png`` (and optionally a JSON file)::

    python tools/eval_quality.py [--tokens 2048] [--queries 128] [--ppl all|main|none]
                                 [--out docs] [--json results.json]

Needs matplotlib (``pip install -e '.[tools]'``); ``veloxquant-mlx`` is optional.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rvqstore import RVQCodec  # noqa: E402

TEXT_FILE = "data/python_docs_excerpt.txt"
PEER_PACKAGE = "veloxquant-mlx"

# ------------------------------------------------------------------------------------------------
# Real data: text, capture of keys/values/queries


def load_text_tokens(tokenizer: Any, n: int) -> list[int]:
    """The first ``n`` token ids of the bundled English text."""
    text = resources.files("rvqstore").joinpath(TEXT_FILE).read_text(encoding="utf-8")
    ids = list(tokenizer.encode(text))
    if len(ids) < n:
        raise ValueError(f"the bundled text has only {len(ids)} tokens, {n} asked")
    return ids[:n]


@dataclass
class Capture:
    """Post-RoPE keys/values ``(L, Hkv, T, D)`` and queries ``(L, Hq, T, D)`` (float32), and the
    attention scale of the model."""

    keys: mx.array
    values: mx.array
    queries: mx.array
    scale: float

    @property
    def n_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def n_tokens(self) -> int:
        return self.keys.shape[2]


def capture(model: Any, tokens: Sequence[int], *, chunk: int = 512) -> Capture:
    """Run ``tokens`` through ``model`` (in chunks, with a recording KV cache) and record what each
    attention layer sees: the keys and values handed to the cache (post-RoPE) and the queries handed
    to ``scaled_dot_product_attention`` (post-RoPE; patched in the model's module for the run)."""
    from mlx_lm.models.cache import KVCache

    class _Recorder(KVCache):
        def __init__(self):
            super().__init__()
            self.k, self.v, self.q = [], [], []

        def update_and_fetch(self, keys, values):
            self.k.append(keys)
            self.v.append(values)
            return super().update_and_fetch(keys, values)

    module = sys.modules[type(model).__module__]
    orig = module.scaled_dot_product_attention
    scales: list[float] = []

    def recording_sdpa(queries, keys, values, cache, scale, mask, *a, **kw):
        if isinstance(cache, _Recorder):
            cache.q.append(queries)
            scales.append(float(scale))
        return orig(queries, keys, values, cache, scale, mask, *a, **kw)

    caches = [_Recorder() for _ in model.layers]
    body = getattr(model, "model", model)  # the transformer without the LM head, where available
    ids = mx.array(list(tokens), dtype=mx.int32)[None]
    module.scaled_dot_product_attention = recording_sdpa
    try:
        for s in range(0, ids.shape[1], chunk):
            h = body(ids[:, s:s + chunk], cache=caches)
            mx.eval(h, [c.k[-1] for c in caches], [c.q[-1] for c in caches])
    finally:
        module.scaled_dot_product_attention = orig

    def stack(parts: str) -> mx.array:
        return mx.stack([mx.concatenate(getattr(c, parts), axis=2)[0] for c in caches]).astype(mx.float32)

    cap = Capture(stack("k"), stack("v"), stack("q"), scales[0])
    mx.eval(cap.keys, cap.values, cap.queries)
    return cap


# ------------------------------------------------------------------------------------------------
# Methods: a reconstruction function (for vector and attention metrics and simulated caches) and
# a cache factory (for perplexity)

Reconstruct = Callable[[mx.array, int, str], mx.array]  # (x (..., D) float32, layer, "k"|"v") -> x_hat


@dataclass
class Method:
    name: str
    family: str  # plot series
    bits: float  # bits per coordinate
    reconstruct: Reconstruct
    make_cache: Callable[[Any], list] | None = None  # model -> caches; None: SimCache(reconstruct)
    window: int = 0  # recent-token window kept exact (attention metrics and the RVQ cache)
    ppl: str = "main"  # "main": in the default perplexity list; "all": only with --ppl all
    predicted: float | None = None
    note: str = ""
    sink: int = 0  # this many first tokens of the context kept exact
    score_chunk: int = 0  # score the second half in chunks of this many tokens (0: one forward pass)


def keep_first(x: mx.array, x_hat: mx.array, n: int) -> mx.array:
    """``x_hat`` with its first ``n`` tokens (axis -2) replaced by the exact ``x``."""
    n = min(n, x.shape[-2])
    if n <= 0:
        return x_hat
    return mx.concatenate([x[..., :n, :], x_hat[..., n:, :]], axis=-2)


def _sim_caches(model: Any, fn: Reconstruct, sink: int = 0) -> list:
    """KVCache per layer that stores ``fn``'s reconstruction of every key and value it is handed
    (the first ``sink`` tokens of the context exact)."""
    from mlx_lm.models.cache import KVCache

    class SimCache(KVCache):
        def __init__(self, layer: int):
            super().__init__()
            self.layer = layer

        def update_and_fetch(self, keys, values):
            out = []
            for x, kind in ((keys, "k"), (values, "v")):
                xh = fn(x.astype(mx.float32), self.layer, kind).astype(x.dtype)
                out.append(keep_first(x, xh, sink - self.offset))
            return super().update_and_fetch(*out)

    return [SimCache(i) for i in range(len(model.layers))]


def identity_method() -> Method:
    return Method("float32 (reference)", "fp", 32.0, lambda x, l, kind: x, ppl="main")


def fp16_method() -> Method:
    return Method("float16", "fp16", 16.0, lambda x, l, kind: x.astype(mx.float16).astype(mx.float32))


def rvq_method(bits: tuple[int, int], residual: str = "conditional", dim: int = 64, *, ppl: str = "main",
               seed: int = 0, window: int = 0) -> Method:
    codec = RVQCodec(dim, bits, seed, residual)

    def fn(x, layer, kind):
        return codec.decode(codec.encode(x, check_finite=False))

    def caches(model):
        from rvqstore import make_prompt_cache

        return make_prompt_cache(model, bits, seed, residual, dense_window=window,
                                 mode="resident" if window else "packed")

    b1, b2 = codec.bits
    label = f"{b1}+{b2}" if b2 else f"{b1}"
    kind = {"conditional": "cond", "shared": "shared", "none": "single"}[codec.residual]
    fam = {"cond": "RVQ conditional", "shared": "RVQ shared", "single": "RVQ single stage"}[kind]
    name = f"RVQ {label} {kind}" if b2 else f"RVQ {label} single"
    if window:
        name, fam = f"{name} +window {window}", f"{fam} +window"
    return Method(name, fam, codec.bits_per_coordinate, fn, caches, window=window, ppl=ppl,
                  predicted=codec.predicted_relative_error())


def affine_method(bits: int, group: int, dim: int = 64, *, ppl: str = "main") -> Method:
    """mlx-lm's affine ``mx.quantize`` (as in its QuantizedKVCache), applied to float16 keys/values
    so scales and biases are float16 (as in a half-precision model); the error is measured against
    the float32 originals."""

    def fn(x, layer, kind):
        wq, s, b = mx.quantize(x.astype(mx.float16), group_size=group, bits=bits)
        return mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32)

    wq, s, b = mx.quantize(mx.zeros((1, dim), mx.float16), group_size=group, bits=bits)
    stored = wq.shape[-1] * 32 + s.shape[-1] * s.dtype.size * 8 + b.shape[-1] * b.dtype.size * 8
    return Method(f"affine {bits}b g{group}", f"affine g{group}", stored / dim, fn, ppl=ppl)


def mlx_lm_quantized_method(bits: int, group: int, dim: int = 64) -> Method:
    """Cross-check: mlx-lm's own QuantizedKVCache (in this float32 run its scales are float32)."""
    def caches(model):
        from mlx_lm.models.cache import QuantizedKVCache

        return [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]

    a = affine_method(bits, group, dim)
    return Method(f"affine {bits}b g{group} (mlx-lm QuantizedKVCache)", "check", a.bits, a.reconstruct,
                  caches, ppl="main", note="fp32 scales/biases in this run")


def peer_available() -> str | None:
    """None when the peer quantizer imports; otherwise why not."""
    try:
        from veloxquant_mlx.quantizers.turboquant_rvq import TurboQuantRVQ  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure means "not available here"
        return f"{type(e).__name__}: {e}"
    return None


def peer_method(b: int, dim: int = 64, *, seed: int = 0, ppl: str = "main") -> Method:
    """veloxquant-mlx's ``turboquant_rvq`` quantizer (b bits per stage), used the way its own KV
    cache uses it: fp32 norm stored as bfloat16, float16 unit vector through the quantizer with the
    Hadamard rotation, two index streams packed ``32 // b`` codes per uint32 word."""
    from veloxquant_mlx.quantizers.turboquant_rvq import TurboQuantRVQ

    q = TurboQuantRVQ(d=dim, b=b, seed=seed, use_hadamard=True)

    def fn(x, layer, kind):
        shape = x.shape
        flat = x.reshape(-1, dim).astype(mx.float32)
        norms = mx.sqrt(mx.sum(flat * flat, axis=-1, keepdims=True))
        unit = (flat / mx.maximum(norms, 1e-4)).astype(mx.float16)
        u_hat = q.decode(q.encode(unit)).astype(mx.float32)
        return (u_hat * norms.astype(mx.bfloat16).astype(mx.float32)).reshape(shape)

    words = -(-dim // (32 // b))
    return Method(f"veloxquant rvq {b}+{b}", "veloxquant-mlx turboquant_rvq", (2 * 32 * words + 16) / dim, fn,
                  ppl=ppl)


def mean_subtracted_method(base: Method, means: dict[tuple[int, str], mx.array],
                           kinds: tuple[str, ...] = ("k",)) -> Method:
    """Improvement under test: subtract a per-(layer, head) mean (of keys, and of values if asked)
    before encoding and add it back after decoding. The means come from the first half of the text
    (standing for the prompt or a calibration pass) and cost 64 floats per head, nothing per token.
    For keys the mean need not even be added back: it shifts every score of a query row by the same
    q·mu, which softmax ignores."""

    def fn(x, layer, kind):
        if kind not in kinds:
            return base.reconstruct(x, layer, kind)
        mu = means[(layer, kind)]  # (H, 1, D)
        return base.reconstruct(x - mu, layer, kind) + mu

    tag = "+mean K" if kinds == ("k",) else "+mean " + ",".join(k.upper() for k in kinds)
    return Method(f"{base.name} {tag}", f"{base.family} {tag}", base.bits, fn, ppl=base.ppl, note="improvement")


def sink_method(base: Method, n: int = 1) -> Method:
    """Variant under test: the first ``n`` tokens of the context (the attention sink) kept exact,
    costing n * 16 bits per coordinate of one token (nothing per later token)."""
    return Method(f"{base.name} +sink {n}", f"{base.family} +sink", base.bits, base.reconstruct, ppl=base.ppl,
                  predicted=base.predicted, note="improvement", sink=n)


def ls_scale_method(bits: tuple[int, int], dim: int = 64, *, seed: int = 0, ppl: str = "main") -> Method:
    """Improvement under test: store the least-squares scale <x, u_hat>/||u_hat||^2 (bfloat16) of the
    decoded unit direction u_hat instead of the plain norm (same bits)."""
    codec = RVQCodec(dim, bits, seed)

    def fn(x, layer, kind):
        y, scales = codec.rotate(x)
        u = codec.unrotate(codec.dequantize(*codec.quantize(y)), mx.ones(scales.shape, mx.bfloat16))
        s = mx.sum(x * u, axis=-1) / mx.maximum(mx.sum(u * u, axis=-1), 1e-30)
        return u * s.astype(mx.bfloat16).astype(mx.float32)[..., None]

    b1, b2 = codec.bits
    return Method(f"RVQ {b1}+{b2} cond +ls-scale", "RVQ conditional +ls-scale", codec.bits_per_coordinate, fn,
                  ppl=ppl, note="improvement")


def build_methods(*, dim: int = 64, peer: bool = True, means: dict | None = None,
                  window: int = 64, window_chunk: int = 16) -> tuple[list[Method], str | None]:
    """Every method of the evaluation; returns (methods, why the peer is missing or None).

    ``ppl="main"`` marks the methods whose perplexity the default run measures (one prefill and one
    forward pass of the model each, the expensive part); ``--ppl all`` measures all of them."""
    main = lambda cond: "main" if cond else "all"  # noqa: E731
    ms: list[Method] = [fp16_method()]
    ms[0].ppl = "all"
    cond = {}
    for bits in [(1, 1), (2, 1), (2, 2), (3, 2), (4, 1), (3, 3), (4, 2), (4, 4)]:
        cond[bits] = rvq_method(bits, "conditional", dim, ppl=main(bits not in [(2, 1), (3, 2)]))
        ms.append(cond[bits])
    for b in (1, 2, 3, 4):
        ms.append(rvq_method((b, 0), dim=dim, ppl="all"))
    for bits in [(1, 1), (2, 1), (2, 2), (3, 3), (4, 4)]:
        ms.append(rvq_method(bits, "shared", dim, ppl="all"))
    for bits in [(1, 1), (2, 2)]:
        wm = rvq_method(bits, "conditional", dim, window=window, ppl=main(bits == (2, 2)))
        wm.reconstruct = cond[bits].reconstruct  # same codec: share its reconstruction
        wm.score_chunk = window_chunk  # so that the window acts while the second half is scored
        ms.append(wm)
    for bits in [(2, 2), (4, 2), (3, 3)]:  # another rotation seed: how much of a difference is chance
        sm = rvq_method(bits, "conditional", dim, seed=1, ppl=main(bits != (2, 2)))
        sm.name, sm.family, sm.note = f"{sm.name} (seed 1)", "RVQ conditional, seed 1", "seed"
        ms.append(sm)
    for bits in (2, 3, 4, 8):
        for g in (64, 32):
            ms.append(affine_method(bits, g, dim, ppl=main(g == 64 and bits in (4, 8))))
    why = None
    if peer:
        why = peer_available()
        if why is None:
            for b in (1, 2, 3, 4):
                ms.append(peer_method(b, dim, ppl=main(b == 2)))
    if means is not None:
        for bits in [(1, 1), (2, 2), (4, 1), (4, 2)]:
            ms.append(mean_subtracted_method(cond[bits], means, ("k",)))
            ms[-1].ppl = main(bits != (1, 1))
        for bits in [(1, 1), (2, 2)]:
            ms.append(mean_subtracted_method(cond[bits], means, ("k", "v")))
            ms[-1].ppl = "all"
    for bits in [(1, 1), (2, 2)]:
        ms.append(sink_method(cond[bits], 1))
        ms[-1].ppl = "all"
        ms.append(ls_scale_method(bits, dim, ppl="all"))
    return ms, why


def head_means(cap: Capture, upto: int) -> dict[tuple[int, str], mx.array]:
    """Per-(layer, head) means of keys and values over tokens [0, upto)."""
    out = {}
    for l in range(cap.n_layers):
        out[(l, "k")] = mx.mean(cap.keys[l, :, :upto], axis=1, keepdims=True)
        out[(l, "v")] = mx.mean(cap.values[l, :, :upto], axis=1, keepdims=True)
    mx.eval(list(out.values()))
    return out


# ------------------------------------------------------------------------------------------------
# Metrics


def relative_errors(x: mx.array, x_hat: mx.array) -> mx.array:
    """Per-vector ||x - x_hat||^2 / ||x||^2 (float32)."""
    d = x - x_hat
    return mx.sum(d * d, axis=-1) / mx.sum(x * x, axis=-1)


_MASKED = -1e30  # finite "minus infinity": exp() gives 0 and masked log-probs cancel exactly


class LayerAttention:
    """True attention of one layer for a set of queries, and the metrics of reconstructed keys/values
    against it (see :func:`attention_sums`); the truth is computed once per layer."""

    def __init__(self, q: mx.array, k: mx.array, v: mx.array, q_pos: mx.array, scale: float):
        hkv, t, d = k.shape
        hq, nq, _ = q.shape
        self.rows = hq * nq
        self.qg = (q * scale).reshape(hkv, hq // hkv, nq, d)
        self.dist = q_pos[:, None] - mx.arange(t)[None, :]
        self.valid = self.dist >= 0
        self.bias = mx.where(self.valid, 0.0, _MASKED)
        self.v = v[:, None]
        self.s = self.qg @ k[:, None].swapaxes(-1, -2)  # (Hkv, G, Nq, T)
        self.lp = _log_softmax(self.s + self.bias)
        self.p = mx.exp(self.lp)
        self.o = self.p @ self.v
        cnt = mx.sum(self.valid, axis=-1, keepdims=True).astype(mx.float32)
        # scores centred per row over the visible keys (0 elsewhere). Each row of c sums to 0, so
        # sum(c * c_hat) = sum(c * (s_hat - m)) for any per-row m; m = the true row mean keeps the
        # float32 products small (without it, large score offsets cost ~3e-3 of slope accuracy)
        self.row_mean = mx.sum(self.s * self.valid, axis=-1, keepdims=True) / cnt
        self.c = mx.where(self.valid, self.s - self.row_mean, 0.0)
        base = mx.stack([mx.sum(mx.square(self.o)), mx.sum(self.c * self.c)])
        mx.eval(self.bias, self.lp, self.p, self.o, self.c, self.row_mean, base)
        self.out_norm, self.slope_den = base.tolist()

    def compare(self, k_hat: mx.array, v_hat: mx.array, window: int = 0) -> dict[str, float]:
        sh = self.qg @ k_hat[:, None].swapaxes(-1, -2)
        if window:
            near = (self.dist < window) & self.valid
            sh = mx.where(near, self.s, sh)
        lph = _log_softmax(sh + self.bias)
        ph = mx.exp(lph)
        kl = mx.sum(self.p * (self.lp - lph))
        if window:
            oh = mx.where(near, ph, 0.0) @ self.v + mx.where(near, 0.0, ph) @ v_hat[:, None]
        else:
            oh = ph @ v_hat[:, None]
        out = mx.stack([kl, mx.sum(mx.square(self.o - oh)), mx.sum(self.c * (sh - self.row_mean))]).tolist()
        return {"kl": out[0], "out_err": out[1], "slope_num": out[2], "out_norm": self.out_norm,
                "slope_den": self.slope_den, "rows": self.rows}


def _log_softmax(x: mx.array) -> mx.array:
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def attention_sums(q: mx.array, k: mx.array, v: mx.array, k_hat: mx.array, v_hat: mx.array, q_pos: mx.array,
                   scale: float, window: int = 0) -> dict[str, float]:
    """Sums for the attention metrics of one layer (callers aggregate and divide).

    q: ``(Hq, Nq, D)`` queries at positions ``q_pos`` ``(Nq,)``; k, v, k_hat, v_hat: ``(Hkv, T, D)``
    (query head h reads KV head ``h // (Hq // Hkv)``). Causal: query at position p sees keys 0..p.
    With ``window`` > 0, keys/values at distance ``p - s < window`` are the exact ones (a sliding
    recent-token window). Returns ``kl`` (sum over rows of KL(p || p_hat), nats), ``rows``,
    ``out_err``/``out_norm`` (sums of ||o - o_hat||^2 and ||o||^2), and ``slope_num``/``slope_den``
    (sums of c*c_hat and c*c over visible entries, with scores centred per row).
    """
    return LayerAttention(q, k, v, q_pos, scale).compare(k_hat, v_hat, window)


def query_positions(n_tokens: int, n_queries: int) -> np.ndarray:
    """``n_queries`` evenly spaced positions in the second half of the context (long histories)."""
    lo = n_tokens // 2
    return np.unique(np.linspace(lo, n_tokens - 1, min(n_queries, n_tokens - lo)).round().astype(np.int32))


@dataclass
class Row:
    """Results of one method."""

    name: str
    family: str
    bits: float
    window: int = 0
    k_err: list[float] = field(default_factory=list)  # per layer
    v_err: list[float] = field(default_factory=list)
    attn: list[dict] = field(default_factory=list)  # per layer sums
    predicted: float | None = None
    ppl: dict | None = None
    note: str = ""

    def summary(self) -> dict:
        a = self.attn
        out = {"name": self.name, "family": self.family, "bits": self.bits, "window": self.window,
               "k_err": float(np.mean(self.k_err)) if self.k_err else None,
               "v_err": float(np.mean(self.v_err)) if self.v_err else None,
               "k_err_layers": self.k_err, "v_err_layers": self.v_err, "predicted": self.predicted,
               "note": self.note}
        if a:
            out["attn_out_err"] = float(np.mean([x["out_err"] / x["out_norm"] for x in a]))
            out["attn_out_err_layers"] = [x["out_err"] / x["out_norm"] for x in a]
            out["attn_kl"] = sum(x["kl"] for x in a) / sum(x["rows"] for x in a)
            out["attn_kl_layers"] = [x["kl"] / x["rows"] for x in a]
            out["score_slope"] = sum(x["slope_num"] for x in a) / sum(x["slope_den"] for x in a)
        if self.ppl is not None:
            out.update(self.ppl)
        return out


def evaluate_vectors_and_attention(cap: Capture, methods: Sequence[Method], *, n_queries: int = 128,
                                   layers: Sequence[int] | None = None,
                                   progress: Callable[[str], None] | None = None) -> list[Row]:
    """Per-vector and attention metrics of every method, layer by layer (the true attention of a
    layer is recomputed per method; everything of a layer stays small)."""
    layers = list(range(cap.n_layers)) if layers is None else list(layers)
    q_pos_np = query_positions(cap.n_tokens, n_queries)
    q_pos = mx.array(q_pos_np)
    rows = [Row(m.name, m.family, m.bits, m.window, predicted=m.predicted, note=m.note) for m in methods]
    recon: dict[tuple, tuple] = {}  # (id(reconstruct), sink) -> (k_hat, v_hat, k_err, v_err) of this layer
    for i, l in enumerate(layers):
        k, v = cap.keys[l], cap.values[l]
        att = LayerAttention(mx.take(cap.queries[l], q_pos, axis=1), k, v, q_pos, cap.scale)
        recon.clear()
        for m, r in zip(methods, rows):
            key = (id(m.reconstruct), m.sink)
            if key not in recon:  # window variants share the codec's reconstruction
                kh = keep_first(k, m.reconstruct(k, l, "k"), m.sink)
                vh = keep_first(v, m.reconstruct(v, l, "v"), m.sink)
                ke, ve = mx.mean(relative_errors(k, kh)), mx.mean(relative_errors(v, vh))
                mx.eval(kh, vh, ke, ve)
                recon[key] = (kh, vh, float(ke.item()), float(ve.item()))
            kh, vh, ke, ve = recon[key]
            r.k_err.append(ke)
            r.v_err.append(ve)
            r.attn.append(att.compare(kh, vh, m.window))
        if progress:
            progress(f"layer {l} ({i + 1}/{len(layers)})")
    return rows


# ------------------------------------------------------------------------------------------------
# End to end: perplexity with the first half cached through each method


def score_second_half(model: Any, tokens: Sequence[int], cache: list, *, prefill_chunk: int = 512,
                      score_chunk: int = 0) -> mx.array:
    """Log-probabilities ``(n - n//2, V)`` predicting tokens ``[n//2, n)``.

    The first half is prefilled into ``cache`` (chunks of ``prefill_chunk``, every layer's keys and
    values going through the cache); its last logits predict the first token of the second half.
    Then the second half, all but its last token, runs in one forward pass against the cache (its
    own keys/values going through the cache too; in chunks of ``score_chunk`` tokens if given) and
    predicts the rest.
    """
    from rvqstore.generation import prefill

    n = len(tokens)
    half = n // 2
    last = prefill(model, tokens[:half], cache, chunk=prefill_chunk)  # (1, V)
    ids = mx.array(list(tokens[half:n - 1]), dtype=mx.int32)[None]
    step = score_chunk or ids.shape[1]
    parts = [last]
    for s in range(0, ids.shape[1], step):
        parts.append(model(ids[:, s:s + step], cache=cache)[0])
        mx.eval(parts[-1])
    logits = mx.concatenate(parts, axis=0).astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(lp)
    return lp


def lm_metrics(lp: mx.array, ref_lp: mx.array, targets: Sequence[int]) -> dict:
    """Perplexity of ``targets`` under ``lp``, top-1 agreement and mean KL(ref || lp) per token."""
    t = mx.array(list(targets), dtype=mx.int32)
    nll = -mx.take_along_axis(lp, t[:, None], axis=-1)[:, 0]
    agree = mx.mean((mx.argmax(lp, axis=-1) == mx.argmax(ref_lp, axis=-1)).astype(mx.float32))
    kl = mx.mean(mx.sum(mx.exp(ref_lp) * (ref_lp - lp), axis=-1))
    mx.eval(nll, agree, kl)
    return {"ppl": float(math.exp(float(mx.mean(nll).item()))), "top1_agree": float(agree.item()),
            "tok_kl": float(kl.item())}


def evaluate_perplexity(model: Any, tokens: Sequence[int], methods: Sequence[Method], *,
                        progress: Callable[[str], None] | None = None) -> tuple[dict, dict[str, dict]]:
    """(reference metrics, {method name: metrics with ppl_delta}) for the float32 cache and each method."""
    from mlx_lm.models.cache import KVCache

    targets = tokens[len(tokens) // 2:]
    ref_lp = score_second_half(model, tokens, [KVCache() for _ in model.layers])
    ref = lm_metrics(ref_lp, ref_lp, targets)
    ref["top1_acc"] = float(mx.mean((mx.argmax(ref_lp, axis=-1) == mx.array(targets)).astype(mx.float32)).item())
    out = {}
    for m in methods:
        t0 = time.perf_counter()
        cache = m.make_cache(model) if m.make_cache is not None else _sim_caches(model, m.reconstruct, m.sink)
        r = lm_metrics(score_second_half(model, tokens, cache, score_chunk=m.score_chunk), ref_lp, targets)
        r["ppl_delta"] = r["ppl"] / ref["ppl"] - 1.0
        out[m.name] = r
        if progress:
            progress(f"{m.name}: ppl {r['ppl']:.4f} ({100 * r['ppl_delta']:+.2f}%) [{time.perf_counter() - t0:.1f}s]")
    return ref, out


# ------------------------------------------------------------------------------------------------
# Report


def _f(v: float | None, fmt: str = ".4f") -> str:
    return "–" if v is None else format(v, fmt)


def _e(v: float | None) -> str:
    if v is None:
        return "–"
    if v == 0:
        return "0"
    return f"{v:.4f}" if v >= 1e-3 else f"{v:.2e}"


def find(summaries: Sequence[dict], name: str) -> dict | None:
    return next((s for s in summaries if s["name"] == name), None)


def effective_window_bits(bits: float, window: int, n_tokens: int, dense_bits: float = 16.0) -> float:
    """Bits per coordinate over a context of ``n_tokens`` when ``window`` tokens are kept at ``dense_bits``."""
    w = min(window, n_tokens)
    return (bits * (n_tokens - w) + dense_bits * w) / n_tokens


def pareto(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats with fewer or equal bits and lower error (sorted by bits)."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points):
        if not front or y < front[-1][1]:
            if front and front[-1][0] == x:
                front.pop()
            front.append((x, y))
    return front


def plot(summaries: Sequence[dict], ref: dict | None, path: Path) -> None:
    """Rate-distortion plot: key/value error, attention KL and perplexity change vs bits/coordinate.
    Lines join each family's efficient points (fewer bits and lower error than the rest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    styles = {
        "RVQ conditional": dict(color="C0", marker="o", ls="-"),
        "RVQ single stage": dict(color="C9", marker="s", ls="-"),
        "RVQ shared": dict(color="C1", marker="^", ls="--"),
        "affine g64": dict(color="C3", marker="D", ls="-"),
        "affine g32": dict(color="C6", marker="d", ls="--"),
        "veloxquant-mlx turboquant_rvq": dict(color="C2", marker="v", ls=":"),
        "RVQ conditional +window": dict(color="C0", marker="o", ls="", mfc="none", ms=9),
        "RVQ conditional +mean K": dict(color="C4", marker="P", ls="", ms=8),
    }
    labels = {"RVQ conditional +window": "RVQ conditional, +window 64 (at codec bits)",
              "RVQ conditional +mean K": "RVQ conditional, +mean K (improvement tried)"}
    panels = [("k_err", "keys: E‖x−x̂‖²/‖x‖²"), ("v_err", "values: E‖x−x̂‖²/‖x‖²"),
              ("attn_kl", "attention rows: KL(p‖p̂) [nats]"),
              ("ppl_delta", "Δ perplexity vs float32 cache [%] (changes ≤ 0 drawn at 0.01%)")]
    fig, axes = plt.subplots(2, 2, figsize=(12, 9.5))
    handles = {}
    for ax, (key, title) in zip(axes.flat, panels):
        for fam, st in styles.items():
            if fam.endswith("+window") and key in ("k_err", "v_err"):
                continue  # a window does not change the codes
            pts = [(s["bits"], s[key]) for s in summaries if s["family"] == fam and s.get(key) is not None]
            if key == "ppl_delta":
                pts = [(b, max(100 * y, 0.01)) for b, y in pts]  # log scale: changes <= 0 drawn at 0.01%
            if not pts:
                continue
            st = dict(st)
            ls = st.pop("ls")
            h = ax.plot(*zip(*pts), ls="", **st)[0]
            if ls and len(pts) > 1:
                ax.plot(*zip(*pareto(pts)), ls=ls, color=st["color"])
            handles.setdefault(labels.get(fam, fam), h)
        ax.set_xscale("log", base=2)
        ax.set_xticks([2, 3, 4, 5, 6, 8])
        ax.set_xlim(1.1, 10)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set_yscale("log")
        if key == "ppl_delta":
            ax.axhline(0.5, color="grey", lw=0.8, ls="--")
            ax.text(1.15, 0.55, "+0.5%", color="grey", fontsize=8)
        ax.set_xlabel("bits per coordinate (norms / scales+biases and packing waste counted)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    fp16 = next((s for s in summaries if s["family"] == "fp16"), None)
    note = "float16 (16 bits" + (
        f", key error {fp16['k_err']:.0e}" if fp16 and fp16.get("k_err") is not None else "") + ") is off the plot"
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=4, fontsize=8.5,
               frameon=False)
    fig.suptitle("rvqstore: quality per bit on SmolLM2-135M keys, values and queries"
                 + (" (2,048 tokens of the Python Language Reference)" if ref else "") + "\n" + note, fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


def render_markdown(res: dict) -> str:
    S = res["summaries"]
    ref = res.get("ppl_ref")
    n = res["n_tokens"]
    lines: list[str] = []
    w = lines.append

    def row(s: dict) -> str:
        bits = f"{s['bits']:.2f}"
        if s["window"]:
            bits += f" (+win: {effective_window_bits(s['bits'], s['window'], n):.2f})"
        ppl = s.get("ppl")
        dppl = "–" if ppl is None else f"{100 * s['ppl_delta']:+.2f}%"
        top1 = "–" if ppl is None else f"{100 * s['top1_agree']:.1f}%"
        return (f"| {s['name']} | {bits} | {_e(s['k_err'])} | {_e(s['v_err'])} | {_e(s.get('attn_out_err'))} | "
                f"{_e(s.get('attn_kl'))} | {_f(s.get('score_slope'))} | {_f(ppl, '.3f')} | {dppl} | {top1} | "
                f"{_e(s.get('tok_kl'))} |")

    w("# Quality on real keys, values and queries")
    w("")
    w(f"Measured by `tools/eval_quality.py` on SmolLM2-135M-Instruct (the bundled model: {res['n_layers']} "
      f"layers, {res['n_kv_heads']} KV heads and {res['n_q_heads']} query heads of dim {res['head_dim']}, "
      f"float32 on CPU) over the first {n:,} tokens of `rvqstore/data/python_docs_excerpt.txt` (prose of "
      "the Python Language Reference, PSF License, see `rvqstore/data/NOTICE.md`). Every number below "
      "comes from one run of the tool; the plot is `docs/quality.png`.")
    w("")
    w("![rate-distortion](quality.png)")
    w("")
    w("## Summary")
    w("")
    for line in res.get("summary_lines", []):
        w(line)
    w("")
    for block in res.get("sections", []):
        lines.extend(block)
        w("")
    w("## Main table")
    w("")
    w("bits = stored bits per coordinate (per-vector norm or per-group scale+bias and unused bits in the "
      "packed words included; for `+window` rows the codec's bits, then in brackets the average over "
      f"{n:,} tokens with 64 tokens held at 16 bits). K/V err = E‖x−x̂‖²/‖x‖² over all vectors of all "
      "layers. attn out = attention-output relative error, attn KL = KL(p‖p̂) per attention row, "
      "slope = least-squares slope of quantized on true scores (1 = unbiased), all with the real "
      f"queries. ppl / Δppl / top-1 = perplexity of the {n - n // 2:,} second-half tokens, its change against the "
      "float32 cache, and agreement of the argmax token with the float32 cache; tok KL = mean KL of the "
      "next-token distribution against the float32 cache. `–`: not run.")
    w("")
    if ref:
        w(f"Reference (float32 cache): perplexity **{ref['ppl']:.3f}**, top-1 accuracy "
          f"{100 * ref['top1_acc']:.1f}%.")
        w("")
    w("| method | bits | K err | V err | attn out | attn KL | slope | ppl | Δppl | top-1 = fp32 | tok KL |")
    w("|---|---|---|---|---|---|---|---|---|---|---|")
    order = ["fp16", "RVQ conditional", "RVQ conditional +window", "RVQ single stage", "RVQ shared",
             "affine g64", "affine g32", "veloxquant-mlx turboquant_rvq", "check"]
    main = [s for s in S if s["note"] != "improvement"]
    for fam in order:
        for s in sorted((s for s in main if s["family"] == fam), key=lambda s: (s["bits"], s["window"])):
            w(row(s))
    for s in main:
        if s["family"] not in order:
            w(row(s))
    w("")
    if res.get("peer_missing"):
        w(f"The peer `{PEER_PACKAGE}` could not be imported here ({res['peer_missing']}); its rows are absent.")
        w("")
    # per layer
    w("## Per layer")
    w("")
    names = [nm for nm in res.get("per_layer_methods", []) if find(S, nm)]
    w("Relative error E‖x−x̂‖²/‖x‖² of keys (K) and values (V) per layer.")
    w("")
    w("| layer | " + " | ".join(f"{nm} K | {nm} V" for nm in names) + " |")
    w("|---|" + "---|---|" * len(names))
    for li in range(len(find(S, names[0])["k_err_layers"]) if names else 0):
        cells = []
        for nm in names:
            s = find(S, nm)
            cells += [_e(s["k_err_layers"][li]), _e(s["v_err_layers"][li])]
        w(f"| {res['layers'][li]} | " + " | ".join(cells) + " |")
    w("")
    w("## Improvement tried: per-head key mean subtraction (and two others)")
    w("")
    imp = [s for s in S if s["note"] == "improvement"]
    if imp:
        w("| method | bits | K err | V err | attn out | attn KL | slope | ppl | Δppl | top-1 = fp32 | tok KL |")
        w("|---|---|---|---|---|---|---|---|---|---|---|")
        for s in imp:
            w(row(s))
        w("")
    for line in res.get("improvement_lines", []):
        w(line)
    w("")
    w("## What exactly is measured")
    w("")
    for line in protocol_text(n, res["n_queries"]).strip().splitlines():
        w(line)
    w("")
    w("## How to reproduce")
    w("")
    w("```")
    w("pip install -e '.[tools]'          # matplotlib")
    w(f"pip install {PEER_PACKAGE}           # optional: the peer rows")
    w(f"python tools/eval_quality.py {res['argv']}".rstrip())
    w("```")
    w("")
    w(f"This run: {res['runtime_s']:.0f} s wall on {res['machine']} "
      f"({'; '.join(f'{k} {v:.0f} s' for k, v in res['timings'].items())}); "
      f"mlx {res['versions']['mlx']}, mlx-lm {res['versions']['mlx_lm']}"
      + (f", {PEER_PACKAGE} {res['versions']['peer']}" if res["versions"].get("peer") else "") + ". "
      "The tool re-executes itself with OpenBLAS preloaded where available (`rvqstore.blas`). "
      "Results are deterministic up to float summation order (fixed rotation seed 0, fixed text).")
    w("")
    return "\n".join(lines)


def protocol_text(n: int, nq: int) -> str:
    """The measurement protocol, for the doc."""
    half, rest = n // 2, n - n // 2
    return f"""
* **Capture.** The {n:,} tokens run through the model in chunks of 512 with a recording cache: the
  keys and values each attention layer hands to its cache (after RoPE) and the queries it hands to
  `scaled_dot_product_attention` (after RoPE) are kept, in float32. All vectors of all 30 layers enter
  the key/value errors ({n:,} tokens × 3 heads × 30 layers each for keys and values).
* **Methods.** RVQ rows call `RVQCodec.encode`/`decode` (rotation seed 0 unless noted). Affine rows call
  `mx.quantize`/`mx.dequantize` on the float16 cast of the vectors, so scales and biases are float16
  (as in a half-precision model; bits = b + 32/group). With `--ppl all` a further row runs mlx-lm's own
  `QuantizedKVCache` (4-bit, group 64) in this float32 model, whose scales/biases are therefore float32 (a
  cross-check of the simulated affine rows). The veloxquant rows call the peer's `TurboQuantRVQ(d=64, b, seed=0,
  use_hadamard=True)` `encode`/`decode` on float16 unit vectors with the norm stored as bfloat16, which
  is how its own `TurboQuantRVQKVCache` uses it for keys (that cache keeps values in float16; here the
  quantizer is applied to keys and values alike to compare codecs); its codes pack `32 // b` per uint32
  word, so 3 bits cost 3.5 (as in rvqstore).
* **Attention.** {nq} query positions evenly spaced over the second half of the text, all 9 query
  heads of every layer (query head h reads KV head h // 3), causal, scale 1/√64. True attention uses
  the exact keys and values; quantized attention uses the reconstructed ones (including the query's own
  token). `+window 64` rows keep the keys/values within 64 positions of each query exact (a sliding
  recent-token window). attn out = per layer Σ‖o−ô‖²/Σ‖o‖², averaged over layers; attn KL = mean over
  rows of Σ p log(p/p̂); slope = Σ c·ĉ / Σ c² over all visible entries, with c, ĉ the true and quantized
  scores centred per row (softmax ignores a per-row offset).
* **Perplexity.** Each method gets a fresh cache per layer: `RVQKVCache` (via `make_prompt_cache`;
  packed mode, resident mode for the window rows) for the RVQ rows, and for the others (affine, peer,
  improvements) a `KVCache` that stores the method's reconstruction of every key and value it receives.
  The first {half:,} tokens are prefilled into it with `rvqstore.generation.prefill` (chunks of 512; the
  keys and values of every chunk go through the cache before attention, so quantization also affects
  the hidden states of later layers and chunks, as in real use); the last prefill logits predict token
  {half:,}. Then tokens {half:,}…{n - 2:,} run in **one forward pass** against the cache (their own keys and
  values also go through it) and predict tokens {half + 1:,}…{n - 1:,}. Perplexity is over those
  {rest:,} targets; the float32 `KVCache` under the same protocol is the reference. Exception: the
  `+window 64` rows run the second half in chunks of 16 tokens, so that, as in generation, each
  scored token sees its recent predecessors exact (in one pass the window would only cover the last
  64–127 tokens of the text). Perplexity is measured for the rows that show one (each costs a prefill
  and a forward pass); `--ppl all` measures every row. The `+mean` rows use per-head means of the
  first {half:,} tokens' keys (and values), i.e. of the cached prefix.
"""


# ------------------------------------------------------------------------------------------------
# Analysis: goals, improvement, defaults


def _pct(s: dict | None) -> str:
    if s is None or s.get("ppl") is None:
        return "–"
    v = f"{100 * s['ppl_delta']:+.1f}%"
    return "±0.0%" if v in ("+0.0%", "-0.0%") else v


def analyse(res: dict) -> None:
    """Goal checks, findings, the improvement's verdict and the default choice, as markdown lines
    (added to ``res``); every number is read from the results, and a statement whose rows are missing
    is left out."""
    S = res["summaries"]
    g = lambda nm: find(S, nm)  # noqa: E731
    have = lambda *names, key="k_err": all(g(n) is not None and g(n).get(key) is not None for n in names)  # noqa: E731
    lines: list[str] = []
    imp: list[str] = []
    dflt: list[str] = []

    def goal(cfg: str, anchor: str, max_err: float, want_ppl: float | None) -> None:
        c, a = g(cfg), g(anchor)
        if c is None or a is None or c.get("k_err") is None or a.get("k_err") is None:
            return
        kv = max(c["k_err"], c["v_err"])
        parts = [f"**{cfg}** ({c['bits']:.2f} bits/coord): K err {_e(c['k_err'])}, V err {_e(c['v_err'])} "
                 f"(goal ≤ {max_err}: **{'met' if kv <= max_err else 'not met'}**)"]
        if want_ppl is not None and c.get("ppl") is not None:
            d = c["ppl_delta"]
            parts.append(f"perplexity {100 * d:+.2f}% vs the float32 cache (goal ≤ +{100 * want_ppl:.1f}%: "
                         f"**{'met' if d <= want_ppl else 'not met'}**)")
        better = c["bits"] < a["bits"] and c["k_err"] < a["k_err"] and c["v_err"] < a["v_err"]
        cmp = (f"against {anchor} ({a['bits']:.2f} bits: K {_e(a['k_err'])}, V {_e(a['v_err'])}"
               + (f", Δppl {_pct(a)}" if a.get("ppl") is not None else "") + ")")
        parts.append(f"{cmp}: **{'better at fewer bits' if better else 'not better at fewer bits'}**")
        lines.append("- Goal: " + "; ".join(parts) + ".")

    goal("RVQ 2+2 cond", "affine 4b g64", 0.012, 0.005)
    goal("RVQ 1+1 cond", "affine 2b g64", 0.13, None)

    cond = ["RVQ 1+1 cond", "RVQ 2+2 cond", "RVQ 4+1 cond", "RVQ 4+2 cond", "RVQ 3+3 cond", "RVQ 4+4 cond"]
    measured = [n for n in cond if have(n, key="ppl")]
    if measured:
        seeds = {n: g(f"{n} (seed 1)") for n in measured}
        curve = ", ".join(f"{n.split()[1]} ({g(n)['bits']:.2f} bits, error {_e(g(n)['k_err'])}) {_pct(g(n))}"
                          + (f" / {_pct(seeds[n])} with seed 1" if have(f"{n} (seed 1)", key="ppl") else "")
                          for n in measured)
        anchors = ", ".join(f"{n} {_pct(g(n))}" for n in ("affine 4b g64", "affine 8b g64", "veloxquant rvq 2+2")
                            if have(n, key="ppl"))
        lines.append(f"- **Perplexity is the binding constraint on this model**, far more than the vector errors "
                     f"suggest. Δppl of RVQ conditional: {curve}" + (f"; anchors: {anchors}" if anchors else "")
                     + ". The damage grows steeply below ~6 bits; staying within +0.5% reliably takes an error "
                       "near 1e-4 or less (4+4, or affine 8-bit).")
    noisy = [n for n in ("RVQ 4+2 cond", "RVQ 3+3 cond", "RVQ 2+2 cond") if have(n, f"{n} (seed 1)", key="ppl")]
    if noisy:
        lines.append("- **Chance matters at the percent level.** Another rotation seed, same errors: "
                     + "; ".join(f"{n.split()[1]} {_pct(g(n))} vs {_pct(g(n + ' (seed 1)'))}" for n in noisy)
                     + f". With {res['n_tokens'] - res['n_tokens'] // 2:,} scored tokens, perplexity differences "
                       "of a few points between configurations of equal error are noise; next-token KL (tok KL) "
                       "and top-1 agreement move more steadily with the error.")
    if have("RVQ 2+2 cond", "affine 4b g64", "veloxquant rvq 2+2", key="attn_kl"):
        r, a, v = g("RVQ 2+2 cond"), g("affine 4b g64"), g("veloxquant rvq 2+2")
        lines.append(f"- **At ~4.25–4.5 bits RVQ beats both anchors**: attention KL {_e(r['attn_kl'])} (RVQ 2+2, "
                     f"4.25 bits) vs {_e(a['attn_kl'])} (affine 4-bit g64, 4.50 bits) and {_e(v['attn_kl'])} "
                     f"(veloxquant 2+2, 4.25 bits)"
                     + (f"; Δppl {_pct(r)} vs {_pct(a)} and {_pct(v)}" if have(r["name"], a["name"], v["name"],
                                                                               key="ppl") else "")
                     + f". The peer's 2+2 has {v['k_err'] / r['k_err']:.1f}× our key error; at 1+1 the two are "
                     + (f"close ({_e(g('veloxquant rvq 1+1')['k_err'])} vs {_e(g('RVQ 1+1 cond')['k_err'])})."
                        if have("veloxquant rvq 1+1", "RVQ 1+1 cond") else "not compared."))
    if have("RVQ 4+1 cond", "RVQ 3+2 cond", "RVQ 4+2 cond", "RVQ 3+3 cond"):
        lines.append(f"- **Avoid 3-bit stages**: 3-bit codes pack 10 per 32-bit word (3.5 bits each), so 4+1 "
                     f"({g('RVQ 4+1 cond')['bits']:.2f} bits, error {_e(g('RVQ 4+1 cond')['k_err'])}) matches 3+2 "
                     f"({g('RVQ 3+2 cond')['bits']:.2f} bits, {_e(g('RVQ 3+2 cond')['k_err'])}) and 4+2 "
                     f"({g('RVQ 4+2 cond')['bits']:.2f}, {_e(g('RVQ 4+2 cond')['k_err'])}) matches 3+3 "
                     f"({g('RVQ 3+3 cond')['bits']:.2f}, {_e(g('RVQ 3+3 cond')['k_err'])}) "
                     "for a bit or half a bit less.")
    if have("RVQ 2+2 cond", "RVQ 2+2 shared", "RVQ 4 single", "RVQ 2 single", "RVQ 1+1 cond"):
        r, sh, s4 = g("RVQ 2+2 cond"), g("RVQ 2+2 shared"), g("RVQ 4 single")
        same = g("RVQ 2 single")["k_err"] == g("RVQ 1+1 cond")["k_err"]
        lines.append(f"- **Conditional residual, not shared**: at 2+2 the shared table has "
                     f"{sh['k_err'] / r['k_err']:.1f}× the key error ({_e(sh['k_err'])} vs {_e(r['k_err'])}). "
                     "The conditional two-stage code costs "
                     f"nothing against one stage of the same total bits (4-bit single {_e(s4['k_err'])} vs 2+2 "
                     f"{_e(r['k_err'])}" + ("; 1+1 conditional is exactly the 2-bit single-stage quantizer" if same
                                              else "") + ") and keeps stage-1-only decoding possible.")
    if have("RVQ 2+2 cond", "RVQ 2+2 cond +window 64", key="attn_kl"):
        r, w = g("RVQ 2+2 cond"), g("RVQ 2+2 cond +window 64")
        eff = effective_window_bits(r["bits"], 64, res["n_tokens"])
        lines.append(f"- **Recent-token window** (64 exact tokens, {eff:.2f} bits/coord on average at "
                     f"{res['n_tokens']:,} tokens): at 2+2 attention KL {_e(r['attn_kl'])} → "
                     f"{_e(w['attn_kl'])}, attention-output error {_e(r['attn_out_err'])} → {_e(w['attn_out_err'])}"
                     + (f"; Δppl {_pct(r)} → {_pct(w)} when the second half is scored in 16-token chunks so the "
                        f"window acts as in generation" if have(r["name"], w["name"], key="ppl") else "")
                     + ". It helps generation; it does not rescue 2+2 on this model.")
    lines.append(f"- Caveats: one small model (head_dim 64, 3 KV heads; small models are more sensitive to KV "
                 f"quantization than large ones), one text that the model predicts well (float32 top-1 "
                 + (f"{100 * res['ppl_ref']['top1_acc']:.0f}%, perplexity {res['ppl_ref']['ppl']:.2f}"
                    if res.get("ppl_ref") else "n/a") + "), one rotation seed except where noted.")

    # ---- the improvement tried
    pairs = [(f"RVQ {b} cond", f"RVQ {b} cond +mean K") for b in ("1+1", "2+2", "4+1", "4+2")]
    pairs = [(a, b) for a, b in pairs if have(a, b)]
    if pairs:
        imp.append("**Per-head key mean subtraction** (`+mean K`): subtract the mean key of each (layer, head) "
                   "before encoding and add it back after decoding. The means here come from the first half of the "
                   "text (a prompt/calibration pass; 64 floats per head, nothing per token). For keys the mean need "
                   "not even be added back: it shifts all scores of a query row by the same q·μ, which softmax "
                   "ignores.")
        imp.append("")
        imp.append("| config | K err | → +mean K | attn KL | → +mean K | Δppl | → +mean K | tok KL | → +mean K |")
        imp.append("|---|---|---|---|---|---|---|---|---|")
        for a, b in pairs:
            A, B = g(a), g(b)
            imp.append(f"| {a.split()[1]} | {_e(A['k_err'])} | {_e(B['k_err'])} | {_e(A.get('attn_kl'))} | "
                       f"{_e(B.get('attn_kl'))} | {_pct(A)} | {_pct(B)} | {_e(A.get('tok_kl'))} | "
                       f"{_e(B.get('tok_kl'))} |")
        imp.append("")
        kr = [g(a)["k_err"] / g(b)["k_err"] for a, b in pairs]
        big = [(a, b) for a, b in pairs if have(a, b, key="ppl") and g(a)["ppl_delta"] > 0.05]
        def span(v: list[float]) -> str:
            lo, hi = f"{min(v):.1f}", f"{max(v):.1f}"
            return lo if lo == hi else f"{lo}–{hi}"

        text = f"It divides the key error by {span(kr)} at every rate, at no cost in bits"
        if big:
            pr = [g(a)["ppl_delta"] / g(b)["ppl_delta"] for a, b in big]
            tr = [g(a)["tok_kl"] / g(b)["tok_kl"] for a, b in big]
            which = ", ".join(a.split()[1] for a, _ in big)
            text += (f"; where the perplexity loss stands clear of the noise ({which}) it divides that loss by "
                     f"{span(pr)} and the next-token KL by {span(tr)}")
        text += "."
        if have("RVQ 2+2 cond +mean K", "RVQ 2+2 cond +mean K,V", key="attn_out_err"):
            a, b = g("RVQ 2+2 cond +mean K"), g("RVQ 2+2 cond +mean K,V")
            text += (f" Values do not gain: subtracting their mean too (`+mean K,V`) lowers the 2+2 value error "
                     f"({_e(a['v_err'])} → {_e(b['v_err'])}) but raises the attention-output error "
                     f"({_e(a['attn_out_err'])} → {_e(b['attn_out_err'])}).")
        text += (" **Recommendation to the lead: adopt key-mean subtraction as codec version 2** (one mean per layer "
                 "and KV head in the header, computed from the first prefill chunk); this tool does not change the "
                 "codec.")
        imp.append(text)
    if have("RVQ 2+2 cond", "RVQ 2+2 cond +ls-scale", "RVQ 2+2 cond +sink 1"):
        r, ls, sk = g("RVQ 2+2 cond"), g("RVQ 2+2 cond +ls-scale"), g("RVQ 2+2 cond +sink 1")
        imp.append("")
        imp.append(f"Also measured, not worth a format change: a least-squares per-vector scale instead of the norm "
                   f"(`+ls-scale`, same bits) lowers the 2+2 key error only from {_e(r['k_err'])} to {_e(ls['k_err'])} "
                   f"and the attention KL from {_e(r['attn_kl'])} to {_e(ls['attn_kl'])}, while moving the score "
                   f"slope further from 1 ({_f(r['score_slope'])} → {_f(ls['score_slope'])}); keeping the first "
                   f"token (the attention sink) exact (`+sink 1`) changes the attention KL from {_e(r['attn_kl'])} "
                   f"to {_e(sk['attn_kl'])}.")

    # ---- defaults
    if have("RVQ 4+2 cond", "RVQ 2+2 cond", "RVQ 4+4 cond", key="ppl"):
        q2, c2, q4 = g("RVQ 4+2 cond"), g("RVQ 2+2 cond"), g("RVQ 4+4 cond")
        s1 = g("RVQ 4+2 cond (seed 1)")
        dflt += [
            "## Defaults chosen from the curve",
            "",
            f"- **`bits=(4, 2)`, `residual=\"conditional\"`: recommended default** ({q2['bits']:.2f} bits/coord, "
            f"{16 / q2['bits']:.2f}× smaller than float16). It is the knee of the measured curve: key/value error "
            f"{_e(q2['k_err'])}/{_e(q2['v_err'])}, attention KL {_e(q2['attn_kl'])}, Δppl {_pct(q2)}"
            + (f" ({_pct(s1)} with seed 1)" if s1 and s1.get("ppl") is not None else "")
            + f", top-1 agreement {100 * q2['top1_agree']:.1f}%, tok KL {_e(q2['tok_kl'])}. It misses the +0.5% "
              "perplexity goal by a couple of points (3+3, with the same error, lands on either side of it depending "
              "on the seed); only 4+4 meets it reliably. One bit less per coordinate (4+1) already costs "
              f"{_pct(g('RVQ 4+1 cond'))}, two bits less (2+2) {_pct(c2)}; 3+3 gives the same error for one bit more.",
            f"- **`bits=(4, 4)` when the cache must be indistinguishable** ({q4['bits']:.2f} bits/coord, "
            f"{16 / q4['bits']:.2f}× smaller than float16): error {_e(q4['k_err'])}, Δppl {_pct(q4)}; it beats "
            + (f"affine 8-bit g64 ({_e(g('affine 8b g64')['k_err'])} at 8.50 bits)" if have("affine 8b g64")
               else "affine 8-bit") + " at fewer bits.",
            f"- **`bits=(2, 2)` stays available as the compact setting** ({c2['bits']:.2f} bits/coord, "
            f"{16 / c2['bits']:.2f}× smaller than float16), the library's current default: on this model it costs "
            f"{_pct(c2)} perplexity (top-1 agreement {100 * c2['top1_agree']:.1f}%), still about half of what "
            "affine 4-bit costs at more bits, so it suits larger models or uses that tolerate some drift; "
            "**1+1 is not usable** on this model "
            f"({_pct(g('RVQ 1+1 cond'))}).",
            "- **`dense_window=0`** stays the default: a stored prompt is coded whole anyway, and for generation "
            "the window's gain (see the `+window 64` rows) does not change which bit width is acceptable; "
            "64 is a reasonable setting when generating long outputs at 4.25 bits or less.",
            "- **Next codec version**: key-mean subtraction (see the improvement section below) halves the key "
            "error at the same bits and cuts the perplexity loss of 2+2 and 4+1 by 2–3×.",
        ]
    res["summary_lines"] = lines
    res["improvement_lines"] = imp
    res["sections"] = [dflt] if dflt else []


# ------------------------------------------------------------------------------------------------
# Driver


def run(model: Any, tokenizer: Any, *, n_tokens: int = 2048, n_queries: int = 128, ppl: str = "main",
        peer: bool = True, layers: Sequence[int] | None = None, select: Callable[[Method], bool] | None = None,
        window: int = 64, log: Callable[[str], None] = print) -> dict:
    """The whole evaluation; returns the results dict that :func:`render_markdown` turns into the doc.

    ``layers``: evaluate the vector/attention metrics on these layers only; ``select``: keep only the
    methods it accepts (both for quick runs and tests); ``window``: the recent-token window of the
    ``+window`` rows."""
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    tokens = load_text_tokens(tokenizer, n_tokens)
    t = time.perf_counter()
    cap = capture(model, tokens)
    timings["capture"] = time.perf_counter() - t
    log(f"captured {cap.n_layers} layers x {cap.n_tokens} tokens in {timings['capture']:.1f}s")
    dim = cap.keys.shape[-1]
    means = head_means(cap, n_tokens // 2)
    methods, peer_missing = build_methods(dim=dim, peer=peer, means=means, window=window)
    if select is not None:
        methods = [m for m in methods if select(m)]
    if peer and peer_missing:
        log(f"peer {PEER_PACKAGE} unavailable: {peer_missing}")
    t = time.perf_counter()
    rows = evaluate_vectors_and_attention(cap, methods, n_queries=n_queries, layers=layers, progress=log)
    timings["vectors+attention"] = time.perf_counter() - t
    ppl_ref, ppl_res = None, {}
    if ppl != "none":
        chosen = [m for m in methods if ppl == "all" or m.ppl == "main"]
        if ppl == "all":
            chosen.append(mlx_lm_quantized_method(4, 64, dim))
        t = time.perf_counter()
        ppl_ref, ppl_res = evaluate_perplexity(model, tokens, chosen, progress=log)
        timings["perplexity"] = time.perf_counter() - t
        log(f"reference ppl {ppl_ref['ppl']:.4f}")
        rows += [Row(m.name, m.family, m.bits, note=m.note) for m in chosen if m.family == "check"]
    summaries = []
    for r in rows:
        r.ppl = ppl_res.get(r.name)
        summaries.append(r.summary())
    n_layers = cap.n_layers
    res = {
        "n_tokens": n_tokens, "n_queries": len(query_positions(n_tokens, n_queries)),
        "n_layers": n_layers, "layers": list(range(n_layers)) if layers is None else list(layers),
        "n_kv_heads": cap.keys.shape[1], "n_q_heads": cap.queries.shape[1], "head_dim": dim,
        "summaries": summaries, "ppl_ref": ppl_ref, "peer_missing": peer_missing,
        "timings": timings, "runtime_s": time.perf_counter() - t_start,
        "per_layer_methods": ["RVQ 1+1 cond", "RVQ 2+2 cond", "affine 2b g64", "affine 4b g64"],
        "versions": _versions(), "machine": f"{platform.machine()} {platform.system()}, {_ncpu()} CPU cores",
    }
    return res


def _ncpu() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0)


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for key, dist in (("mlx", "mlx"), ("mlx_lm", "mlx-lm"), ("peer", PEER_PACKAGE)):
        try:
            out[key] = version(dist)
        except PackageNotFoundError:
            out[key] = None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from rvqstore.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of real text (>= 2000 for the doc)")
    ap.add_argument("--queries", type=int, default=128, help="query positions for the attention metrics")
    ap.add_argument("--ppl", choices=("main", "all", "none"), default="main",
                    help="perplexity for the main methods (default), all methods, or none")
    ap.add_argument("--no-peer", action="store_true", help=f"skip {PEER_PACKAGE} even if installed")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs"),
                    help="folder for quality.md and quality.png")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--from-json", default=None,
                    help="skip the measurements: re-render the doc and plot from a --json file of an earlier run")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    if args.from_json:
        res = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
    else:
        from rvqstore.model import load_model

        model, tokenizer = load_model()
        res = run(model, tokenizer, n_tokens=args.tokens, n_queries=args.queries, ppl=args.ppl,
                  peer=not args.no_peer, log=log)
        res["runtime_s"] = time.perf_counter() - t0
        shown = list(sys.argv[1:] if argv is None else argv)
        if "--json" in shown:  # where the raw results went is not part of the recipe
            i = shown.index("--json")
            del shown[i:i + 2]
        res["argv"] = " ".join(shown)
    analyse(res)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(res["summaries"], res["ppl_ref"], out / "quality.png")
    (out / "quality.md").write_text(render_markdown(res), encoding="utf-8")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1), encoding="utf-8")
    log(f"wrote {out / 'quality.md'} and {out / 'quality.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
