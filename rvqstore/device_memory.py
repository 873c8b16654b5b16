"""Arrays read from files on a CUDA device: copied into device memory as they arrive.

MLX's CUDA backend puts an array made from host memory (``mx.array`` of a numpy array, what a file's
sections become) in CUDA managed memory, resident on the host; the first kernel that reads it faults its
pages over to the GPU. For a resumed cache that is every code word at the first decode step: measured on
an H200 (tools/results/profile-resume-h200.json), the first step after loading 1.07 GB of 2+2 codes took
0.13-0.15 s instead of 0.013, and 0.19-0.21 s for 4+2's 1.6 GB. :func:`onto_device` gives the reader a
function that starts a copy of each array into device memory as soon as the array is read (one small
graph, evaluated asynchronously), so the transfers run while later sections are still being read and
decompressed, and the cache holds device arrays. Elsewhere (CPU, Metal's unified memory) it gives None.

Since :mod:`rvqstore.device_upload` a CUDA load takes its sections through a pinned ring instead (no managed
memory at all); these copies serve what the ring does not take (and loads with ``RVQSTORE_PINNED_MB=0``).
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from . import fused

_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def copy_bits(a: mx.array) -> mx.array:
    """A copy of ``a`` in new memory, bit for bit (NaN payloads kept: an integer op on its bits)."""
    bits = _BITS[a.dtype.size]
    if a.dtype == bits:
        return a | 0
    return (a.view(bits) | 0).view(a.dtype)


def _copy_now(a: mx.array) -> mx.array:
    if a.size == 0:
        return a
    c = copy_bits(a)
    mx.async_eval(c)
    return c


def onto_device() -> Callable[[mx.array], mx.array] | None:
    """A function that returns a device copy of an array it is given, started at once; None where arrays made
    from host memory need no copy (no CUDA device by default)."""
    if fused.gpu_backend() != "cuda" or not fused._on_gpu():
        return None
    return _copy_now
