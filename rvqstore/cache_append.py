"""Fused append: a cache step's new keys and values -> bfloat16 norms and packed codes, one GPU launch.

A decode step on a fast GPU is host-bound: every primitive of the step's graph costs host time to
build and launch, whatever its size. The codec's encode of one token per layer (concatenate keys and
values, the rotation's elementwise ops, norm, Hadamard transform, the quantize kernel, six slices)
is a dozen primitives; here it is one launch of ``kernels/rvq_append.inc`` with six outputs (key and
value norms, codes1, codes2), which the cache writes into its buffers.

The kernel follows the codec's reference steps in the same order (the Hadamard butterflies in the
order ``mx.hadamard_transform`` takes them, IEEE sqrt and division, bfloat16 rounding as MLX's
``astype``); only the order of the norm's sum of squares may differ from MLX's reduction, which can
move a norm by one float32 ulp and, rarely, its bfloat16 rounding. So the first use of each
configuration compares the kernel with the codec's encode on the same vectors and latches the kernel
off (logged once) unless the norms agree within one bfloat16 ulp and nearly every code word is equal;
a cache then takes its other paths. Either encoding is a valid one of the same codec.

Packed caches go further where their buffers have room: :func:`launch_inplace` writes the codes into
the buffers themselves (no slice updates, no copy; one primitive per layer and step). MLX does not know
the buffers changed, so the launch returns a count array that every later reader takes, and the cache
keeps positions anything was handed out for from being rewritten (rvqstore.cache._Stream).

CUDA only (the Metal dialect of this body is not written); head dims that are powers of two from 32
to 256; two-stage codes of 1, 2 or 4 bits per stage; keys and values of one dtype and codec.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading

import mlx.core as mx
import numpy as np

from . import device_args, first_use, fused, kernel_cache
from .attention.launch_args import shared_count
from .codec import EncodedVectors
from .device_memory import copy_bits
from .kernel_plan import DECODE, ENCODE, make_plan


_lock = threading.Lock()
_kernel_fns: dict = {}  # (resident, copy) -> kernel

#: packed caches write whole new buffers from the kernel (no slice updates) while they hold at most
#: this many tokens; above it the copy costs more GPU time than the six slice updates cost the host
COPY_MAX_TOKENS = 16384
_disabled: dict = {}  # configuration -> why the kernel is off for it
_verified: set = set()

#: packed caches write a step's codes into their buffers in place (launch_inplace) unless RVQSTORE_INPLACE=0
#: (then the copy append or slice updates: the same bytes)
INPLACE = os.environ.get("RVQSTORE_INPLACE", "1").strip() != "0"

#: first-use check: share of code words that must equal the codec's encode (norms may differ by one
#: bfloat16 ulp on a handful of vectors, which re-codes those vectors)
MIN_EQUAL_WORDS = 0.98


def supported(codec) -> str | None:
    """None if the kernel takes ``codec``, else why not."""
    d = codec.dim
    if d < 32 or d > 256 or d & (d - 1):
        return "head dim not a power of two in 32..256"
    if codec.bits1 not in (1, 2, 4) or codec.bits2 not in (1, 2, 4):
        return "not two-stage 1/2/4-bit codes"
    return None


#: what the in-place variant's body needs beside the prelude: its buffers come in as const inputs
_WRITABLE = "\ntemplate <typename T> __device__ inline T* rvq_writable(const T* p) { return const_cast<T*>(p); }\n"


def _kernel(resident: bool, copy: bool = False, inplace: bool = False):
    k = _kernel_fns.get((resident, copy, inplace))
    if k is None:
        prelude = fused.load_source("rvq_prelude_cuda.cuh")
        header = (prelude + ("\n#define RVQ_APPEND_RESIDENT 1" if resident else "")
                  + ("\n#define RVQ_APPEND_COPY 1" if copy else "")
                  + ("\n#define RVQ_APPEND_INPLACE 1" + _WRITABLE if inplace else "")
                  + "\n" + fused.load_source("rvq_common.h") + fused.load_source("rvq_encode_row_cuda.cuh"))
        body = fused.load_source("rvq_attend_body_prelude_cuda.inc") + fused.load_source("rvq_append.inc")
        digest = hashlib.sha1((header + body).encode()).hexdigest()[:12]
        variant = ("_res" if resident else "") + ("_copy" if copy else "") + ("_inplace" if inplace else "")
        k = _kernel_fns[(resident, copy, inplace)] = kernel_cache.cuda_kernel(  # compiled once per machine
            name=f"rvq_append{variant}_{digest}",
            input_names=["k", "v", "sg", "tab", "dtab", "lim", "params"]
            + (["cnt", "oks", "ok1", "ok2", "ovs", "ov1", "ov2"] if copy else [])
            + (["cnt", "bks", "bk1", "bk2", "bvs", "bv1", "bv2"] if inplace else []),
            output_names=(["done"] if inplace else ["ks", "k1", "k2", "vs", "v1", "v2"])
            + (["rk", "rv"] if resident else []),
            source=body, header=header, ensure_row_contiguous=True)
    return k


class _Setup:
    """What a launch for one codec needs, made once: the encode table, signs, limits, template, and per step
    shape the launch's arguments (:class:`_Call`), so that a decode step's launch is a lookup and a call."""

    def __init__(self, codec):
        plan = make_plan(codec, ENCODE)
        if isinstance(plan, str):
            raise ValueError(plan)
        self.plan = plan
        dplan = make_plan(codec, DECODE)
        if isinstance(dplan, str):
            raise ValueError(dplan)
        # the launch's tables and constants in device memory on CUDA (rvqstore.device_args)
        self.tab = device_args.moved(plan.tab)
        self.dtab = device_args.moved(dplan.tab)
        self.signs = device_args.moved(mx.array(np.asarray(codec.signs, np.float32)))
        self.limits: dict = {}  # dtype -> [max_scale] float32
        self.params: dict = {}  # rows -> [rows] uint32
        self.template = [("T_D", codec.dim), ("T_B1", plan.bits1), ("T_B2", plan.bits2), ("T_MODE", plan.mode),
                         ("T_SEARCH", plan.search), ("T_TABN", plan.tabn), ("T_DTABN", dplan.tabn)]
        self.configs: dict = {}  # (dtype, resident, extra) -> the configuration's key in _verified/_disabled
        self.calls: dict = {}  # (shape, dtype, value dtype, resident) -> _Call
        self.copies: dict = {}  # (shape, dtype, value dtype, old capacity, capacity) -> _Call
        self.config_base = (codec.dim, codec.bits1, codec.bits2, codec.residual, codec.seed)

    def config(self, dtype, resident: bool, *extra) -> tuple:
        key = (dtype, resident) + extra
        c = self.configs.get(key)
        if c is None:
            c = self.configs[key] = self.config_base + (str(dtype), resident) + extra
        return c

    def call(self, codec, keys: mx.array, values: mx.array, resident: bool) -> "_Call":
        """The launch's arguments for keys like ``keys`` (made once per shape and dtypes)."""
        shape, dtype = keys.shape, keys.dtype
        key = (shape, dtype, values.dtype, resident)
        c = self.calls.get(key)
        if c is None:
            lead = tuple(shape[:-1])
            rows = math.prod(lead)
            d, w1, w2 = codec.dim, codec.words1, codec.words2
            shapes = [lead, lead + (w1,), lead + (w2,), lead, lead + (w1,), lead + (w2,)]
            dtypes = list(_DTYPES)
            if resident:
                shapes, dtypes = shapes + [tuple(shape)] * 2, dtypes + [dtype, dtype]
            if len(self.calls) > 64:
                self.calls.clear()
            consts = [self.signs, self.tab, self.dtab, self.limit(codec, dtype), self.rows(rows)]
            c = self.calls[key] = _Call(_kernel(resident), self.template + [("InT", dtype)], [dtype, values.dtype],
                                        consts, shapes, dtypes, (2 * rows * d, 1, 1), (d, 1, 1))
        return c

    def copy_call(self, codec, keys: mx.array, values: mx.array, cap_old: int, cap: int) -> "_Call":
        """The copy launch's arguments but its token count (made once per shape, dtypes and capacities:
        they change when the buffers grow)."""
        shape = keys.shape
        key = (shape, keys.dtype, values.dtype, cap_old, cap)
        c = self.copies.get(key)
        if c is None:
            b, h, t, d = shape
            lead = (b, h, cap)
            w1, w2 = codec.words1, codec.words2
            if len(self.copies) > 64:
                self.copies.clear()
            consts = [self.signs, self.tab, self.dtab, self.limit(codec, keys.dtype),
                      self.copy_params(b * h * t, t, cap_old, cap)]
            c = self.copies[key] = _Call(
                _kernel(False, True), self.template + [("InT", keys.dtype)], [keys.dtype, values.dtype], consts,
                [lead, lead + (w1,), lead + (w2,), lead, lead + (w1,), lead + (w2,)], list(_DTYPES), None, (d, 1, 1))
        return c

    def inplace_call(self, codec, keys: mx.array, values: mx.array, cap: int, resident: bool = False) -> "_Call":
        """The in-place launch's arguments (made once per shape, dtypes, capacity and mode; ``resident``: the
        launch also hands out the new tokens decoded)."""
        shape = keys.shape
        key = (shape, keys.dtype, values.dtype, cap, "inplace", resident)
        c = self.copies.get(key)
        if c is None:
            b, h, t, d = shape
            if len(self.copies) > 64:
                self.copies.clear()
            consts = [self.signs, self.tab, self.dtab, self.limit(codec, keys.dtype),
                      self.copy_params(b * h * t, t, cap, cap)]
            done = device_args.count_shape()  # the count: readers take its [0], the kernel zeroes the rest
            shapes, dtypes = [done], [mx.uint32]
            if resident:
                shapes, dtypes = shapes + [tuple(shape)] * 2, dtypes + [keys.dtype] * 2
            c = self.copies[key] = _Call(_kernel(resident, False, True),
                                         self.template + [("InT", keys.dtype), ("T_DONE", done[0])],
                                         [keys.dtype, values.dtype], consts, shapes, dtypes,
                                         (2 * b * h * t * d, 1, 1), (d, 1, 1))
        return c

    def limit(self, codec, dtype) -> mx.array:
        a = self.limits.get(dtype)
        if a is None:
            a = self.limits[dtype] = device_args.constant([codec.max_scale(dtype)], mx.float32)
        return a

    def copy_params(self, *values: int) -> mx.array:
        a = self.params.get(values)
        if a is None:  # changes only when the buffers grow
            if len(self.params) > 64:
                self.params.clear()
            a = self.params[values] = device_args.constant(values, mx.uint32)
        return a

    def rows(self, n: int) -> mx.array:
        a = self.params.get(n)
        if a is None:
            if len(self.params) > 64:
                self.params.clear()
            a = self.params[n] = device_args.constant([n], mx.uint32)
        return a


