"""Attention on the codes for MLX's CPU backend, computed on the host with numpy.

The formulation is :mod:`.ops`'s (rotate the queries once, scores ``s_k * (q_rot . y_k)`` from
rotated-domain code rows, one softmax with the full-precision window and sinks, values accumulated
rotated and un-rotated once per head); only the engine differs. On MLX's CPU backend (mlx 0.32.4)
the two steps that dominate it are slow: a gather costs ~10 ns per index (the group-table decode of
keys and values, 2.2-5 ms per SmolLM2 layer at 4k tokens) and ``exp`` ~25 ns per element (the
softmax, 0.7 ms). numpy on the same machine gathers a 16-byte table row in ~2 ns and takes ``exp`` in
~0.5 ns, so here the codes are read in place (zero-copy views of the cache's evaluated buffers) and
the step runs in numpy: one table gather per ``g`` coordinates (the codec's own group tables, so the
rotated rows are bit-identical to its decode), two small BLAS matmuls per KV head, one array back
to MLX. Measured per layer and whole decode steps: tools/results/generation-cpu.md, docs/attention.md.

The price is an evaluation inside the model's forward (numpy needs the bytes): the graph up to the
layer's queries is computed at the call. On the CPU backend that is where it would run anyway; under
a function transformation (``mx.compile``, ``vmap``, ``grad``) arrays cannot be evaluated, so such
calls, and codecs without group tables (3-bit stages), go to :mod:`.ops` (:func:`attend` returns None).
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from ..codec import RVQCodec
from ..errors import InputShapeError
from . import host_blas, masks
from .view import CodesView

_consts: dict = {}  # codec settings -> constants; a few entries per process (one per distinct codec)


def on_cpu() -> bool:
    """Whether calls run on MLX's CPU backend (the default device is where the model's ops run)."""
    return mx.default_device() == mx.cpu


def _codec_consts(codec: RVQCodec, two_stage: bool) -> tuple | None:
    """``(table (N, g) float32, g, forward M, inverse M.T / dim, signs)``, built once per codec
    settings (every layer's codec shares them: a resumed file's first step would otherwise build a
    table per layer side, 6 ms each at 2+2); None where the codec has no group table (3-bit stages)."""
    key = (codec.dim, codec.bits, codec.residual, two_stage, codec.centroids1.tobytes(),
           b"" if codec.centroids2 is None else codec.centroids2.tobytes(), codec.signs.tobytes())
    if key in _consts:
        return _consts[key]
    lut = codec._group_lut(two_stage)
    if lut is None:
        got = None
    else:
        from .. import hadamard

        eye = mx.eye(codec.dim, dtype=mx.float32)
        got = (np.array(lut[0]), lut[1], np.array(hadamard.forward(eye)),  # x @ M == hadamard.forward(x)
               np.array(hadamard.inverse(eye, 1.0 / codec.dim)), np.asarray(codec.signs, dtype=np.float32))
    if len(_consts) >= 64:  # many distinct codecs (e.g. seeds in tests): start over, never grow unbounded
        _consts.clear()
    _consts[key] = got
    return got


#: float32 scores held at once (batch x query heads x queries x tokens): longer calls (prefill
#: chunks) run in blocks of queries, so memory stays bounded at any context
MAX_SCORES = 1 << 22

#: code vectors (batch x KV heads x tokens) per block of the gather + matmul: the block's index and
#: row buffers (reused, per thread) stay a few MB whatever the context or batch (SmolLM2's 3 KV
#: heads: 10,922 tokens per block)
BLOCK_VECTORS = 1 << 15
_scratch = threading.local()


def block_queries(batch: int, n_heads: int, n_tokens: int) -> int:
    """Queries per block of a call: bounded scores, whatever the call."""
    return max(1, MAX_SCORES // max(1, batch * n_heads * n_tokens))


def query_blocks(batch: int, n_heads: int, n_tokens: int, n_queries: int) -> int:
    """How many blocks of queries a call runs in (each block gathers every code row again)."""
    return -(-n_queries // block_queries(batch, n_heads, n_tokens))


def _buffer(name: str, shape: tuple, dtype) -> np.ndarray:
    """A reused per-thread buffer of at least ``shape`` (fresh multi-MB numpy arrays page-fault on
    every call: measured 2.9 ms instead of 1.1 ms for one 4k-token side)."""
    size = int(np.prod(shape))
    buf = getattr(_scratch, name, None)
    if buf is None or buf.dtype != dtype or buf.size < size:
        buf = np.empty(size, dtype)
        setattr(_scratch, name, buf)
    return buf[:size].reshape(shape)


def _index(c1: np.ndarray, c2: np.ndarray | None, codec: RVQCodec, g: int, ng: int) -> np.ndarray:
    """The group-table index of every ``g`` coordinates: stage-1 fields, stage-2 fields above them
    (the layout of :meth:`RVQCodec._group_lut`; at most 16 bits), built in uint16 and handed to
    ``take`` as ``intp`` (numpy converts any other index type into a fresh array on every call)."""
    lead = c1.shape[:-1]
    w1 = g * codec.bits1
    idx16 = _buffer("idx16", lead + (ng,), np.uint16)
    if c2 is not None and w1 == 8:  # 4+x, 2+2, 1+1: stage 1 is the low byte, stage 2 the high one
        lo_hi = idx16.view(np.uint8).reshape(lead + (ng, 2))
        _fields(c1, 8, ng, lo_hi[..., 0])
        _fields(c2, g * codec.bits2, ng, lo_hi[..., 1])
    else:
        _fields(c1, w1, ng, idx16)
        if c2 is not None:
            tmp = _buffer("stage2", idx16.shape, np.uint16)
            _fields(c2, g * codec.bits2, ng, tmp)
            np.left_shift(tmp, w1, out=tmp)
            np.bitwise_or(idx16, tmp, out=idx16)
    idx = _buffer("idx", idx16.shape, np.intp)
    np.copyto(idx, idx16)
    return idx


def _fields(words: np.ndarray, width: int, ng: int, out: np.ndarray) -> None:
    """``out[..., k]`` = the ``k``-th ``width``-bit field (2, 4 or 8 bits) of each vector's uint32
    words, LSB first (little-endian words), for ``k < ng``; ``out`` may be strided."""
    b = words.view(np.uint8)
    if width == 8:
        np.copyto(out, b[..., :ng], casting="unsafe")
        return
    per = 8 // width
    for j in range(per):  # field k = byte k // per, bits (k % per) * width
        cnt = len(range(j, ng, per))
        np.bitwise_and(b[..., :cnt] >> (j * width), (1 << width) - 1, out=out[..., j::per], casting="unsafe")


def _rows(codec: RVQCodec, consts: tuple, c1: np.ndarray, c2: np.ndarray | None) -> np.ndarray:
    """Rotated-domain rows ``y`` (float32, ``(..., n, dim)``) of packed codes: one table gather per
    ``g`` coordinates, into a reused buffer (valid until the next call)."""
    table, g = consts[0], consts[1]
    ng = -(-codec.dim // g)
    idx = _index(c1, c2, codec, g, ng)
    y = _buffer("rows", idx.shape + (g,), np.float32)
    np.take(table, idx, axis=0, out=y, mode="clip")  # indices are bit fields: always in range
    y = y.reshape(*idx.shape[:-1], ng * g)
    return y[..., :codec.dim] if ng * g != codec.dim else y


def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def attend(view: CodesView, queries: mx.array, scale: float, mask=None, sinks: mx.array | None = None
           ) -> mx.array | None:
    """Same contract as :func:`rvqstore.attention.ops.attend`; None where this path does not apply."""
    n = view.n_coded
    two = {side: n > 0 and bufs[2] is not None and codec.bits2 > 0
           for side, codec, bufs in (("k", view.key_codec, view.key_buffers), ("v", view.value_codec, view.value_buffers))}
    consts = (_codec_consts(view.key_codec, two["k"]), _codec_consts(view.value_codec, two["v"]))
    if None in consts:
        return None
    lazy = _inputs(view, queries, mask, sinks, two)
    try:
        mx.eval(list(lazy.values()))
        a = {k: np.asarray(v) for k, v in lazy.items()}  # zero-copy views of the evaluated arrays
    except ValueError:  # inside mx.compile / vmap: arrays cannot be evaluated there
        return None
    b, hq, l, dk = queries.shape
    t = view.n_total
    step = block_queries(b, hq, t)
    outs = []
    with host_blas.one_thread():
        for l0 in range(0, l, step):
            l1 = min(l, l0 + step)
            outs.append(_compute(view, _query_block(a, l0, l1, l), consts, (b, hq, l1 - l0, dk), scale,
                                 masks.is_causal(mask), first=t - l + l0))
    return mx.array(outs[0] if len(outs) == 1 else np.concatenate(outs, axis=2)).astype(queries.dtype)


def _query_block(a: dict, l0: int, l1: int, l: int) -> dict:
    """The inputs of queries ``[l0, l1)``: the queries and the mask rows (a mask broadcast over the
    queries stays whole)."""
    if l0 == 0 and l1 == l:
        return a
    out = dict(a, q=a["q"][:, :, l0:l1])
    if "mask" in a and a["mask"].shape[-2] == l:
        out["mask"] = a["mask"][..., l0:l1, :]
    return out


def _inputs(view: CodesView, queries: mx.array, mask, sinks, two: dict) -> dict:
    """The MLX arrays the computation reads, by name (still lazy): queries, the used part of every
    code stream (scales as their bfloat16 bit patterns), the window, the grouped mask, the sinks."""
    b, hq, l, _ = queries.shape
    hkv, n = view.n_kv_heads, view.n_coded
    view.settle()  # MLX ops read the buffers below
    lazy = {"q": queries.astype(mx.float32)}
    if n:
        for side, (s, c1, c2) in (("k", view.key_buffers), ("v", view.value_buffers)):
            lazy[side + "s"] = s[:, :, :n].view(mx.uint16)
            lazy[side + "1"] = c1[:, :, :n]
            if two[side]:
                lazy[side + "2"] = c2[:, :, :n]
    if view.n_dense:
        lazy["dk"] = view.dense_keys.astype(mx.float32)
        lazy["dv"] = view.dense_values.astype(mx.float32)
    if isinstance(mask, mx.array):
        t = view.n_total
        gm = masks.grouped(mask, hkv, hq // hkv)
        if gm.shape[-2:] != (l, t) and not (gm.shape[-2] in (1, l) and gm.shape[-1] == t):
            raise InputShapeError(f"attention mask of shape {tuple(mask.shape)} does not fit {l} queries x {t} keys")
        lazy["mask"] = gm if gm.dtype == mx.bool_ else gm.astype(mx.float32)
    if sinks is not None:
        lazy["sinks"] = sinks.astype(mx.float32)
    return lazy


def _compute(view: CodesView, a: dict, consts: tuple, qshape: tuple, scale: float, causal: bool, first: int
             ) -> np.ndarray:
    """The attention output ``(B, n_heads, L, Dv)`` float32 from the evaluated inputs ``a``; the
    queries sit at positions ``first, first + 1, ...`` of the ``n_total`` held (for a causal mask)."""
    kc, vc = view.key_codec, view.value_codec
    (kconst, vconst), n, t = consts, view.n_coded, view.n_total
    b, hq, l, dk = qshape
    hkv = view.n_kv_heads
    grp = hq // hkv
    r = grp * l
    q = a["q"].reshape(b, hkv, r, dk)
    block = max(1, BLOCK_VECTORS // (b * hkv))  # tokens per gather block
    scores = np.empty((b, hkv, r, t), np.float32)
    if n:
        q_rot = ((q * kconst[4]) @ kconst[2]) * np.float32(scale / dk)
        k1, k2 = a["k1"], a.get("k2")
        for s0 in range(0, n, block):
            s1 = min(n, s0 + block)
            yk = _rows(kc, kconst, k1[:, :, s0:s1], None if k2 is None else k2[:, :, s0:s1])
            # tall-skinny (rows x D) @ (D x R): measured steadier and faster than q_rot @ yk.T
            scores[..., s0:s1] = (yk @ q_rot.swapaxes(-1, -2)).swapaxes(-1, -2)
        scores[..., :n] *= _bf16_to_f32(a["ks"])[:, :, None, :]
    if view.n_dense:
        scores[..., n:] = (q * np.float32(scale)) @ a["dk"].swapaxes(-1, -2)
    scores = scores.reshape(b, hkv, grp, l, t)
    if causal and first < t - 1:
        scores = np.where(_causal(first, l, t), scores, np.float32(-np.inf))
    elif "mask" in a:
        m = a["mask"]
        scores = np.where(m, scores, np.float32(-np.inf)) if m.dtype == np.bool_ else scores + m
    if "sinks" in a:  # a per-head logit that takes part in the normalization only
        sk = np.broadcast_to(a["sinks"].reshape(1, hkv, grp, 1, 1), (b, hkv, grp, l, 1))
        scores = np.concatenate([sk, scores], axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):  # fully masked rows give NaN, as SDPA does
        scores = scores - scores.max(axis=-1, keepdims=True)
        p = np.exp(scores, out=scores)
        p /= p.sum(axis=-1, keepdims=True)
    if "sinks" in a:
        p = p[..., 1:]
    p = p.reshape(b, hkv, r, t)
    out = np.zeros((b, hkv, r, vc.dim), np.float32)
    if n:
        pv = p[..., :n] * _bf16_to_f32(a["vs"])[:, :, None, :]
        v1, v2 = a["v1"], a.get("v2")
        for s0 in range(0, n, block):
            s1 = min(n, s0 + block)
            yv = _rows(vc, vconst, v1[:, :, s0:s1], None if v2 is None else v2[:, :, s0:s1])
            out += pv[..., s0:s1] @ yv
        out = (out @ vconst[3]) * vconst[4]  # un-rotate once per head and query
    if view.n_dense:
        out += p[..., n:] @ a["dv"]
    return out.reshape(b, hq, l, -1)


def _causal(first: int, n_queries: int, n_keys: int) -> np.ndarray:
    """``(L, T)`` boolean: the query at position ``first + i`` sees keys at positions <= its own."""
    q = np.arange(first, first + n_queries)[:, None]
    return q >= np.arange(n_keys)[None]
