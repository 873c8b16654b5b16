"""The split kernel on tensor cores (CUDA, compute capability 8.0 and later): ``kernels/rvq_attend_mma.inc``.

It computes what the SIMT split kernel (:func:`rvqstore.attention.kernel.launch`) computes (the same splits, the same
``o``/``ml`` partials, so the same merge kernel and the same MLX-ops ``combine`` take them), but each
warp decodes the code words of 16 tokens at a time straight into fp16 ``mma.sync`` fragments and the
tensor cores do both products (scores and the value sum). The codes are read once per KV head for all
query rows of its GQA group, as before; the difference is the arithmetic: the SIMT kernel spends
``2 x rows`` fused multiply-adds per coordinate and token, which made it slower than SDPA on fp16
(docs/attention.md). Rounding: the rotated queries, the table values and ``p x value norm`` are fp16
operands (the reference decodes to fp16 too), sums are fp32.

Takes: fp16 queries, keys and values of one head dim (64 or 128) coded alike, ``dim x bits`` of each
stage a multiple of 128 (whole words per quarter of a row: 2+2, 4+2, 4+4, 2, 4 at 128; 2+2, 4+2, 4+4 at
64), up to 16 query rows per KV head. Other calls take the SIMT kernel (Metal always does).
"""

from __future__ import annotations

import hashlib
import math
import os
import weakref

import mlx.core as mx
import numpy as np

from .. import device_args, fused, kernel_cache
from .launch_args import THREADS, decode_table, prepared, split_plan, static_params
from .view import CodesView

#: route eligible CUDA calls here (False: the SIMT kernel serves them). On unless RVQSTORE_TENSOR_CORES=0: its
#: parity with decode-then-SDPA is recorded on the H200 (tools/results/gpu-parity-attention-mma.txt), and it
#: is the faster of the two from 32k tokens on (tools/results/attention-h200-mma.json)
TENSOR_CORES = os.environ.get("RVQSTORE_TENSOR_CORES", "1").strip() != "0"
#: timing probes only (tools/bench_attention.py --probes; wrong results): 1 = no global loads of the codes and
#: norms, 2 = no table reads (2+2), 3 = neither; 0 in every real call
PROBE = 0
MAX_ROWS = 16
DIMS = (64, 128)

_kernels: dict = {}
_LOG2E = 1.0 / math.log(2.0)


def sources() -> tuple[str, str]:
    header = fused.load_source("rvq_prelude_cuda.cuh") + fused.load_source("rvq_mma_cuda.cuh")
    body = fused.load_source("rvq_attend_body_prelude_cuda.inc") + fused.load_source("rvq_attend_mma.inc")
    return header, body


def _kernel(fused_merge: bool = False, fold: bool = False):
    """The split kernel (outputs ``o``, ``ml``) or, with ``fused_merge``, split and merge in one launch (also
    ``out``; inputs ``vsg`` and ``sem`` added: kernels/rvq_attend_mma.inc, RVQ_ATTEND_FUSED), or with ``fold`` the
    split kernel that appends the step's token first (inputs ``nk``, ``nv``, ``esg``, ``etab``, ``elim`` added,
    output ``done``: RVQ_ATTEND_FOLD, :mod:`rvqstore.attention.fold`)."""
    name = "mma_fused" if fused_merge else "mma_fold" if fold else "mma"
    if BLOCKS_PER_SM != 3:  # another register budget is another binary (launch bounds)
        name += f"_tg{BLOCKS_PER_SM}"
    k = _kernels.get(name)
    if k is None:
        header, body = sources()
        if fused_merge:
            header += "\n#define RVQ_ATTEND_FUSED 1\n"
        if fold:  # the append kernel's encode of one vector (the same bits)
            header += ("\n#define RVQ_ATTEND_FOLD 1\n" + fused.load_source("rvq_common.h")
                       + fused.load_source("rvq_encode_row_cuda.cuh"))
        digest = hashlib.sha1((header + body).encode()).hexdigest()[:12]
        k = _kernels[name] = kernel_cache.cuda_kernel(
            name=f"rvq_attend_{name}_{digest}",
            input_names=["q", "sg", "qf", "ks", "k1", "k2", "vs", "v1", "v2", "lut", "cnt", "params"]
            + (["vsg", "sem"] if fused_merge else []) + (["nk", "nv", "esg", "etab", "elim"] if fold else []),
            output_names=["o", "ml"] + (["out"] if fused_merge else []) + (["done"] if fold else []), source=body,
            header=header, ensure_row_contiguous=True, launch_bounds=f"{THREADS}, {BLOCKS_PER_SM}")
    return k


