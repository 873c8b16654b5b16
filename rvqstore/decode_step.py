"""The steady decode step of a packed ``RVQKVCache`` on CUDA: its launches bound once, then repeated.

On a fast GPU a decode step is host-bound, and a packed cache's step runs more Python than any other
cache: the update (checks, the mode, the fused append's first-use bookkeeping, the unpack's) and the
attention call (the view, the kernel's decision, the plans) go through some twenty-five calls per layer
to make four launches whose arguments hardly change from one token to the next: only the step's keys,
values and queries and the token count do. So once a cache has taken a single-token step through its
regular paths (every first-use check passed, every launch prepared), it *binds* them here
(:func:`bind_update`, :func:`bind_attention`): a later step of the same shapes and dtypes, into the same
buffers with room left, and the same settings, launches the same kernels with the same arguments at
once (:meth:`DecodeStep.update`, :meth:`DecodeStep.attend`), and changes the cache as the regular path
would. Anything else (a trim, buffers that grow, another shape or dtype, a mask array, sinks, the
device or a switch changed) returns None, the regular path serves the call, and binds again.

``tests/test_decode_step.py`` checks on any machine that a bound step hands MLX exactly what the
regular path hands it; ``tests/test_decode_step_gpu.py`` that they compute the same bits on CUDA.
``RVQSTORE_DECODE_STEP=0`` switches binding off (the regular paths then serve every step).

With the fold on (:mod:`rvqstore.attention.fold`, ``RVQSTORE_FOLD=1``; off by default: no faster on the H200) packed
steps go one launch further where the tensor-core split kernel serves their attention: the append is folded into
it. The update then builds the append's launch for what it hands out (the
unpack, never evaluated when the hook serves the call) and leaves the token *pending*; the attention call launches
the split kernel that encodes and writes the token itself, and the cache's count becomes that launch's. An attention
call the bound step refuses, or none at all, leaves the append's launch to write the token as before.
"""

from __future__ import annotations

import os
import weakref

import mlx.core as mx

from . import cache_append, cache_fetch, cache_modes, fused
from .attention import fold as attention_fold
from .attention import kernel as attention_kernel
from .attention.launch_args import shared_count

#: bind steady decode steps (False: every step takes the regular paths)
ENABLED = os.environ.get("RVQSTORE_DECODE_STEP", "1").strip() != "0"
#: how often steps were bound and served bound (tests and benchmarks read them)
stats = {"bound": 0, "updates": 0, "attends": 0, "folds": 0}


def plain_mask(mask) -> bool:
    """Whether a single-query call with ``mask`` is one a bound step serves (None, or mlx-lm's "causal")."""
    return mask is None or (type(mask) is str and mask == "causal")


class DecodeStep:
    """One cache's bound step: the in-place append (``update``), what the cache hands out after it (the mode's:
    :class:`PackedStep`, :class:`ResidentStep`), and for packed caches the attention kernels (``attend``)."""

    __slots__ = ("keys_stream", "kb", "vb", "cap", "shape", "dtype", "append",
                 "attention", "qshape", "qdtype", "scale", "settings", "fold", "pending")

    def __init__(self, cache, keys: mx.array, append: tuple):
        k, v = cache._keys, cache._values
        self.keys_stream = k
        self.kb = (k._scales, k._codes1, k._codes2)
        self.vb = (v._scales, v._codes1, v._codes2)
        self.cap = k._scales.shape[-1]
        self.shape, self.dtype = keys.shape, keys.dtype
        self.append = append
        self.attention = None  # (split, merge) once bind_attention ran for these buffers
        self.qshape = self.qdtype = self.scale = self.settings = None
        self.fold = None  # the split kernel with the append folded in (attention.fold), once bound
        self.pending = None  # (keys, values, count before, the append's done, count after) of a step the fold may write

    def _same_buffers(self, cache) -> bool:
        k, v = cache._keys, cache._values
        kb, vb = self.kb, self.vb
        return (k is self.keys_stream and k._scales is kb[0] and k._codes1 is kb[1] and k._codes2 is kb[2]
                and v._scales is vb[0] and v._codes1 is vb[1] and v._codes2 is vb[2] and not k._staged
                and not v._staged and cache._state is None and cache.use_kernels and not cache._steps_off)

    def _room(self, cache, m: int) -> bool:
        """Whether what the mode hands out has room for ``m`` tokens (the mode's class decides)."""
        return True

    def _hand_out(self, cache, outs: list, n: int) -> tuple:
        """``update_and_fetch``'s keys and values after the append wrote token ``n`` (``outs``: its outputs)."""
        raise NotImplementedError

    def update(self, cache, keys: mx.array, values: mx.array) -> tuple | None:
        """``update_and_fetch``'s result for a single-token step, or None (the regular path serves it)."""
        if (type(keys) is not mx.array or type(values) is not mx.array or keys.shape != self.shape
                or values.shape != self.shape or keys.dtype != self.dtype or values.dtype != self.dtype
                or not self._same_buffers(cache) or not cache_append.INPLACE or not fused._on_gpu()):
            return None
        k, v = cache._keys, cache._values
        n = k._n
        # as _Stream.inplace_ok: room, nothing handed out there
        if n == 0 or n < k._hw or n >= self.cap or not self._room(cache, n + 1):
            return None
        count = k._count
        run, inputs, shapes, grid, tg = self.append
        args = inputs.copy()
        args[0], args[1], args[7] = keys, values, shared_count(n) if count is None else count
        try:
            outs = run(args, shapes, grid, tg)
            kv = self._hand_out(cache, outs, n)
        except Exception:  # nothing that writes was kept: the regular path decides (and reports)
            cache._decode_step = None
            return None
        # what the mode's kernel_append and update_and_fetch record after the same launches
        done = outs[0]
        m = n + 1
        self.pending = (keys, values, args[7], done, m) if self.fold is not None and attention_fold.FOLD else None
        k._n, k._hw, k._count = m, m, done
        v._n += 1
        v._hw, v._count = v._n, done
        cache.offset += 1
        stats["updates"] += 1
        return kv

    def attend(self, cache, queries: mx.array, scale: float, mask, sinks) -> mx.array | None:
        """``attend_on_codes``'s result for a single-query call like the bound one, or None."""
        at = self.attention
        if (at is None or sinks is not None or not plain_mask(mask)
                or type(queries) is not mx.array or queries.shape != self.qshape or queries.dtype != self.qdtype
                or scale != self.scale or not self._same_buffers(cache) or not fused._on_gpu()
                or attention_kernel.settings() != self.settings):
            return None
        k = cache._keys
        n = k._n
        if n == 0:
            return None
        count = k._count
        split, merge = at
        pend, self.pending = self.pending, None
        folded = pend is not None and pend[3] is count and pend[4] == n  # nothing since the step left it pending
        if folded:  # the split kernel that writes the token itself, from the count before it
            run, inputs, shapes, grid, tg = self.fold
            args = inputs.copy()
            args[0], args[10], args[12], args[13] = queries, pend[2], pend[0], pend[1]
            fill = None
        else:
            run, inputs, shapes, grid, tg, qi, ci, fill = split
            args = inputs.copy()
            args[qi], args[ci] = queries, shared_count(n) if count is None else count
        try:
            if fill is not None:
                fill(args)
            outs = run(args, shapes, grid, tg)
            if folded:  # later readers of the buffers take the fold's count (the append is not evaluated)
                v = cache._values
                k._count = v._count = outs[2]
            if merge is None:  # the merge fused into the split kernel
                out = outs[2]
            else:
                mrun, minputs, mshapes, mgrid, mtg = merge
                margs = minputs.copy()
                margs[0], margs[1] = outs[0], outs[1]
                out = mrun(margs, mshapes, mgrid, mtg)[0]
        except Exception:
            if folded:  # the append's count again: its launch writes the token
                k._count = cache._values._count = count
            self.attention = self.fold = None
            return None
        stats["attends"] += 1
        stats["folds"] += folded
        return out


