"""Small constant kernel arguments kept in the GPU's own memory on CUDA.

MLX's CUDA allocator (``mlx/backend/cuda/allocator.cpp``) puts an array made from host data in managed memory,
and every array of up to 8 bytes in one 64 KB managed pool that all of the process's scalars share, advised
"accessed by" the GPU: the host writes new scalars there all the time (a step's token, an offset), so those pages
live on the host and a kernel that reads a count or a parameter from them waits for a round trip over the host
link before its first tile. An array that a GPU operation writes, larger than 8 bytes, gets device memory
(``cudaMallocAsync``). :func:`constant` makes a kernel's small constant inputs that way: padded to
:data:`MIN_BYTES`, copied once by an MLX operation on the GPU and kept by the caller; the kernels read only the
leading elements, so the padding changes nothing they compute. Elsewhere (CPU, Metal) it is the host array.
"""

from __future__ import annotations

import mlx.core as mx

from . import fused

#: off: kernel arguments stay the arrays made from host data (the measurement's other arm, variant ``hostargs``)
DEVICE_ARGS = True
#: more than the allocator's scalar-pool block (8 bytes)
MIN_BYTES = 16


def wanted() -> bool:
    """Whether constants are copied into device memory here (CUDA, the GPU the default device)."""
    return DEVICE_ARGS and fused.gpu_backend() == "cuda" and fused._on_gpu()


def constant(values, dtype) -> mx.array:
    """``values`` as a 1-D array of ``dtype`` for a kernel's input; on CUDA in device memory, zero-padded to at
    least :data:`MIN_BYTES` (callers keep the array: it is made once per value)."""
    values = list(values)
    if not wanted():
        return mx.array(values, dtype=dtype)
    pad = max(0, -(-MIN_BYTES // dtype.size) - len(values))
    return moved(mx.array(values + [0] * pad, dtype=dtype))


_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def moved(a: mx.array) -> mx.array:
    """``a`` (a host-made array the kernels read at every launch) copied bit for bit into device memory on
    CUDA; ``a`` itself elsewhere, for arrays of up to 8 bytes (the scalar pool's) or inside a transformation."""
    if not wanted() or a.nbytes <= 8 or a.dtype.size not in _BITS:
        return a
    bits = _BITS[a.dtype.size]
    # an integer add of zero on the GPU: the output is device memory, and every bit pattern (-0.0, NaNs)
    # comes through (``a`` is held, so its buffer is not donated to the output)
    out = (a.view(bits) + mx.array(0, dtype=bits)).view(a.dtype)
    try:
        mx.eval(out)
    except Exception:  # inside a transformation, where nothing may be evaluated: the host array serves
        return a
    return out


def count_shape() -> tuple[int, ...]:
    """The shape of a token count a kernel writes for others to read (``[n]`` and padding on CUDA: a
    4-byte output would land in the scalar pool)."""
    return (max(1, -(-MIN_BYTES // 4)),) if wanted() else (1,)