class _Call:
    """One launch configuration's arguments that repeat from step to step: the kernel prepared for its
    template and dtypes (:meth:`rvqstore.kernel_cache.CudaKernel.prepare`, made at the first launch, when
    the inputs' dtypes are known), the constant inputs after keys and values, outputs, grid."""

    __slots__ = ("kernel", "template", "in_dtypes", "consts", "shapes", "dtypes", "grid", "threadgroup", "run")

    def __init__(self, kernel, template, in_dtypes, consts, shapes, dtypes, grid, threadgroup):
        self.kernel, self.template, self.consts = kernel, template, consts
        self.in_dtypes = in_dtypes  # of the inputs before the constants (keys, values)
        self.shapes, self.dtypes, self.grid, self.threadgroup = shapes, dtypes, grid, threadgroup
        self.run = None

    def __call__(self, inputs: list, grid: tuple | None = None, shapes: list | None = None) -> list:
        """The launch on ``inputs`` (``grid``/``shapes``: where they change from step to step)."""
        run = self.run
        if run is None:
            in_dtypes = tuple(self.in_dtypes) + tuple(a.dtype for a in inputs[len(self.in_dtypes):])
            prepare = getattr(self.kernel, "prepare", None)  # a kernel-cache kernel; else MLX's own callable
            if prepare is None:
                return self.kernel(inputs=inputs, template=self.template, grid=grid or self.grid,
                                   threadgroup=self.threadgroup, output_shapes=shapes or self.shapes,
                                   output_dtypes=self.dtypes)
            run = self.run = prepare(self.template, in_dtypes, self.dtypes)
        return run(inputs, shapes or self.shapes, grid or self.grid, self.threadgroup)