def takes(view: CodesView, rows: int, dtype, dialect: str) -> bool:
    """Whether this kernel serves the call (the SIMT kernel's own conditions are checked by the caller)."""
    if not TENSOR_CORES or dialect != "cuda" or dtype != mx.float16 or rows > MAX_ROWS:
        return False
    kc, vc = view.key_codec, view.value_codec
    d = kc.dim
    if vc.dim != d or d not in DIMS or (d * kc.bits1) % 128 or (kc.bits2 and (d * kc.bits2) % 128):
        return False
    return kc.bits1 in (1, 2, 4) and kc.bits2 in (0, 1, 2, 4) and kc.bits1 + kc.bits2 <= 8


def table(codec) -> np.ndarray:
    """The kernel's decode table (uint32 words of two fp16 halves, low first): ``y`` of the code pairs of two
    neighbouring coordinates where ``bits1 + bits2 <= 4`` (index: their stage-1 bits above their stage-2
    bits, the first coordinate's in the low bits of each), else of one coordinate, stored as ``(y, y)``.
    ``y`` as the decode kernel computes it (float32), rounded to fp16 to nearest even."""
    b1, b2 = codec.bits1, codec.bits2
    tab = np.array(decode_table(codec)[0], dtype=np.float32)
    c = np.arange(1 << (b1 + b2))
    i1, i2 = c >> b2, c & ((1 << b2) - 1)
    if not b2:
        y = tab[i1]
    elif codec.residual == "conditional":
        y = tab[(i1 << b2) | i2]
    else:
        y = (tab[i1] + tab[(1 << b1) + i2]).astype(np.float32)
    h = y.astype(np.float16).view(np.uint16).astype(np.uint32)
    if b1 + b2 > 4:
        return h | (h << 16)
    e = np.arange(1 << (2 * (b1 + b2)))
    n1, n2 = e >> (2 * b2), e & ((1 << (2 * b2)) - 1)
    first = ((n1 & ((1 << b1) - 1)) << b2) | (n2 & ((1 << b2) - 1))
    second = ((n1 >> b1) << b2) | (n2 >> b2)
    return h[first] | (h[second] << 16)


