"""What every launch of the attention kernels shares: the split plan (tokens per threadgroup) and the small
constant arrays a decode step passes again and again (kept, not rebuilt per call)."""

from __future__ import annotations

import weakref

import mlx.core as mx

from .. import device_args, fused

THREADS = 128
#: aim for this many threadgroups per launch (the H200 has 132 SMs)
TARGET_GROUPS = 528
_per_codec: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def decode_table(codec) -> tuple[mx.array, int]:
    """The decode kernel's table for ``codec`` (built once per codec)."""
    t = _per_codec.get(codec)
    if t is None:
        plan = fused.make_plan(codec, fused.DECODE)
        t = _per_codec[codec] = (plan.tab, plan.tabn)
    return t


_counts: list = []


def count_array(n: int) -> mx.array:
    """``[n]`` as a uint32 array: a slice of one arange made once (no new host array per step)."""
    if not _counts:
        _counts.append(mx.arange(0, 1 << 21, dtype=mx.uint32))
    # an arange is a GPU op's output: device memory on CUDA, where a host-made [n] would not be
    return _counts[0][n:n + 1] if n < (1 << 21) else device_args.constant([n], mx.uint32)


_shared: dict = {}  # n -> [n]


def shared_count(n: int) -> mx.array:
    """``[n]`` as a uint32 array, one per value for every layer and launch (a decode step's layers all hold the
    same count, and a step's unpack count is the next step's copy count): no slice built per launch."""
    a = _shared.get(n)
    if a is None:
        if len(_shared) > 256:
            _shared.clear()
        a = _shared[n] = count_array(n)
    return a


_params: dict = {}


def static_params(values: tuple) -> mx.array:
    """A small uint32 array of values that repeat from step to step (kept, not rebuilt per call; in device
    memory on CUDA: :mod:`rvqstore.device_args`)."""
    key = (values, device_args.DEVICE_ARGS)
    p = _params.get(key)
    if p is None:
        if len(_params) > 512:
            _params.clear()
        p = _params[key] = device_args.constant(values, mx.uint32)
    return p


def split_plan(n: int, bh: int, target: int | None = None) -> tuple[int, int]:
    """``(chunk, splits)`` for ``n`` token slots (the buffers' capacity: the plan, and so the launch,
    changes only when they grow): tokens per threadgroup (a multiple of THREADS) and how many splits,
    aiming at ``target`` threadgroups (default :data:`TARGET_GROUPS`)."""
    want = max(1, (TARGET_GROUPS if target is None else target) // max(1, bh))
    chunk = max(THREADS, -(-(-(-n // want)) // THREADS) * THREADS)
    return chunk, max(1, -(-n // chunk))


def prepared(kernel, template: list, inputs: list, out_dtypes: list, shared_memory: int = 0):
    """``kernel`` with its template and dtypes fixed (:meth:`rvqstore.kernel_cache.CudaKernel.prepare`: after its
    first launch a call goes straight to the precompiled binary), or None for MLX's own callables (Metal).
    ``shared_memory``: the launch's dynamic shared memory in bytes."""
    prepare = getattr(kernel, "prepare", None)
    return None if prepare is None else prepare(template, tuple(a.dtype for a in inputs), out_dtypes, shared_memory)