_MISSING = object()
_SETUP = "cache_append"  # this module's entry in codec.launch_setups


def _setup(codec) -> _Setup | None:
    """The codec's launch setup, or None where the kernel does not take the codec (decided once)."""
    key = (_SETUP, device_args.DEVICE_ARGS)  # its constants live where device_args put them
    s = codec.launch_setups.get(key, _MISSING)
    if s is _MISSING:
        try:
            s = _Setup(codec) if supported(codec) is None else None
        except ValueError:  # malformed tables: make_plan refused them
            s = None
        codec.launch_setups[key] = s
    return s


def _served(codec, keys: mx.array, values: mx.array) -> _Setup | None:
    """The setup where a launch can serve this step (a CUDA device, keys and values alike in shape and
    dtype, a codec the kernel takes), else None."""
    if fused.gpu_backend() != "cuda" or not fused._on_gpu():
        return None
    if values.dtype != keys.dtype or keys.shape != values.shape or keys.shape[-1] != codec.dim:
        return None
    return _setup(codec)


def serves_inplace(codec, keys: mx.array, values: mx.array) -> bool:
    """Whether :func:`append_inplace` can write this step (CUDA, the kernel takes the codec, in place on, its
    configuration not latched off); a caller may grow full buffers first so that it does."""
    s = _served(codec, keys, values) if INPLACE else None
    return s is not None and s.config(keys.dtype, True, "inplace") not in _disabled