#: deal blocks of 64 tokens to the splits in turn (block b to split b % splits) instead of a contiguous chunk
#: per split: all threadgroups of a head then read neighbouring blocks at any moment
STRIDED = True
#: tokens per block dealt to a split (one 16-token tile per warp, 4 warps)
BLOCK = 64
#: up to 8 query rows per KV head: the rows are the mma's 8 columns, tokens and value dims its 16 rows (``SWAP`` in
#: kernels/rvq_attend_mma.inc): half the mma and none of the zero rows' register moves of the rows-first layout,
#: which serves 9-16 rows (and every call with RVQSTORE_MMA_SWAP=0)
SWAPPED = os.environ.get("RVQSTORE_MMA_SWAP", "1").strip() != "0"
#: the split kernel's setup issues its table and query loads at once and rotates the queries in registers (the same
#: bits), and up to 4 query rows its warps' partials merge in one round instead of four (each product rounded before
#: its sum; identical ``o`` in every case recorded on the H200, where a compiler could have fused the first version's
#: products into its sums); ``T_QUICK`` in kernels/rvq_attend_mma.inc. Off (variant
#: ``slowsplit``): the first versions (a loop turn per load, a barrier per butterfly stride, a barrier per warp),
#: kept for same-run comparisons
QUICK_SPLIT = True
#: the next tile's norms stay the loaded words until that tile is computed (``T_LATEN``): converted right after their
#: loads (off, variant ``earlynorms``: the first version) the warp waited for the whole prefetch at once, the largest
#: stall at 128k in CUPTI's PC sampling (``tools/pc_sample.py``, tools/results/pcsample-h200.json). The same bits
LATE_NORMS = True
#: a tile whose scores all stay at or below their rows' running maxima skips the maxima's shuffles (``T_QMAX``: one
#: warp vote instead; the same bits, since the new maximum is then the old one). The row maximum's chain was the
#: largest wait at 128k 2+2 after the setup's (tools/results/pcsample-h200-late.json). Measured and left off: the
#: same run's attention alone moved by -3 to +7 % at 1k-128k (tools/results/attention-h200-args.json, variant
#: ``fullmax`` = off); variant ``quickmax`` turns it on
QUICK_MAX = False
#: 4+2 at head dim 128 builds its table indices four at a time, by bytes (``T_I42``, ``rvq_idx42``: two byte permutes
#: and four mask-ors for 16 coordinates, instead of shifts and masks per coordinate); the same table reads, the same
#: bits (24 cases identical, tools/results/gpu-parity-idx42.txt). 128k 4+2 was bound by issuing its decode's
#: instructions (tools/results/pcsample-h200-late.json); with it the kernel is 328 instructions smaller and 4+2
#: attention alone 13-14 % faster at 128k, 6-9 % at 32k (attention-h200-idx42-*.json). Off: variant ``noidx42``
BYTE_INDEX_42 = True
#: 2+2's and byte-indexed 4+2's table reads by 32-bit shared address (``T_LDS``): 1, ``rvq_lut_off``: one
#: multiply-add per read makes this lane's entry's address, where through the generic pointer ptxas built it in three
#: (shift, or with the lane, shift-add): the tile loop 714 instructions against 842 at 2+2, 1,103 against 1,291 at 4+2
#: (local ``nvcc -arch=sm_90a``); 2 (4+2 at head dim 128 only; 2+2 as 1): 4+2's entries 256 bytes apart (16 KB instead
#: of 8), so one byte permute of the index word and the lane's byte is a read's whole offset: 974 instructions. The
#: same loads, the same bits. Variants ``lds1`` (1) and ``nolds`` (0). 3 (2+2 only; other bits as 2): 2+2's entries
#: 256 bytes apart as well, so a read's offset is one byte permute (the tile loop 653 instructions against 714, local
#: build): 64 KB of table, in dynamic shared memory (:func:`dynamic_shared_bytes`); variant ``lds3``
SHARED_ADDRESS = 2
#: the tile loop takes two tiles a turn (``T_PING``), its prefetch alternating between the two register sets instead
#: of moving the next tile's words into the current set every turn: 645 instructions a tile against 714 at 2+2, 988
#: against 1,103 at 4+2 (local build), 8 more registers at 2+2. The same order of tiles, the same bits. Off: at 128k it
#: was slower in three same-run comparisons (2+2 94.0 / 126.8 / 102.7 against 84.8 / 84.3 / 91.4 us, 4+2 134.4 / 120.0
#: / 125.2 against 122.7 / 114.3 / 119.9; tools/results/attention-h200-lds-*.json); variant ``pairs``
TILE_PAIRS = False


def _setting(name: str, allowed: range) -> int:
    """An integer setting from the environment; 0 (off) where it is unset, not a number or outside ``allowed``."""
    try:
        v = int(os.environ.get(name, "0") or 0)
    except ValueError:
        return 0
    return v if v in allowed else 0


