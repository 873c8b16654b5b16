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
import weakref

import mlx.core as mx
import numpy as np

from ..codec import RVQCodec
from ..errors import InputShapeError
from . import host_blas, masks
from .view import CodesView

_consts: "weakref.WeakKeyDictionary[RVQCodec, tuple]" = weakref.WeakKeyDictionary()


def on_cpu() -> bool:
    """Whether calls run on MLX's CPU backend (the default device is where the model's ops run)."""
    return mx.default_device() == mx.cpu


def _codec_consts(codec: RVQCodec, two_stage: bool) -> tuple | None:
    """Per codec, built once: ``(table (N, g) float32, g, forward M, inverse M.T / dim, signs)``;
    None where the codec has no group table (3-bit stages)."""
    per = _consts.setdefault(codec, {})
    if two_stage in per:
        return per[two_stage]
    lut = codec._group_lut(two_stage)
    if lut is None:
        return None
    eye = mx.eye(codec.dim, dtype=mx.float32)
    from .. import hadamard

    fwd = np.array(hadamard.forward(eye))  # x @ fwd == hadamard.forward(x)
    inv = np.array(hadamard.inverse(eye, 1.0 / codec.dim))
    table = np.array(lut[0])
    got = (table, lut[1], fwd, inv, np.asarray(codec.signs, dtype=np.float32))
    per[two_stage] = got
    return got


#: tokens per block of the gather + matmul: the block's index and row buffers (reused, per thread)
#: stay in cache, and no buffer grows with the context
BLOCK = 4096
_scratch = threading.local()


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
    (the layout of :meth:`RVQCodec._group_lut`), as ``intp`` (numpy's fast take)."""
    lead = c1.shape[:-1]
    idx = _buffer("idx", lead + (ng,), np.intp)
    _fields_into(c1, g * codec.bits1, ng, idx, shift=0)
    if c2 is not None:
        _fields_into(c2, g * codec.bits2, ng, idx, shift=g * codec.bits1)
    return idx


def _fields_into(words: np.ndarray, width: int, ng: int, idx: np.ndarray, shift: int) -> None:
    """``idx |= field << shift`` (``idx = field`` for shift 0) for the first ``ng`` ``width``-bit fields
    of each vector's uint32 words, LSB first (little-endian words)."""
    lead = words.shape[:-1]
    if width >= 8:
        f = words.view(np.uint8 if width == 8 else np.uint16)
    else:
        b = words.view(np.uint8)
        per = 8 // width
        f = _buffer("fields", b.shape + (per,), np.uint8)
        for j in range(per):
            np.bitwise_and(b >> (j * width), (1 << width) - 1, out=f[..., j])
        f = f.reshape(*lead, -1)
    f = f[..., :ng]
    if shift == 0:
        np.copyto(idx, f, casting="unsafe")
    else:
        tmp = _buffer("shifted", idx.shape, np.intp)
        np.left_shift(f, shift, out=tmp, dtype=np.intp, casting="unsafe")
        np.bitwise_or(idx, tmp, out=idx)


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
    with host_blas.one_thread():
        out = _compute(view, a, consts, queries.shape, scale, masks.is_causal(mask))
    return mx.array(out).astype(queries.dtype)


def _inputs(view: CodesView, queries: mx.array, mask, sinks, two: dict) -> dict:
    """The MLX arrays the computation reads, by name (still lazy): queries, the used part of every
    code stream (scales as their bfloat16 bit patterns), the window, the grouped mask, the sinks."""
    b, hq, l, _ = queries.shape
    hkv, n = view.n_kv_heads, view.n_coded
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


def _compute(view: CodesView, a: dict, consts: tuple, qshape: tuple, scale: float, causal: bool) -> np.ndarray:
    """The attention output ``(B, n_heads, L, Dv)`` float32 from the evaluated inputs ``a``."""
    kc, vc = view.key_codec, view.value_codec
    (kconst, vconst), n, t = consts, view.n_coded, view.n_total
    b, hq, l, dk = qshape
    hkv = view.n_kv_heads
    grp = hq // hkv
    r = grp * l
    q = a["q"].reshape(b, hkv, r, dk)
    scores = np.empty((b, hkv, r, t), np.float32)
    if n:
        q_rot = ((q * kconst[4]) @ kconst[2]) * np.float32(scale / dk)
        k1, k2 = a["k1"], a.get("k2")
        for s0 in range(0, n, BLOCK):
            s1 = min(n, s0 + BLOCK)
            yk = _rows(kc, kconst, k1[:, :, s0:s1], None if k2 is None else k2[:, :, s0:s1])
            # tall-skinny (rows x D) @ (D x R): measured steadier and faster than q_rot @ yk.T
            scores[..., s0:s1] = (yk @ q_rot.swapaxes(-1, -2)).swapaxes(-1, -2)
        scores[..., :n] *= _bf16_to_f32(a["ks"])[:, :, None, :]
    if view.n_dense:
        scores[..., n:] = (q * np.float32(scale)) @ a["dk"].swapaxes(-1, -2)
    scores = scores.reshape(b, hkv, grp, l, t)
    if causal and l > 1:
        scores = np.where(_causal(l, t), scores, np.float32(-np.inf))
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
        for s0 in range(0, n, BLOCK):
            s1 = min(n, s0 + BLOCK)
            yv = _rows(vc, vconst, v1[:, :, s0:s1], None if v2 is None else v2[:, :, s0:s1])
            out += pv[..., s0:s1] @ yv
        out = (out @ vconst[3]) * vconst[4]  # un-rotate once per head and query
    if view.n_dense:
        out += p[..., n:] @ a["dv"]
    return out.reshape(b, hq, l, -1)


def _causal(n_queries: int, n_keys: int) -> np.ndarray:
    q = np.arange(n_keys - n_queries, n_keys)[:, None]
    return q >= np.arange(n_keys)[None]
