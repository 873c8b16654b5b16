"""The Walsh–Hadamard transform the codec rotates with, and its inverse.

Forward is exactly ``mx.hadamard_transform(x, scale=1.0)``, i.e. ``y = x @ M`` with
``M = kron(A_m, S_{2^k})`` for ``dim = m * 2^k``: ``S`` is the Sylvester matrix (S_1 = [1],
S_2n = [[S, S], [S, -S]]) and ``A_m`` is MLX's base matrix for m in {12, 20, 28} (listed below,
row by row, '+' = +1). ``M @ M.T = dim * I``. ``A_1`` and ``A_12`` are symmetric, so there the
inverse is the same transform; ``A_20`` and ``A_28`` are not, so the inverse applies ``A_m`` on the
left of the (m, 2^k) view after the Sylvester part: ``x = (y @ M.T) / dim``.

Dims with no Sylvester factor (``dim = m`` in {12, 20, 28}) never call ``mx.hadamard_transform``:
MLX's CUDA kernel does not compile for them, so every backend takes explicit signed sums there,
bit-identical to MLX's CPU transform (:func:`needs_explicit_route`).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import numpy as np

from .errors import CodecConfigError

BASE_MATRICES: dict[int, tuple[str, ...]] = {
    12: ('+-++++++++++', '--+-+-+-+-+-', '+++-++----++', '+---+--+-++-', '+++++-++----', '+-+---+--+-+',
         '++--+++-++--', '+--++---+--+', '++----+++-++', '+--+-++---+-', '++++----+++-', '+-+--+-++---'),
    20: ('+-----++++--++--+--+', '-+---+-+++---+++-+--', '--+--++-+++---+-+-+-', '---+-+++-+++-----+-+',
         '----+++++--++--+--+-', '+----+----+-++---++-', '-+----+----+-++---++', '--+----+--+-+-++---+',
         '---+----+-++-+-++---', '----+----+-++-+-++--', '++--+-+--++----+----', '+++--+-+---+----+---',
         '-+++--+-+---+----+--', '--+++--+-+---+----+-', '+--+++--+-----+----+', '+-++-++--+-+++++----',
         '-+-+++++--+-+++-+---', '+-+-+-+++-++-++--+--', '++-+---++++++-+---+-', '-++-++--++++++-----+'),
    28: ('+--------++++--+-++-+-++--++', '-+--------+++++-+-++-+-++--+', '--+----+---+++-+-+-++++-++--',
         '---+---++---+++-+-+-+-++-++-', '----+--+++---+++-+-+---++-++', '-----+-++++----++-+-++--++-+',
         '------+-++++--+-++-+-++--++-', '++----++------+--++---+-++-+', '+++-----+------+--++-+-+-++-',
         '-+++-----+------+--++-+-+-++', '--+++-----+---+--+--++-+-+-+', '---+++-----+--++--+--++-+-+-',
         '----+++-----+--++--+--++-+-+', '+----++------+--++--++-++-+-', '+-+--+--++--+++------++----+',
         '-+-+--++-++--+-+-----+++----', '+-+-+--++-++----+-----+++---', '-+-+-+--++-++----+-----+++--',
         '--+-+-+--++-++----+-----+++-', '+--+-+-+--++-+-----+-----+++', '-+--+-+++--++-------++----++',
         '+--++--+-+--+---++++-+------', '-+--++--+-+--+---++++-+-----', '--+--+++-+-+--+---+++--+----',
         '+--+--+-+-+-+-++---++---+---', '++--+----+-+-++++---+----+--', '-++--+-+--+-+-++++--------+-',
         '--++--+-+--+-+-++++--------+'),
}

MAX_DIM = 32768  # mx.hadamard_transform's own ceiling is higher; no attention head comes near this


def split_dim(dim: int) -> tuple[int, int] | None:
    """``(m, 2^k)`` with ``dim = m * 2^k`` and m in {1, 12, 20, 28}, or None if dim has no such form."""
    if not isinstance(dim, int) or dim < 2 or dim > MAX_DIM:
        return None
    for m in (1, 12, 20, 28):
        if dim % m == 0:
            p = dim // m
            if p & (p - 1) == 0:
                return m, p
    return None


def supported_dims_text() -> str:
    return f"m * 2^k with m in (1, 12, 20, 28), 2 <= dim <= {MAX_DIM} (e.g. 64, 80, 96, 112, 128, 160, 192, 256)"


def check_dim(dim: int) -> tuple[int, int]:
    parts = split_dim(dim)
    if parts is None:
        raise CodecConfigError(f"unsupported head dim {dim!r}: the Hadamard rotation needs {supported_dims_text()}")
    return parts


def base_matrix(m: int) -> np.ndarray:
    """A_m as float32 (A_1 = [[1]])."""
    if m == 1:
        return np.ones((1, 1), dtype=np.float32)
    return np.array([[1.0 if c == "+" else -1.0 for c in row] for row in BASE_MATRICES[m]], dtype=np.float32)


@lru_cache(maxsize=None)
def _base_matrix_mx(m: int) -> mx.array:
    return mx.array(base_matrix(m))


def needs_explicit_route(dim: int) -> bool:
    """True for dims with no power-of-two factor (12, 20, 28): MLX's CUDA Hadamard kernel is built
    for ``dim = m * n`` with a Sylvester size ``n >= 2`` and does not compile for ``n = 1`` (its
    radix-n kernel divides by log2(n) = 0, its radix-m kernel by n / read_width = 0). Those dims take
    :func:`_explicit_transform` on every backend, so all backends share one route and one result."""
    parts = split_dim(dim)
    return parts is not None and parts[1] == 1


def _explicit_transform(x: mx.array, scale: float, *, transpose: bool = False) -> mx.array:
    """``scale * (x @ A_m)`` (or ``x @ A_m.T``) for ``x`` of shape ``(..., m)``, as signed sums.

    Bit-identical to ``mx.hadamard_transform(x, scale)`` on MLX's CPU backend for float32 input: it
    accumulates ``out_j = sum_k A_m[k, j] * x_k`` in k order, then multiplies by ``scale``
    (``acc + x * (±1)`` rounds exactly as the CPU's ``acc ± x``). No matmul, so no backend-dependent
    summation order; m <= 28 terms, so the cost is negligible.
    """
    m = x.shape[-1]
    a = _base_matrix_mx(m).T if transpose else _base_matrix_mx(m)
    acc = x[..., 0:1] * a[0]
    for k in range(1, m):
        acc = acc + x[..., k:k + 1] * a[k]
    return acc * scale if scale != 1.0 else acc


def forward(x: mx.array) -> mx.array:
    """Unnormalized transform along the last axis: ``x @ M`` (entries of M are ±1)."""
    if needs_explicit_route(x.shape[-1]):
        return _explicit_transform(x, 1.0)
    return mx.hadamard_transform(x, scale=1.0)


def inverse(y: mx.array, scale: float = 1.0) -> mx.array:
    """``scale * (y @ M.T)``; with ``scale = 1/dim`` this undoes :func:`forward`."""
    dim = y.shape[-1]
    m, p = check_dim(dim)
    if p == 1 and m > 1:  # no Sylvester factor: the route every backend can run
        return _explicit_transform(y, scale, transpose=True)
    if m in (1, 12):  # symmetric: M.T == M
        return mx.hadamard_transform(y, scale=scale)
    z = y.reshape(*y.shape[:-1], m, p)
    if p > 1:
        z = mx.hadamard_transform(z, scale=1.0)
    z = _explicit_left(z)  # A_m applied on the left of the (m, p) view
    return (z * scale).reshape(y.shape)


def _explicit_left(z: mx.array) -> mx.array:
    """``A_m @ z`` for ``z`` of shape ``(..., m, p)``, as signed sums in k order. Not a matmul: MLX's
    CUDA backend runs float32 matmuls at TF32 precision (errors ~1e-3 relative, 4.6x the spec's decode
    tolerance on the H200), and each BLAS sums in its own order; m <= 28 terms cost next to nothing."""
    m = z.shape[-2]
    cols = _base_matrix_mx(m)[..., None]  # (m, m, 1): cols[:, k] is column k of A_m
    acc = cols[:, 0] * z[..., 0:1, :]
    for k in range(1, m):
        acc = acc + cols[:, k] * z[..., k:k + 1, :]
    return acc