#: a warp asks L2 for its tile this many turns ahead of the register prefetch's one (``T_L2PF``, one
#: ``prefetch.global.L2`` per 128-byte line of the tile's codes and norms; no registers held, nothing waits, the same
#: bits); 0: none. Off: 9-11 % slower at 128k on the H200 (tools/results/attention-h200-l2pf-*.json).
#: Variants ``l2pfN``; RVQSTORE_L2_PREFETCH=N
L2_PREFETCH = _setting("RVQSTORE_L2_PREFETCH", range(0, 17))
#: tiles in each thread's ring of shared-memory slots (``T_STAGES``): the split kernel copies a thread's words of the tile
#: ``STAGES - 1`` turns ahead into its own slot by ``cp.async`` and takes them into registers right before computing it,
#: so ``STAGES - 1`` tiles are in flight per warp with one register set; 0: the next tile loaded into a second register
#: set (one tile in flight). The same words, the same bits. Needs ``LATE_NORMS`` and not ``TILE_PAIRS`` (else 0).
#: Off: bit-identical at S = 2, 3, 4 but slower on the H100 (2+2 at 128k 88-98 us against 83; the tile loop is 800
#: instructions against 714, and the kernel is bound in the SMs, not by DRAM: docs/attention.md, "Tiles ahead of the
#: loop"). Variants ``stagesN``; RVQSTORE_STAGES=N (2 to 4: a deeper ring leaves room for fewer than three threadgroups
#: an SM)
STAGES = _setting("RVQSTORE_STAGES", range(0, 5))
#: threadgroups per SM the compiler budgets registers for (``__launch_bounds__``: at most 168 per thread)
BLOCKS_PER_SM = 3
#: threadgroups per launch the split plan aims at: BLOCKS_PER_SM per SM of an H200 (132 SMs), one wave
TARGET_GROUPS = 396


class _Launch:
    __slots__ = ("params", "sg", "qf", "lut", "two", "template", "smem", "grid", "shapes", "run", "fused", "folds")


def table_reads(bits1: int, bits2: int) -> int:
    """The ``T_LDS`` a configuration of these bits takes from :data:`SHARED_ADDRESS` (3 is 2+2's alone)."""
    return SHARED_ADDRESS if SHARED_ADDRESS < 3 or (bits1, bits2) == (2, 2) else 2


def template(bits1: int, bits2: int, d: int, rows: int, **values: int) -> list:
    """The split kernel's template arguments for codes of these bits and head dim and ``rows`` query rows per KV head,
    at this module's settings; ``values`` (by template name, e.g. ``T_STAGES=3``) replace settings, for tools that
    compile other configurations."""
    t = [("T_B1", bits1), ("T_B2", bits2), ("T_D", d), ("T_R", rows), ("T_STRIDE", int(STRIDED)),
         ("T_SWAP", int(SWAPPED)), ("T_QUICK", int(QUICK_SPLIT)), ("T_LATEN", int(LATE_NORMS)),
         ("T_QMAX", int(QUICK_MAX)), ("T_I42", int(BYTE_INDEX_42)), ("T_LDS", table_reads(bits1, bits2)),
         ("T_PING", int(TILE_PAIRS)), ("T_L2PF", int(L2_PREFETCH)), ("T_STAGES", int(STAGES)), ("T_PROBE", PROBE)]
    unknown = set(values) - {k for k, _ in t}
    if unknown:
        raise ValueError(f"not template arguments of the split kernel: {sorted(unknown)}")
    return [(k, int(values.get(k, v))) for k, v in t]