class PackedStep(DecodeStep):
    """A packed cache's step: hands out the unpack launch's decode (the hook never evaluates it)."""

    __slots__ = ("fetch", "dims")

    def __init__(self, cache, keys: mx.array, append: tuple, fetch: tuple):
        super().__init__(cache, keys, append)
        self.fetch = fetch
        b, h, _, d = keys.shape
        self.dims = (b, h, d, 2 * b * h * d)

    def _hand_out(self, cache, outs: list, n: int) -> tuple:
        frun, finputs, ftg = self.fetch
        b, h, d, per_token = self.dims
        m = n + 1
        fargs = finputs.copy()
        fargs[8] = outs[0]
        out = (b, h, m, d)
        kv = frun(fargs, [out, out], (per_token * m, 1, 1), ftg)
        cache._fetched = (weakref.ref(kv[0]), weakref.ref(kv[1]))  # as _handed_out: the hook serves it
        return kv[0], kv[1]


class ResidentStep(DecodeStep):
    """A resident cache's step: the launch's decoded token written into the copy with slice updates (as
    Resident.write does), and the copy handed out (attention runs on it: decode-then-SDPA)."""

    __slots__ = ()

    def _room(self, cache, m: int) -> bool:
        copy = cache._mode
        return copy.keys is not None and copy.keys.shape[2] >= m and copy.keys.dtype == self.dtype

    def _hand_out(self, cache, outs: list, n: int) -> tuple:
        copy = cache._mode
        m = n + 1
        copy.keys[:, :, n:m] = outs[1]
        copy.values[:, :, n:m] = outs[2]
        return copy.keys[:, :, :m], copy.values[:, :, :m]


def bind_update(cache, keys: mx.array, values: mx.array) -> None:
    """After a regular single-token update that wrote in place: bind its launches for the next steps."""
    k, v = cache._keys, cache._values
    kb, vb = (k._scales, k._codes1, k._codes2), (v._scales, v._codes1, v._codes2)
    step = cache._decode_step
    if step is not None and step._same_buffers(cache) and step.shape == keys.shape and step.dtype == keys.dtype:
        return  # bound already (the regular path served a step the bound one refused, e.g. past a trim)
    resident = isinstance(cache._mode, cache_modes.Resident)
    append = cache_append.bind_inplace(k.codec, keys, values, kb, vb, resident)
    if append is None:
        return
    if resident:
        cache._decode_step = ResidentStep(cache, keys, append)
    else:
        fetch = cache_fetch.bind(k.codec, kb, vb, cache.dtype)
        if fetch is None:
            return
        cache._decode_step = PackedStep(cache, keys, append, fetch)
    stats["bound"] += 1


def bind_attention(cache, view, queries: mx.array, scale: float) -> None:
    """After a regular attention call that the two CUDA kernels served: bind them for the next steps."""
    step = cache._decode_step
    if step is None or any(a is not b for a, b in zip(view.key_buffers + view.value_buffers, step.kb + step.vb)):
        return
    bound = attention_kernel.bind(view, queries, scale)
    if bound is None:
        return
    step.attention = bound
    step.fold = attention_fold.bind(view, queries, scale, step.dtype) if isinstance(step, PackedStep) else None
    step.qshape, step.qdtype, step.scale = queries.shape, queries.dtype, scale
    step.settings = attention_kernel.settings()
