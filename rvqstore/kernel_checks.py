"""First-use checks of the fused RVQ kernels: boundary probes, bit-exact comparison with the reference.

The launch functions are passed in (``rvqstore.fused`` hands its own), so the checks run whatever the
dispatch runs. Also used by the GPU parity tests.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .kernel_plan import Plan


class CheckFailed(RuntimeError):
    """A kernel disagrees with the reference (kept as the machine's verdict: rvqstore.kernel_cache)."""

_SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 1.4e-45, -1.4e-45, 1.17549435e-38,
                     -1.17549435e-38, 3.4028235e38, -3.4028235e38, 1e30, -1e30, 1e-30, -1e-30, 100.0, -100.0],
                    dtype=np.float32)


def boundary_values(codec) -> np.ndarray:
    """float32 values on and next to every threshold the codec compares with, plus specials."""
    vals = [np.asarray(codec.boundaries1, np.float32), np.asarray(codec.centroids1, np.float32)]
    if codec.bits2:
        b2 = np.asarray(codec.boundaries2, np.float32)
        c2 = np.asarray(codec.centroids2, np.float32)
        vals += [b2.ravel(), c2.ravel()]
        if codec.residual == "shared":  # y whose residual lands on (or next to) a stage-2 boundary
            c1 = np.asarray(codec.centroids1, np.float32)
            vals.append((c1[:, None] + b2[0][None, :]).astype(np.float32).ravel())
    v = np.concatenate(vals).astype(np.float32)
    v = np.concatenate([v, np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf)), -v])
    return np.concatenate([v, _SPECIAL]).astype(np.float32)


def boundary_probe(codec, rows: int | None = None, seed: int = 0) -> np.ndarray:
    """``(rows, dim)`` float32: every boundary value at every coordinate position, mixed with N(0, 1)."""
    rng = np.random.default_rng(seed)
    v = boundary_values(codec)
    d = codec.dim
    rows = rows or max(4, -(-2 * v.size // d))
    flat = rng.standard_normal(rows * d).astype(np.float32)
    idx = rng.permutation(rows * d)
    k = min(v.size * 2, rows * d)
    flat[idx[:k]] = np.resize(v, k)
    return flat.reshape(rows, d)


def _same(a: mx.array, b: mx.array) -> bool:
    """Bit-identical (same shape and dtype; floats compared by their bits, so NaN == NaN)."""
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        if a.dtype != b.dtype:
            return False
        if a.dtype in (mx.bfloat16, mx.float16):  # NumPy has no bfloat16: compare the bits
            a, b = a.view(mx.uint16), b.view(mx.uint16)
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == np.float32:
        a, b = a.view(np.uint32), b.view(np.uint32)
    return bool(np.array_equal(a, b))


def check_encode(codec, plan: Plan, dialect: str, launch_encode) -> None:
    """Raise unless ``launch_encode`` matches the reference bit for bit on the boundary probe."""
    probe = mx.array(boundary_probe(codec))
    got = launch_encode(plan, probe, dialect)
    ref = codec._quantize_reference(probe)  # uncompiled: no JIT compile of the reference per configuration
    if not _same(got[0], ref[0]) or (ref[1] is not None and not _same(got[1], ref[1])):
        raise CheckFailed("encode kernel disagrees with the reference on the boundary probe")


def check_decode(codec, plan: Plan, dialect: str, launch_decode) -> None:
    """Raise unless ``launch_decode`` matches the reference bit for bit on random codes."""
    from .packing import pack_codes

    rng = np.random.default_rng(1)
    rows = max(8, -(-512 // codec.dim))
    c1 = pack_codes(mx.array(rng.integers(0, 1 << plan.bits1, (rows, codec.dim), dtype=np.uint8)), plan.bits1)
    c2 = None
    if plan.bits2:
        c2 = pack_codes(mx.array(rng.integers(0, 1 << plan.bits2, (rows, codec.dim), dtype=np.uint8)), plan.bits2)
    got = launch_decode(plan, c1, c2, dialect)
    ref = _reference_dequantize(codec, c1, c2)
    if not _same(got, ref):
        raise CheckFailed("decode kernel disagrees with the reference on random codes")


def _reference_dequantize(codec, codes1, codes2):
    """The codec's reference decode (uncompiled): stage 1 only, or ``_dequantize_reference``."""
    from .packing import unpack_codes

    if codes2 is None or not codec.bits2:
        return mx.take(codec._c1_mx, unpack_codes(codes1, codec.bits1, codec.dim).astype(mx.uint32))
    return codec._dequantize_reference(codes1, codes2)