def stage_words(template: list) -> int:
    """The words of one warp's ring of ``T_STAGES`` tiles (kernels/rvq_attend_mma.inc, ``SLOT`` words per lane and
    tile); 0 where the kernel takes no ring (``T_STAGES`` below 2, ``T_LATEN`` 0 or ``T_PING`` 1)."""
    t = dict(template)
    stages = t.get("T_STAGES", 0)
    if stages < 2 or not t["T_LATEN"] or t["T_PING"]:
        return 0
    d, b1, b2 = t["T_D"], t["T_B1"], t["T_B2"]
    w1, w2 = d * b1 // 32, d * b2 // 32
    kwt = w1 // 4 + w2 // 4
    fb1, fb2 = d // 8 * b1, d // 8 * b2
    vwt = max(fb1 // 32, 1) + ((max(fb2 // 32, 1)) if b2 else 0)
    nn = 2 if t["T_SWAP"] and t["T_R"] <= 8 else 4
    return stages * 32 * (2 * kwt + 4 * vwt + 2 * (nn // 2))


#: what the split kernel's static shared arrays besides the table can take (the rotated queries, 16 x 128 floats; the
#: warps' maxima and sums; the folded append's or the fused merge's few KB)
STATIC_BOUND = 12 * 1024
#: MLX raises a kernel's shared memory limit to its dynamic request only above this many bytes
_MLX_LIFT = 48000


def table_bytes(template: list) -> int:
    """The decode table's shared memory (kernels/rvq_attend_mma.inc: NENT entries of LSLOTS uint4 slots)."""
    t = dict(template)
    b1, b2, d = t["T_B1"], t["T_B2"], t["T_D"]
    cb = b1 + b2
    nent = 1 << (2 * cb) if cb <= 4 else 1 << cb
    fast42 = t["T_I42"] and (b1, b2, d) == (4, 2, 128)
    dyn22 = (b1, b2) == (2, 2) and t["T_LDS"] == 3
    return nent * (16 if (fast42 and t["T_LDS"] >= 2) or dyn22 else 8) * 16


def dynamic_shared_bytes(template: list) -> int:
    """The dynamic shared memory a launch with ``template`` needs: none where the table is a static array; else the
    table (2+2's entries at 256 bytes with ``T_LDS`` 3, or any table beside a ring) and the four warps' rings of
    ``T_STAGES`` tiles (:func:`stage_words`). A request that with the static arrays could pass 48 KB while MLX would not
    lift the kernel's limit for it is raised just above MLX's threshold."""
    t = dict(template)
    ring = 4 * 4 * stage_words(template)
    if not ring and t["T_LDS"] != 3:  # T_LDS 3 is 2+2's alone (table_reads)
        return 0
    need = table_bytes(template) + ring
    return _MLX_LIFT + 16 if _MLX_LIFT - STATIC_BOUND < need <= _MLX_LIFT else need


_launches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # key codec -> {config: _Launch}
_tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _table_array(codec) -> mx.array:
    t = _tables.get(codec)
    if t is None:
        t = _tables[codec] = mx.array(table(codec))
    return t
_F32_2 = [mx.float32, mx.float32]
_THREADGROUP = (THREADS, 1, 1)


def _plan(view: CodesView, cap: int, bh: int, rows: int, n_queries: int, causal: bool, scale: float) -> _Launch:
    kc = view.key_codec
    per = _launches.get(kc)
    if per is None:
        per = _launches[kc] = {}
    key = (cap, bh, rows, n_queries, view.n_dense, causal, scale, PROBE, TARGET_GROUPS, STRIDED, SWAPPED,
           BLOCKS_PER_SM, QUICK_SPLIT, LATE_NORMS, QUICK_MAX, BYTE_INDEX_42, SHARED_ADDRESS,
           TILE_PAIRS, L2_PREFETCH, STAGES, device_args.DEVICE_ARGS)
    p = per.get(key)
    if p is not None:
        return p
    d = kc.dim
    chunk, splits = split_plan(cap, bh, TARGET_GROUPS)
    p = _Launch()
    p.params = static_params((cap, chunk, splits, n_queries, view.n_dense, int(causal)))
    p.sg = device_args.moved(mx.array((kc.signs.astype(np.float64) / math.sqrt(d)).astype(np.float32)))
    p.qf = device_args.constant([scale * _LOG2E / math.sqrt(d)], mx.float32)
    p.lut, p.two = device_args.moved(_table_array(kc)), kc.bits2 > 0
    p.template = template(kc.bits1, kc.bits2, d, rows)
    p.smem = dynamic_shared_bytes(p.template)
    p.grid = (bh * splits * THREADS, 1, 1)
    p.shapes = [(bh, splits, rows, d), (bh, splits, rows, 2)]
    p.run = None  # the prepared launch, made at the first call (when the inputs' dtypes are known)
    p.fused = None  # the same for the fused merge: (prepared launch, output shapes, output dtypes)
    p.folds = {}  # the same for the folded append, per keys' dtype
    if len(per) > 64:
        per.clear()
    per[key] = p
    return p


def _plan_for(view: CodesView, q: mx.array, n_queries: int, causal: bool, scale: float) -> _Launch:
    """The plan of a call with raw queries ``q`` ``(B, Hq, L, D)`` over ``view``'s buffers."""
    b, h, l, _ = q.shape
    return _plan(view, view.key_buffers[0].shape[-1], b * view.n_kv_heads, h * l // view.n_kv_heads, n_queries,
                 causal, scale)


def _split_inputs(p: _Launch, view: CodesView, q, count) -> list:
    """The split kernel's twelve inputs (a single-stage code passes its first stream again for the second)."""
    ks, k1, k2 = view.key_buffers
    vs, v1, v2 = view.value_buffers
    return [q, p.sg, p.qf, ks, k1, k2 if p.two else k1, vs, v1, v2 if p.two else v1, p.lut, count, p.params]


def launch(view: CodesView, q: mx.array, n_queries: int, causal: bool, scale: float):
    """``(o (BH, S, R, D), ml (BH, S, R, 2))`` for raw fp16 queries ``q`` ``(B, Hq, L, D)`` (their memory is
    ``(B * Hkv, R, D)``), rotated inside the kernel."""
    p = _plan_for(view, q, n_queries, causal, scale)
    inputs = _split_inputs(p, view, q, view.count_array())
    if p.run is None:
        p.run = prepared(_kernel(), p.template, inputs, _F32_2, p.smem)
    out = p.run(inputs, p.shapes, p.grid, _THREADGROUP)
    return out[0], out[1]


def bind(view: CodesView, q: mx.array, n_queries: int, causal: bool, scale: float) -> tuple | None:
    """What :func:`launch` hands MLX for calls like this one, for a caller that repeats it every step
    (:mod:`rvqstore.decode_step`): ``(run, inputs, shapes, grid, threadgroup, 0, 10, None)``: the queries
    (input 0) and the count (10) left for the caller. None before a launch prepared it."""
    p = _plan_for(view, q, n_queries, causal, scale)
    if p.run is None:
        return None
    return p.run, _split_inputs(p, view, None, None), p.shapes, p.grid, _THREADGROUP, 0, 10, None


#: serve fast-path calls (no window, no sinks) with one launch, the merge fused into the split kernel
#: (:func:`launch_fused`), instead of the split kernel and the merge kernel (two launches; the results agree up to
#: the order of one sum: tests/test_attention_mma_gpu.py). Off unless RVQSTORE_FUSED_MERGE=1: on the H200 it made
#: no measurable difference to a decode step in three same-run comparisons, the last with kernels launched by
#: reference (docs/attention.md, "The merge fused", "Launching kernels by reference")
FUSED_MERGE = os.environ.get("RVQSTORE_FUSED_MERGE", "0").strip() == "1"
#: slots in a ring of the fused merge's counters, per stream and heads count: a launch takes the next slot and
#: leaves it zeroed behind. Two launches that run at once must not share one; MLX runs the kernels of one CUDA
#: graph concurrently where no array orders them, and one stream's graphs one after another, and puts at most
#: MLX_MAX_OPS_PER_BUFFER (100 on an H100/H200) nodes in a graph: the ring is made at least 8 times that long.
RING_SLOTS = 1024
_rings: list = []  # [stream, bh, slots (list of [bh] uint32 arrays), next index]; MLX streams compare equal but
#                    hash apart, so they are looked up in a list (one entry or two in practice)


def _ring_size() -> int:
    try:
        ops = int(os.environ.get("MLX_MAX_OPS_PER_BUFFER", "100"))
    except ValueError:
        ops = 100
    return max(RING_SLOTS, 8 * ops)


def _sem_slot(bh: int) -> mx.array:
    """The next counter slot (``bh`` uint32, zero between launches) of this stream's ring."""
    stream = mx.default_stream(mx.default_device())
    for ring in _rings:
        if ring[1] == bh and ring[0] == stream:
            break
    else:
        n = _ring_size()
        pool = mx.zeros((n * bh,), dtype=mx.uint32)
        slots = [pool[i * bh:(i + 1) * bh] for i in range(n)]  # views of the pool: made once, evaluated once
        mx.eval(slots)
        ring = [stream, bh, slots, 0]
        _rings.append(ring)
    slots, i = ring[2], ring[3]
    ring[3] = i + 1 if i + 1 < len(slots) else 0
    return slots[i]


def launch_fused(view: CodesView, q: mx.array, n_queries: int, causal: bool, scale: float, vsg: mx.array):
    """The attention output ``(B, Hq, L, Dv)`` in ``q``'s dtype for raw fp16 queries ``q`` ``(B, Hq, L, D)``: the
    split kernel whose last threadgroup per head merges the splits and un-rotates (``vsg`` = value signs / Dv)."""
    b, h, l, d = q.shape
    bh = b * view.n_kv_heads
    p = _plan_for(view, q, n_queries, causal, scale)
    inputs = _split_inputs(p, view, q, view.count_array()) + [vsg, _sem_slot(bh)]
    f = p.fused
    if f is None:
        f = p.fused = (prepared(_kernel(True), p.template + [("OutT", q.dtype)], inputs, _F32_2 + [q.dtype], p.smem),
                       p.shapes + [(b, h, l, d)], _F32_2 + [q.dtype])
    return f[0](inputs, f[1], p.grid, _THREADGROUP)[2]


def bind_fused(view: CodesView, q: mx.array, n_queries: int, causal: bool, scale: float, vsg: mx.array):
    """:func:`launch_fused` as :func:`bind` gives :func:`launch`; its 8th entry fills in what changes per
    launch besides the queries and the count (the ring's next counter slot, input 13); the attention output is
    the launch's third output. None before a launch prepared it."""
    bh = q.shape[0] * view.n_kv_heads
    p = _plan_for(view, q, n_queries, causal, scale)
    f = p.fused
    if f is None:
        return None
    inputs = _split_inputs(p, view, None, None) + [vsg, None]

    def fill(args):
        args[13] = _sem_slot(bh)

    return f[0], inputs, f[1], p.grid, _THREADGROUP, 0, 10, fill


def _fold_entry(p: _Launch, encode: tuple, dtype, inputs: list) -> tuple:
    """The folded append's ``(prepared launch, output shapes)`` for this plan and keys' ``dtype`` (made once, from
    ``inputs``' dtypes)."""
    f = p.folds.get(dtype)
    if f is None:
        done = device_args.count_shape()
        dtypes = _F32_2 + [mx.uint32]
        template = p.template + encode[1] + [("T_DONE", done[0])]
        f = p.folds[dtype] = (prepared(_kernel(fold=True), template, inputs, dtypes, p.smem), p.shapes + [done])
    return f


def launch_fold(view: CodesView, q: mx.array, scale: float, keys: mx.array, values: mx.array, encode: tuple):
    """``(o, ml, done)`` for one raw fp16 query per head row of ``q`` ``(B, Hq, 1, D)`` over the view's tokens and the
    step's token ``keys``/``values`` ``(B, Hkv, 1, D)``, which the launch encodes and writes into the view's buffers at
    ``view.n_coded`` (room there, no checks; ``encode``: the append's ``(constants, template)``,
    :func:`rvqstore.cache_append.encode_args`); ``done`` ``[n + 1]`` orders later readers after the write."""
    p = _plan_for(view, q, 1, False, scale)
    inputs = _split_inputs(p, view, q, view.count_array()) + [keys, values, *encode[0]]
    run, shapes = _fold_entry(p, encode, keys.dtype, inputs)
    out = run(inputs, shapes, p.grid, _THREADGROUP)
    return out[0], out[1], out[2]


def bind_fold(view: CodesView, q: mx.array, scale: float, keys: mx.array, encode: tuple) -> tuple:
    """:func:`launch_fold` as :func:`bind` gives :func:`launch`: ``(run, inputs, shapes, grid, threadgroup)``, the
    queries (input 0), the count before the step (10), the step's keys and values (12, 13) left for the caller
    (``keys``: one like them, for the dtypes)."""
    p = _plan_for(view, q, 1, False, scale)
    run, shapes = _fold_entry(p, encode, keys.dtype,
                              _split_inputs(p, view, q, view.count_array()) + [keys, keys, *encode[0]])
    return run, _split_inputs(p, view, None, None) + [None, None, *encode[0]], shapes, p.grid, _THREADGROUP
