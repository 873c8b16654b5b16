"""A decode step's append folded into the tensor-core split kernel (CUDA): one launch fewer per layer and step.

A bound packed step (:mod:`rvqstore.decode_step`) launches three kernels a layer: the append writes the token's
codes into the buffers in place, the split kernel reads them, the merge kernel combines its splits. On a fast GPU
the step is bound by the host, and every evaluated custom kernel node costs it ~24 us (docs/attention.md, "What a
custom kernel node costs the host"). With the fold the split kernel takes the step's keys and values as well
(``RVQ_ATTEND_FOLD`` in ``kernels/rvq_attend_mma.inc``): the threadgroup whose tiles hold the new token encodes it
with the append kernel's own device code (``kernels/rvq_encode_row_cuda.cuh``: the same bits), writes its codes and
norms into the buffers for later launches, keeps them in shared memory for its own tile, and the launch hands out the
count ``[n + 1]`` that orders every later reader after those writes (as the append's ``done`` did).

What ``update_and_fetch`` hands out stays as it was: the unpack of the codes, ordered after the append's launch, which
is built but not evaluated. A model whose attention call the hook serves never reads it, so that append never runs; a
model that reads it runs the append too, which writes the same bits into the same slot, and the unpack sees them.
Only what the fold changes is ordered by its count: the cache's next readers.

First use of each configuration, on copies of one layer's buffers: the append kernel then the split kernel against
the fold, with the same queries and a fixed token; their partials and every buffer must be equal bit for bit, else the
fold stays off for that configuration (logged once) and steps take the append launch as before.
Off by default (``RVQSTORE_FOLD=1`` switches it on): on the H200 it kept every bit and made no step measurably faster
(docs/attention.md, "The append folded into the split kernel").
"""

from __future__ import annotations

import os
import threading

import mlx.core as mx
import numpy as np

from .. import cache_append, first_use
from ..device_memory import copy_bits
from . import kernel, kernel_mma
from .view import CodesView

#: fold a bound decode step's append into its split kernel (False: the append's own launch). Off unless
#: RVQSTORE_FOLD=1: bit-identical on the H200 (tools/results/gpu-parity-fold.txt) but no faster there in three same-run
#: comparisons (docs/attention.md, "The append folded into the split kernel"); variant ``fold`` turns it on
FOLD = os.environ.get("RVQSTORE_FOLD", "0").strip() == "1"

_lock = threading.Lock()
_verified: set = set()
_disabled: dict = {}  # configuration -> why the fold is off for it


def _config(view: CodesView, queries: mx.array, dtype) -> tuple:
    c = view.key_codec
    return (c.dim, c.bits1, c.bits2, c.residual, c.seed, queries.shape[1] // view.n_kv_heads, str(queries.dtype),
            str(dtype), kernel.settings())


def _copies(buffers: tuple) -> tuple:
    return tuple(copy_bits(a) for a in buffers)


def _same(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b, equal_nan=True).item())


def _check_token(view: CodesView, dtype) -> tuple[mx.array, mx.array]:
    """A fixed token for the check, ``(B, Hkv, 1, D)`` keys and values of ``dtype`` (normal, one row of zeros)."""
    b, h = view.key_buffers[0].shape[:2]
    rng = np.random.default_rng(9)
    kv = rng.standard_normal((2, b, h, 1, view.key_codec.dim)).astype(np.float32)
    kv[1, 0, 0] = 0.0  # a zero value row: its norm is 0, its codes the zero row's
    return mx.array(kv[0]).astype(dtype), mx.array(kv[1]).astype(dtype)


def bind(view: CodesView, queries: mx.array, scale: float, dtype) -> tuple | None:
    """The fold for bound steps like this one (single-query calls of ``queries``' shape, one token of keys and values
    of ``dtype`` per head, into ``view``'s buffers): :func:`rvqstore.attention.kernel_mma.bind_fold`'s tuple once
    the configuration's first use passed, else None (then the step's append keeps its own launch)."""
    if not FOLD or view.dense_keys is not None or not kernel.two_tensor_core_launches(view, queries):
        return None
    codec = view.key_codec
    encode = cache_append.encode_args(codec, dtype)
    if encode is None or view.key_buffers[2] is None:
        return None
    config = _config(view, queries, dtype)
    if config in _disabled:
        return None
    k, v = _check_token(view, dtype)
    if config not in _verified:
        n, cap = view.n_coded, view.key_buffers[0].shape[-1]
        if n >= cap:  # no slot to check it in: a later step binds it
            return None
        count = view.count_array()
        mx.eval(count)  # a pending write finished before the copies read the buffers
        folded = (_copies(view.key_buffers), _copies(view.value_buffers))
        mx.eval(folded)
        fview = CodesView(codec, view.value_codec, view.n_kv_heads, n, *folded, None, None, count)

        def same_as_append_then_split(out):
            kb, vb = _copies(view.key_buffers), _copies(view.value_buffers)
            done = cache_append.launch_inplace(codec, k, v, kb, vb, count)
            ref = CodesView(codec, view.value_codec, view.n_kv_heads, n + 1, kb, vb, None, None, done)
            o, ml = kernel_mma.launch(ref, queries, 1, False, scale)
            mx.eval(out, o, ml, done)
            if int(out[2][0].item()) != n + 1:
                return "the count it hands out is not n + 1"
            if not all(_same(a, b) for a, b in zip((*kb, *vb), (*folded[0], *folded[1]))):
                return "the buffers it wrote differ from the append kernel's"
            if not (_same(out[0], o) and _same(out[1], ml)):
                return "its partials differ from the split kernel's after the append"
            return None

        if first_use.serve(config, lambda: kernel_mma.launch_fold(fview, queries, scale, k, v, encode),
                           same_as_append_then_split, verified=_verified, disabled=_disabled, lock=_lock,
                           what="append folded into the split kernel (the append's own launch instead)") is None:
            return None
    return kernel_mma.bind_fold(view, queries, scale, k, encode)


def disabled() -> dict:
    with _lock:
        return dict(_disabled)