_DTYPES = [mx.bfloat16, mx.uint32, mx.uint32, mx.bfloat16, mx.uint32, mx.uint32]


def encode_args(codec, dtype) -> tuple | None:
    """What another kernel that encodes a step's tokens as this one does needs (the split kernel with the append
    folded in, :mod:`rvqstore.attention.fold`): ``([signs, encode table, limit], [(name, value) of T_MODE, T_SEARCH,
    T_TABN])`` for keys of ``dtype``, or None where the kernel does not take ``codec`` or its in-place launch is off
    (``RVQSTORE_INPLACE=0``, or latched off for this dtype)."""
    s = _setup(codec) if INPLACE else None
    if s is None or s.config(dtype, False, "inplace") in _disabled:
        return None
    t = dict(s.template)
    return [s.signs, s.tab, s.limit(codec, dtype)], [(k, t[k]) for k in ("T_MODE", "T_SEARCH", "T_TABN")]


def launch(codec, keys: mx.array, values: mx.array, resident: bool = False) -> tuple:
    """The kernel's ``(ks, k1, k2, vs, v1, v2)`` for ``keys``/``values`` ``(B, H, T, D)`` (no checks);
    ``resident``: then also the decoded keys and values ``(B, H, T, D)`` in their dtype."""
    s = _setup(codec)
    if s is None:
        raise ValueError(f"the fused append does not take {codec!r}: {supported(codec)}")
    c = s.call(codec, keys, values, resident)
    return tuple(c([keys, values, *c.consts]))


