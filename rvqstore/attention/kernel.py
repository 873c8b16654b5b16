"""Split-K attention on the packed codes, on a GPU backend (``kernels/rvq_attend.inc``).

One launch per layer and step computes, for each (batch x KV head, split of the coded tokens), the
partial softmax state of all ``R = G * L`` query rows of the head's GQA group: ``m`` (row max),
``l`` (sum of exp) and ``o`` (the exp-weighted sum of value rows in the rotated domain). Splitting
the sequence across threadgroups (flash-decoding) fills the GPU with a single query. :func:`combine`
then merges the splits, the full-precision window and sinks in one softmax (MLX ops on tensors of
``splits x R x D``), un-rotates once and normalizes.

:func:`partials_reference` computes the same partials with MLX ops: the kernel's model, so the split
bookkeeping and :func:`combine` are tested on every backend, and the kernel against it on a GPU.

The kernel takes: codes of 1, 2 or 4 bits per stage, head dims that are multiples of 4 up to 256,
up to :data:`MAX_ROWS` rows, masks None or ``"causal"``. Other calls return None here and the
MLX-ops formulation serves them. A kernel that fails to build or run is latched off (logged once)
like the codec's fused kernels.

The layout inside a threadgroup is chosen per configuration from the module settings below (lanes per
token in the key phase, pair tables, staged code words, value coordinates per thread; docs/attention.md):
each is a template argument of the same kernel body, so earlier layouts stay selectable for same-run
comparisons (tools/kernel_variants.py).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref

import mlx.core as mx
import numpy as np

from .. import device_args, fused, kernel_cache
from . import kernel_mma, masks, ops
from .launch_args import THREADS, decode_table, prepared, split_plan
from .launch_args import static_params as _static
from .view import CodesView

log = logging.getLogger("rvqstore.kernels")

MAX_ROWS = 8
MAX_DIM = 256
#: threads per token in the key phase: None picks by shape (:func:`key_lanes`); 1 is the first kernel's
#: one thread per token (kept for same-run comparisons); a power of two up to 32 forces that many
KEY_LANES: int | None = None
#: rotated-query floats a lane keeps in registers in the key phase (rows x its coordinates)
KEY_REGISTERS = 64
#: decode two coordinates per table read (``rvq_pair``: 2^(2 (bits1 + bits2)) entries in shared memory)
#: where bits1 + bits2 <= PAIR_MAX_BITS and the key phase has several lanes per token; False: never
PAIR_TABLES = True
PAIR_MAX_BITS = 4
#: coordinates per thread in the value phase: 4, or 8 where the value head dim allows it (a multiple of 8);
#: 4 measured faster at the 8B geometry (GQA 4: 0.26 against 0.29 ms at 128k; tools/results/attention-h200.json)
VALUE_COORDS = 4
#: copy each tile's code words to shared memory first (all of a thread's loads in flight at once) where
#: the kernel's shared memory then stays within SHARED_BYTES; False: never
STAGE_CODES = True
SHARED_BYTES = 44 * 1024

_lock = threading.Lock()
_kernels: dict = {}
_disabled: dict = {}  # dialect -> why the kernel was switched off
_verified: set = set()  # kernel builds (dialect, shapes, bits, dtype) that ran once


def sources(dialect: str, name: str = "attend") -> tuple[str, str]:
    """``(header, body)`` of the split kernel (``"attend"``) or the merge kernel (``"merge"``)."""
    prelude = fused.load_source("rvq_prelude_metal.h" if dialect == "metal" else "rvq_prelude_cuda.cuh")
    body = fused.load_source(f"rvq_attend_body_prelude_{dialect}.inc") + fused.load_source(
        "rvq_attend.inc" if name == "attend" else "rvq_attend_merge.inc")
    return prelude, body


def _kernel(dialect: str, name: str = "attend"):
    key = (dialect, name)
    k = _kernels.get(key)
    if k is None:
        header, body = sources(dialect, name)
        digest = hashlib.sha1((header + body).encode()).hexdigest()[:12]
        make = mx.fast.metal_kernel if dialect == "metal" else kernel_cache.cuda_kernel  # CUDA: kept on disk
        io = {"attend": (["q", "qsg", "ks", "k1", "k2", "vs", "v1", "v2", "tab", "cnt", "params"], ["o", "ml"]),
              "merge": (["o", "ml", "vsg", "params"], ["out"])}[name]
        k = _kernels[key] = make(name=f"rvq_attend_{name}_{digest}", input_names=io[0], output_names=io[1],
                                 source=body, header=header, ensure_row_contiguous=True)
    return k


_tables_alike: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _one_table(kc, vc) -> bool:
    """The kernel decodes keys and values with the key codec's table: equal bits are not enough (grids of
    other steps, or a file's tables, differ). Compared once per pair of codecs."""
    if kc is vc:
        return True
    got = _tables_alike.get(kc)
    if got is None or got[0]() is not vc:
        same = np.array_equal(kc.centroids1, vc.centroids1) and (
            kc.centroids2 is None or np.array_equal(kc.centroids2, vc.centroids2))
        got = _tables_alike[kc] = (weakref.ref(vc), same)
    return got[1]


def supported(view: CodesView, rows: int) -> str | None:
    """None if the kernel takes this call, else why not."""
    kc, vc = view.key_codec, view.value_codec
    if (kc.bits1, kc.bits2, kc.residual) != (vc.bits1, vc.bits2, vc.residual) or not _one_table(kc, vc):
        return "keys and values coded differently"
    if kc.bits1 not in (1, 2, 4) or kc.bits2 not in (0, 1, 2, 4):
        return "3-bit codes"
    if kc.dim % 4 or vc.dim % 4 or max(kc.dim, vc.dim) > MAX_DIM:
        return "head dim not a multiple of 4 or above 256"
    if rows > MAX_ROWS:
        return f"{rows} query rows per KV head (kernel takes {MAX_ROWS})"
    return None


def _served(view: CodesView, rows: int, dtype, dialect: str) -> tuple[bool, bool]:
    """``(served, tensor_cores)``: whether a kernel takes the call and whether it is the tensor-core one
    (:mod:`.kernel_mma`, CUDA: up to 16 rows), else the SIMT kernel (:func:`supported`)."""
    if supported(view, min(rows, MAX_ROWS)) is not None:
        return False, False
    if kernel_mma.takes(view, rows, dtype, dialect):
        return True, True
    return rows <= MAX_ROWS, False


def _pow2(d: int) -> bool:
    return d & (d - 1) == 0