def launch_copy(codec, keys: mx.array, values: mx.array, key_buffers: tuple, value_buffers: tuple, n: int,
                cap: int, count: mx.array | None = None) -> tuple:
    """The kernel's whole new buffers ``(ks, k1, k2, vs, v1, v2)`` of ``cap`` tokens: the old buffers'
    first ``n`` tokens, then the new ones (no checks; ``count``: ``[n]``, default a shared one)."""
    s = _setup(codec)
    if s is None:
        raise ValueError(f"the fused append does not take {codec!r}: {supported(codec)}")
    c = s.copy_call(codec, keys, values, key_buffers[0].shape[-1], cap)
    b, h, t, d = keys.shape
    side = b * h * n * (codec.words1 + codec.words2 + 1)
    groups = 2 * b * h * t + -(-2 * side // d)
    cnt = shared_count(n) if count is None else count
    return tuple(c([keys, values, *c.consts, cnt, *key_buffers, *value_buffers], (groups * d, 1, 1)))


def launch_inplace(codec, keys: mx.array, values: mx.array, key_buffers: tuple, value_buffers: tuple,
                   count: mx.array, resident: bool = False):
    """Write the new tokens' codes into the buffers (capacity enough for them, no checks) at the position
    ``count`` ``[n]`` holds; returns ``done`` ``[n + t]``: the array every later reader of the buffers must
    take as its token count, which is what orders it after these writes (MLX sees none). ``resident``:
    returns ``(done, keys, values)``, the new tokens decoded (as :func:`launch`'s last two outputs)."""
    s = _setup(codec)
    if s is None:
        raise ValueError(f"the fused append does not take {codec!r}: {supported(codec)}")
    c = s.inplace_call(codec, keys, values, key_buffers[0].shape[-1], resident)
    out = c([keys, values, *c.consts, count, *key_buffers, *value_buffers])
    return tuple(out) if resident else out[0]


def bind_inplace(codec, keys: mx.array, values: mx.array, key_buffers: tuple, value_buffers: tuple,
                 resident: bool = False):
    """What :func:`launch_inplace` hands MLX for steps like this one, for a caller that repeats it
    (:mod:`rvqstore.decode_step`): ``(run, inputs, shapes, grid, threadgroup)``, the launch being
    ``run(inputs, shapes, grid, threadgroup)`` once the caller put in the step's keys, values and count
    (inputs 0, 1 and 7). None until this configuration's first use passed and a launch prepared it."""
    s = _setup(codec)
    if s is None or not INPLACE or s.config(keys.dtype, resident, "inplace") not in _verified:
        return None
    c = s.inplace_call(codec, keys, values, key_buffers[0].shape[-1], resident)
    if c.run is None:
        return None
    return c.run, [None, None, *c.consts, None, *key_buffers, *value_buffers], c.shapes, c.grid, c.threadgroup


def append_inplace(codec, keys: mx.array, values: mx.array, key_buffers: tuple, value_buffers: tuple, n: int,
                   count: mx.array | None = None, resident: bool = False):
    """:func:`launch_inplace` where the kernel serves the call, else None (nothing written). Its first use
    writes into copies of the buffers and is compared with :func:`launch` (the rows written, nothing else
    changed, and for ``resident`` the decoded rows) before it writes into the real ones."""
    s = _served(codec, keys, values) if INPLACE else None
    if s is None or key_buffers[2] is None:
        return None
    count = shared_count(n) if count is None else count
    config = s.config(keys.dtype, resident, "inplace")
    if config not in _verified:
        mx.eval(count)  # a pending write finished before the copies read the buffers
        kb, vb = tuple(copy_bits(a) for a in key_buffers), tuple(copy_bits(a) for a in value_buffers)
        before = (*key_buffers, *value_buffers)  # the check writes into the copies only
        mx.eval(kb, vb)
        t = keys.shape[2]

        def same_as_append(out):
            done, decoded = (out[0], out[1:]) if resident else (out, ())
            want = launch(codec, keys, values, resident)
            mx.eval(out, want)
            if int(done[0].item()) != n + t:
                return "the count it hands out is not n + t"
            for got, old, new in zip((*kb, *vb), before, want):
                if not (bool(mx.array_equal(got[:, :, n:n + t], new, equal_nan=True).item())
                        and bool(mx.array_equal(got[:, :, :n], old[:, :, :n], equal_nan=True).item())
                        and bool(mx.array_equal(got[:, :, n + t:], old[:, :, n + t:], equal_nan=True).item())):
                    return "the buffers it wrote differ from the append kernel's codes written with slice updates"
            if not all(bool(mx.array_equal(a, b, equal_nan=True).item()) for a, b in zip(decoded, want[6:])):
                return "the decoded rows it hands out differ from the append kernel's"
            return check(codec, keys, values, want)

        if first_use.serve(config, lambda: launch_inplace(codec, keys, values, kb, vb, count, resident),
                           same_as_append, verified=_verified, disabled=_disabled, lock=_lock,
                           what="fused append (in place; slice updates instead)") is None:
            return None
    if config in _disabled:
        return None
    try:
        return launch_inplace(codec, keys, values, key_buffers, value_buffers, count, resident)
    except Exception:  # nothing was built that writes: the caller takes its other paths
        return None


def append_copy(codec, keys: mx.array, values: mx.array, key_buffers: tuple, value_buffers: tuple, n: int,
                cap: int, count: mx.array | None = None, renew: bool = False) -> tuple | None:
    """:func:`launch_copy` where the kernel serves the call, else None (then append() and slice
    updates). Its first use (and its first use growing the buffers) is compared with that path.
    ``count``: the ``[n]`` array readers of the buffers take (an in-place write's ``done``), if any.
    Up to ``COPY_MAX_TOKENS`` tokens; at any size when the buffers grow (they are copied then anyway)
    or with ``renew`` (the caller wants buffers it may write in place again, e.g. after a trim)."""
    old_cap = key_buffers[0].shape[-1]
    big = cap > COPY_MAX_TOKENS and cap == old_cap and not renew
    s = None if n == 0 or big else _served(codec, keys, values)
    if s is None:
        return None
    config = s.config(keys.dtype, False, "copy", cap != old_cap)
    if config in _verified and config not in _disabled:  # checked: launch (a failure goes through serve)
        try:
            return launch_copy(codec, keys, values, key_buffers, value_buffers, n, cap, count)
        except Exception:
            pass
    if count is not None:  # the first use reads the buffers with MLX ops too: the writes must be done
        mx.eval(count)

    def same_as_slice_updates(out):
        want = launch(codec, keys, values)
        t = keys.shape[2]
        mx.eval(out, want)
        for got, old, new in zip(out, (*key_buffers, *value_buffers), want):
            if not (bool(mx.array_equal(got[:, :, :n], old[:, :, :n], equal_nan=True).item())
                    and bool(mx.array_equal(got[:, :, n:n + t], new, equal_nan=True).item())):
                return "the copied buffers differ from slice updates"
        return None

    return first_use.serve(config, lambda: launch_copy(codec, keys, values, key_buffers, value_buffers, n, cap, count),
                           same_as_slice_updates, verified=_verified, disabled=_disabled, lock=_lock,
                           what="fused append (copy; slice updates instead)")


def check(codec, keys: mx.array, values: mx.array, out: tuple) -> str | None:
    """None if the kernel's ``out`` agrees with the codec's encode of the same vectors, else why not."""
    b = keys.shape[0]
    ref = codec.encode(mx.concatenate([keys, values], axis=0), check_finite=False)
    want = [ref.scales[:b], ref.codes1[:b], ref.codes2[:b], ref.scales[b:], ref.codes1[b:], ref.codes2[b:]]
    for side, got, exp in (("keys", out[:3], want[:3]), ("values", out[3:], want[3:])):
        gn, en = np.array(mx.isnan(got[0])), np.array(mx.isnan(exp[0]))
        gs = np.array(got[0].view(mx.uint16)).astype(np.int64)
        es = np.array(exp[0].view(mx.uint16)).astype(np.int64)
        if not np.array_equal(gn, en) or np.abs(gs - es)[~en].max(initial=0) > 1:
            return f"{side}: norms differ by more than one bfloat16 ulp"
        words = [np.array(g) == np.array(e) for g, e in zip(got[1:], exp[1:])]
        share = sum(w.sum() for w in words) / max(1, sum(w.size for w in words))
        if share < MIN_EQUAL_WORDS:
            return f"{side}: only {share:.1%} of the code words equal the codec's encode"
    if len(out) == 8:  # resident: the decoded copies must be the codec's decode of these very codes
        for side, codes, dec in (("keys", out[:3], out[6]), ("values", out[3:6], out[7])):
            want = codec.decode(EncodedVectors(*codes, keys.dtype))
            if not bool(mx.array_equal(dec, want, equal_nan=True).item()):
                return f"{side}: the decoded copy differs from the codec's decode of its codes"
    return None


def append(codec, keys: mx.array, values: mx.array, resident: bool = False) -> tuple | None:
    """``(ks, k1, k2, vs, v1, v2)`` of the new tokens from one launch (``resident``: and their decoded
    keys and values), or None where the kernel does not serve the call (no CUDA device, a
    configuration it does not take, latched off)."""
    s = _served(codec, keys, values)
    if s is None:
        return None
    config = s.config(keys.dtype, resident)
    if config in _verified and config not in _disabled:  # checked: launch (a failure goes through serve)
        try:
            return launch(codec, keys, values, resident)
        except Exception:
            pass

    def same_as_encode(out):  # first use: build, run, compare with the codec's encode
        mx.eval(out)
        return check(codec, keys, values, out)

    return first_use.serve(config, lambda: launch(codec, keys, values, resident), same_as_encode,
                           verified=_verified, disabled=_disabled, lock=_lock,
                           what="fused append kernel (the codec's encode instead)")


def disabled() -> dict:
    with _lock:
        return dict(_disabled)