def key_lanes(dk: int, rows: int, bits1: int, bits2: int, forced: int | None = None) -> tuple[int, int]:
    """``(lanes, step)`` of the key phase: threads per token and coordinates per word step.

    Each of ``lanes`` threads owns ``dk / lanes`` consecutive coordinates (a multiple of 4) and keeps
    their ``rows`` rotated queries in registers, at most :data:`KEY_REGISTERS` floats where the shape
    allows; fewer lanes mean fewer shuffles per token. ``step``: the largest power of two dividing the
    lane's coordinates and the coordinates per code word of both stages (a step never straddles a word).
    ``forced`` (1 or a power of two up to 32) is taken where it fits ``dk``; 1 is one thread per token.
    """
    per_word = min(32 // bits1, 32 // bits2 if bits2 else 32)
    fits = [kl for kl in (2, 4, 8, 16, 32) if dk % (4 * kl) == 0]
    if forced == 1 or not fits:
        return 1, 4
    if forced in fits:
        kl = forced
    else:
        kl = next((kl for kl in fits if rows * (dk // kl) <= KEY_REGISTERS), fits[-1])
    cpl = dk // kl
    step = 4
    while step * 2 <= per_word and cpl % (step * 2) == 0:
        step *= 2
    return kl, step


def uses_pairs(bits1: int, bits2: int, lanes: int) -> bool:
    """Whether the kernel decodes two coordinates per table read (a table of 256 pairs at 2+2)."""
    return bool(PAIR_TABLES) and lanes > 1 and bits1 + bits2 <= PAIR_MAX_BITS


def value_coords(dv: int) -> int:
    """Coordinates per thread in the value phase (T_VPL): :data:`VALUE_COORDS` where ``dv`` allows it."""
    return 8 if VALUE_COORDS == 8 and dv % 8 == 0 else 4


def shared_bytes(bits1: int, bits2: int, dk: int, dv: int, rows: int, tabn: int, lanes: int,
                 stage: bool) -> int:
    """The split kernel's shared memory (its RVQ_SHARED arrays) for one configuration."""
    words = lambda d, b: -(-d // (32 // b)) if b else 0  # noqa: E731 (code words per row)
    floats = tabn + rows * dk + THREADS * rows + rows * (THREADS // 32) + rows * dv
    pairs = (1 << (2 * (bits1 + bits2))) if uses_pairs(bits1, bits2, lanes) else 1
    staged = 2
    if stage:
        staged = THREADS * (words(dv, bits1) + words(dv, bits2))
        staged += THREADS * (words(dk, bits1) + words(dk, bits2)) if lanes > 1 else 1
    return 4 * floats + 8 * pairs + 4 * staged


def stages_codes(bits1: int, bits2: int, dk: int, dv: int, rows: int, tabn: int, lanes: int) -> bool:
    """Whether the kernel copies each tile's code words to shared memory first (T_STAGE)."""
    return bool(STAGE_CODES) and shared_bytes(bits1, bits2, dk, dv, rows, tabn, lanes, True) <= SHARED_BYTES


def _folded_signs(codec, factor: float) -> mx.array:
    """``signs * factor`` as float32 (cached per codec and factor: the softmax scale is fixed per layer)."""
    per = _signs_cache.setdefault(codec, {})
    t = per.get(factor)
    if t is None:
        t = per[factor] = mx.array((codec.signs.astype(np.float64) * factor).astype(np.float32))
    return t


_signs_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Launch:
    """Everything of one launch that stays the same from step to step (made once per configuration:
    a decode step then costs a dictionary lookup and the kernel call, not a dozen Python steps)."""

    __slots__ = ("params", "qsg", "tab", "two", "template", "grid", "shapes", "run")


_F32_2 = [mx.float32, mx.float32]
_launches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # key codec -> {config: _Launch}


def _launch_plan(view: CodesView, cap: int, bh: int, rows: int, dk: int, n_queries: int, causal: bool,
                 scale: float | None, dtype) -> _Launch:
    kc, vc = view.key_codec, view.value_codec
    per = _launches.get(kc)
    if per is None:
        per = _launches[kc] = {}
    key = (id(vc), cap, bh, rows, dk, n_queries, view.n_dense, causal, scale, dtype, KEY_LANES, PAIR_TABLES,
           STAGE_CODES, VALUE_COORDS, device_args.DEVICE_ARGS)
    p = per.get(key)
    if p is not None:
        return p
    chunk, splits = split_plan(cap, bh)
    tab, tabn = decode_table(kc)
    rot = scale is not None
    two = kc.bits2 > 0
    mode = fused.MODE_SINGLE if not two else (fused.MODE_CONDITIONAL if kc.residual == "conditional"
                                              else fused.MODE_SHARED)
    p = _Launch()
    p.params = _static((cap, chunk, splits, n_queries, view.n_dense, int(causal)))
    tab = device_args.moved(tab)
    p.qsg = device_args.moved(_folded_signs(kc, scale / dk)) if rot else tab
    p.tab, p.two = tab, two
    kl, kch = key_lanes(dk, rows, kc.bits1, kc.bits2, KEY_LANES)
    p.template = [("T_B1", kc.bits1), ("T_B2", kc.bits2), ("T_MODE", mode), ("T_DK", dk), ("T_DV", vc.dim),
                  ("T_R", rows), ("T_TG", THREADS), ("T_TABN", tabn), ("T_ROT", int(rot)), ("InT", dtype),
                  ("T_KL", kl), ("T_KCH", kch), ("T_PAIR", int(uses_pairs(kc.bits1, kc.bits2, kl))),
                  ("T_STAGE", int(stages_codes(kc.bits1, kc.bits2, dk, vc.dim, rows, tabn, kl))),
                  ("T_VPL", value_coords(vc.dim))]
    p.grid = (bh * splits * THREADS, 1, 1)
    p.shapes = [(bh, splits, rows, vc.dim), (bh, splits, rows, 2)]
    p.run = None  # the prepared launch (CUDA), made at the first call
    if len(per) > 64:
        per.clear()
    per[key] = p
    return p


_THREADGROUP = (THREADS, 1, 1)


def launch(view: CodesView, q: mx.array, n_queries: int, causal: bool, dialect: str, *,
           scale: float | None = None):
    """Run the split kernel: ``(o (BH, S, R, Dv), ml (BH, S, R, 2))``.

    ``q`` ``(B, Hkv, R, Dk)`` (or the same memory as ``(B, Hq, L, Dk)``): float32 rotated queries
    (``scale`` None), or the raw queries in their dtype with ``scale`` given, rotated inside the kernel
    (Dk a power of two).
    """
    b, h, l, dk = q.shape
    hkv = view.n_kv_heads
    ks, k1, k2 = view.key_buffers
    vs, v1, v2 = view.value_buffers
    p = _launch_plan(view, ks.shape[-1], b * hkv, h * l // hkv, dk, n_queries, causal, scale, q.dtype)
    if dialect == "metal":  # Metal reads the norms as their uint16 bits; CUDA reinterprets the bfloat16
        ks, vs = ks.view(mx.uint16), vs.view(mx.uint16)
    inputs = [q, p.qsg, ks, k1, k2 if p.two else k1, vs, v1, v2 if p.two else v1, p.tab, view.count_array(),
              p.params]
    if dialect == "metal":
        out = _kernel(dialect)(inputs=inputs, template=p.template, grid=p.grid, threadgroup=_THREADGROUP,
                               output_shapes=p.shapes, output_dtypes=_F32_2)
    else:
        if p.run is None:
            p.run = prepared(_kernel(dialect), p.template, inputs, _F32_2)
        out = p.run(inputs, p.shapes, p.grid, _THREADGROUP)
    return out[0], out[1]


def _bind_split(view: CodesView, q: mx.array, dialect: str, scale: float) -> tuple | None:
    """:func:`launch`'s CUDA launch of raw queries like ``q`` (one query per head, no causal mask) as
    ``(run, inputs, shapes, grid, threadgroup, 0, 9, None)``: the queries and the count left for the caller."""
    b, h, l, dk = q.shape
    ks, k1, k2 = view.key_buffers
    vs, v1, v2 = view.value_buffers
    p = _launch_plan(view, ks.shape[-1], b * view.n_kv_heads, h * l // view.n_kv_heads, dk, l, False, scale, q.dtype)
    if dialect != "cuda" or p.run is None:
        return None
    inputs = [None, p.qsg, ks, k1, k2 if p.two else k1, vs, v1, v2 if p.two else v1, p.tab, None, p.params]
    return p.run, inputs, p.shapes, p.grid, _THREADGROUP, 0, 9, None


_merges: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # value codec -> {config: arguments}
#: the merge kernel reads the splits' m and l side by side and un-rotates by shuffles below stride 32 (``T_QUICK`` in
#: kernels/rvq_attend_merge.inc; the same bits); off (variant ``slowmerge``): the first version, every thread reading
#: every split's m and l in turn and a barrier pair per butterfly stride. CUDA only: on Metal (where it is the same
#: body, never run on Apple hardware here) the first version serves until its bits are recorded there
QUICK_MERGE = True


def _merge_args(view: CodesView, o_shape: tuple, shape: tuple, dtype, dialect: str) -> list:
    vc = view.value_codec
    per = _merges.get(vc)
    if per is None:
        per = _merges[vc] = {}
    quick = QUICK_MERGE and dialect == "cuda"  # its bits recorded on CUDA only (no Metal machine has run it)
    key = (tuple(shape), tuple(o_shape), view.n_kv_heads, dtype, quick)
    args = per.get(key)
    if args is None:
        b, hq, l, dv = shape
        bh, splits, rows, _ = o_shape
        args = per[key] = [_folded_signs(vc, 1.0 / dv), _static((splits, hq // view.n_kv_heads, l)),
                           [("T_DV", dv), ("T_R", rows), ("T_QUICK", int(quick)), ("OutT", dtype)],
                           (bh * rows * dv, 1, 1), (dv, 1, 1),
                           [tuple(shape)], [dtype], None]
    return args


def merge(view: CodesView, o: mx.array, ml: mx.array, shape: tuple, dtype, dialect: str) -> mx.array:
    """The merge kernel: splits -> normalized, un-rotated output ``shape`` = (B, Hq, L, Dv) in ``dtype``."""
    args = _merge_args(view, o.shape, shape, dtype, dialect)
    inputs = [o, ml, args[0], args[1]]
    if dialect == "metal":
        return _kernel(dialect, "merge")(inputs=inputs, template=args[2], grid=args[3], threadgroup=args[4],
                                         output_shapes=args[5], output_dtypes=args[6])[0]
    if args[7] is None:  # the prepared launch, made at the first call
        args[7] = prepared(_kernel(dialect, "merge"), args[2], inputs, args[6])
    return args[7](inputs, args[5], args[3], args[4])[0]


def partials_reference(view: CodesView, q_rot: mx.array, n_queries: int, causal: bool, target: int | None = None,
                       block: int | None = None):
    """The kernel's outputs computed with MLX ops (same splits, same definitions; ``target``: the split
    plan's threadgroups, as the kernel modelled was launched with; ``block``: tokens dealt to the splits in
    turn in blocks of this size, as the tensor-core kernel does, instead of a contiguous chunk each)."""
    b, hkv, rows, dk = q_rot.shape
    n = view.n_coded
    chunk, splits = split_plan(int(view.key_buffers[0].shape[-1]), b * hkv, target)
    yk, sk = view.rotated_keys()
    yv, sv = view.rotated_values()
    tok = np.arange(n)
    if block:  # token t to split (t // block) % splits: slot i of the split-major order holds token tok[i]
        chunk = -(-n // (block * splits)) * block
        tok = np.arange(splits * chunk).reshape(-1, splits, block).transpose(1, 0, 2).reshape(-1)
        idx = mx.array(np.minimum(tok, max(n - 1, 0)))
        yk, sk, yv, sv = (mx.take(a, idx, axis=2) for a in (yk, sk, yv, sv))
    s = (q_rot @ yk.swapaxes(-1, -2)) * sk[:, :, None, :]  # (B, Hkv, R, slots)
    valid = mx.array(tok < n)[None, :]
    if causal:
        pos = view.n_total - n_queries + (mx.arange(rows) % n_queries)
        valid = valid & (mx.array(tok)[None, :] <= pos[:, None])
    s = mx.where(valid, s, -mx.inf)
    pad = splits * chunk - s.shape[-1]
    s = mx.pad(s, [(0, 0), (0, 0), (0, 0), (0, pad)], constant_values=-float("inf"))
    s = s.reshape(b * hkv, rows, splits, chunk).transpose(0, 2, 1, 3)  # (BH, S, R, chunk)
    m = s.max(axis=-1)
    e = mx.where(m[..., None] == -mx.inf, 0.0, mx.exp(s - m[..., None]))
    l = e.sum(axis=-1)
    wv = mx.pad(yv * sv[..., None], [(0, 0), (0, 0), (0, pad), (0, 0)])
    wv = wv.reshape(b * hkv, splits, chunk, -1)
    o = e @ wv
    return o, mx.stack([m, l], axis=-1)


def combine(view: CodesView, queries: mx.array, scale: float, o: mx.array, ml: mx.array, mask, sinks) -> mx.array:
    """Merge the splits with the window and sinks in one softmax; un-rotate once; normalize."""
    b, hq, l, dk = queries.shape
    hkv = view.n_kv_heads
    g = hq // hkv
    rows = g * l
    m = ml[..., 0].reshape(b, hkv, -1, rows)  # (B, Hkv, S, R)
    lsum = ml[..., 1].reshape(b, hkv, -1, rows)
    top = m.max(axis=2)  # (B, Hkv, R)
    sd = None
    if view.n_dense:
        qd = (queries.astype(mx.float32) * scale).reshape(b, hkv, rows, dk)
        sd = qd @ view.dense_keys.astype(mx.float32).swapaxes(-1, -2)  # (B, Hkv, R, W)
        if masks.is_causal(mask) and l > 1:
            pos = view.n_total - l + (mx.arange(rows) % l)
            sd = mx.where(view.n_coded + mx.arange(view.n_dense)[None, :] <= pos[:, None], sd, -mx.inf)
        top = mx.maximum(top, sd.max(axis=-1))
    sk = None
    if sinks is not None:
        sk = mx.repeat(sinks.astype(mx.float32).reshape(hkv, g), l, axis=1)[None]  # (1, Hkv, R)
        top = mx.maximum(top, sk)
    w = mx.where(m == -mx.inf, 0.0, mx.exp(m - top[:, :, None, :]))  # (B, Hkv, S, R)
    den = (w * lsum).sum(axis=2)
    o_rot = (w[..., None] * o.reshape(b, hkv, -1, rows, o.shape[-1])).sum(axis=2)  # (B, Hkv, R, Dv)
    out = ops.unrotate_output(view, o_rot)
    if sd is not None:
        ed = mx.exp(sd - top[..., None])
        den = den + ed.sum(axis=-1)
        out = out + ed @ view.dense_values.astype(mx.float32)
    if sk is not None:
        den = den + mx.exp(sk - top)
    out = out / den[..., None]
    return out.reshape(b, hq, l, -1).astype(queries.dtype)


_decisions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # key codec -> {call shape: decision}


def _decide(view: CodesView, rows: int, dtype, windowed: bool, with_sinks: bool, dialect: str):
    """``(fast, tensor_cores, one_launch, config)`` for calls of this shape, or None where the kernel does not take
    them (made once per configuration: a decode step repeats the same one 32 times per token). ``one_launch``: the
    tensor-core kernel with the merge fused into it serves the call (kernel_mma.FUSED_MERGE)."""
    per = _decisions.get(view.key_codec)
    if per is None:
        per = _decisions[view.key_codec] = {}
    key = (id(view.value_codec), rows, dtype, windowed, with_sinks, dialect, KEY_LANES, PAIR_TABLES, STAGE_CODES,
           VALUE_COORDS, kernel_mma.TENSOR_CORES, kernel_mma.FUSED_MERGE)
    d = per.get(key, _MISSING)
    if d is _MISSING:
        d = None
        served, mma = _served(view, rows, dtype, dialect)
        if served:
            dk, dv = view.key_codec.dim, view.value_codec.dim
            # fast path, two launches: raw queries rotated in the split kernel, splits merged and
            # un-rotated by the merge kernel; the window and sinks need the MLX-ops merge
            fast = _pow2(dk) and _pow2(dv) and dv >= 32 and not windowed and not with_sinks
            one = bool(mma and fast and kernel_mma.FUSED_MERGE)
            d = (fast, mma, one, (dialect, fast, mma, one, rows, dk, dv, view.key_codec.bits, view.key_codec.residual,
                                  dtype, KEY_LANES, PAIR_TABLES, STAGE_CODES, VALUE_COORDS))
        per[key] = d
    return d


_MISSING = object()


def attend(view: CodesView, queries: mx.array, scale: float, mask, sinks) -> mx.array | None:
    """Kernel attention, or None (no GPU backend, a call the kernel does not take, latched off)."""
    dialect = fused.gpu_backend()
    if dialect is None or dialect in _disabled or not fused._on_gpu():
        return None
    causal = False
    if mask is not None:
        if not masks.is_causal(mask):
            return None
        causal = True
    b, hq, l, dk = queries.shape
    rows = (hq // view.n_kv_heads) * l
    d = _decide(view, rows, queries.dtype, view.dense_keys is not None, sinks is not None, dialect)
    if d is None:
        return None
    fast, mma, one, config = d
    causal = causal and l > 1
    try:
        if one:  # tensor cores, one launch: rotate, split, merge, un-rotate
            vc = view.value_codec
            out = kernel_mma.launch_fused(view, queries, l, causal, scale, _folded_signs(vc, 1.0 / vc.dim))
        elif mma:  # tensor cores: raw queries rotated in the kernel; merged by the merge kernel or combine
            o, ml = kernel_mma.launch(view, queries, l, causal, scale)
            out = merge(view, o, ml, (b, hq, l, view.value_codec.dim), queries.dtype, dialect) if fast else None
        elif fast:  # the queries' (B, Hq, L, D) memory is the kernel's (B * Hkv, R, D): no reshape needed
            o, ml = launch(view, queries, l, causal, dialect, scale=scale)
            out = merge(view, o, ml, (b, hq, l, view.value_codec.dim), queries.dtype, dialect)
        else:
            q_rot = ops.rotate_queries(view, queries, scale).reshape(b, view.n_kv_heads, rows, dk)
            o, ml = launch(view, q_rot, l, causal, dialect)
            out = None
        if config not in _verified:  # first use of this build: failures surface here, where we can fall back
            mx.eval(o, ml) if out is None else mx.eval(out)
            with _lock:
                _verified.add(config)
    except Exception as err:  # a kernel that cannot build or run: latch off, say so once
        with _lock:
            _disabled[dialect] = f"{type(err).__name__}: {err}"
        log.warning("attention kernel (%s) switched off; using the MLX-ops formulation: %s", dialect, err)
        return None
    return out if out is not None else combine(view, queries, scale, o, ml, mask, sinks)


def settings() -> tuple:
    """The switches a call's decision and plans depend on (a bound call holds only while they stay)."""
    return (KEY_LANES, PAIR_TABLES, STAGE_CODES, VALUE_COORDS, kernel_mma.TENSOR_CORES, kernel_mma.FUSED_MERGE,
            kernel_mma.PROBE, kernel_mma.TARGET_GROUPS, kernel_mma.STRIDED, kernel_mma.SWAPPED,
            kernel_mma.BLOCKS_PER_SM, kernel_mma.QUICK_SPLIT, kernel_mma.LATE_NORMS, kernel_mma.QUICK_MAX,
            kernel_mma.BYTE_INDEX_42, kernel_mma.SHARED_ADDRESS, kernel_mma.TILE_PAIRS, QUICK_MERGE,
            device_args.DEVICE_ARGS, len(_disabled))


def two_tensor_core_launches(view: CodesView, queries: mx.array) -> bool:
    """Whether :func:`attend` serves single-query calls like this one (no mask, no sinks) with the tensor-core split
    kernel and the merge kernel, on CUDA (what :mod:`rvqstore.attention.fold` folds a step's append into)."""
    dialect = fused.gpu_backend()
    if dialect != "cuda" or dialect in _disabled or queries.shape[2] != 1:
        return False
    d = _decide(view, queries.shape[1] // view.n_kv_heads, queries.dtype, view.dense_keys is not None, False, dialect)
    return d is not None and d[0] and d[1] and not d[2] and d[3] in _verified


def bind(view: CodesView, queries: mx.array, scale: float) -> tuple | None:
    """What :func:`attend` hands MLX for single-query calls like this one (no mask, no sinks), for a caller
    that repeats it every decode step (:mod:`rvqstore.decode_step`): ``(split, merge)``, each ``(run,
    inputs, shapes, grid, threadgroup)``, the split's also where its inputs take the queries and the count,
    and what else it changes per launch (or None); the merge's take the split's two outputs first. Where
    the merge is fused into the split kernel (kernel_mma.FUSED_MERGE) ``merge`` is None and the output is
    the split's third. None where attend would not launch CUDA kernels alone for such calls, or has not
    run them yet."""
    dialect = fused.gpu_backend()
    b, hq, l, dk = queries.shape
    if dialect != "cuda" or dialect in _disabled or l != 1:
        return None
    d = _decide(view, hq // view.n_kv_heads, queries.dtype, view.dense_keys is not None, False, dialect)
    if d is None:
        return None
    fast, mma, one, config = d
    if not fast or config not in _verified:
        return None
    if one:  # one launch: split, merge and un-rotation
        vc = view.value_codec
        split = kernel_mma.bind_fused(view, queries, 1, False, scale, _folded_signs(vc, 1.0 / vc.dim))
        return None if split is None else (split, None)
    split = kernel_mma.bind(view, queries, 1, False, scale) if mma else _bind_split(view, queries, dialect, scale)
    if split is None:
        return None
    args = _merge_args(view, split[2][0], (b, hq, l, view.value_codec.dim), queries.dtype, dialect)
    if args[7] is None:
        return None
    return split, (args[7], [None, None, args[0], args[1]], args[5], args[3], args[4])


def disabled() -> dict:
    with _lock:
        return dict(_disabled)
