"""The Walsh–Hadamard transform the codec rotates with, and its inverse.

Forward is exactly ``mx.hadamard_transform(x, scale=1.0)``, i.e. ``y = x @ M`` with
``M = kron(A_m, S_{2^k})`` for ``dim = m * 2^k``: ``S`` is the Sylvester matrix (S_1 = [1],
S_2n = [[S, S], [S, -S]]) and ``A_m`` is MLX's base matrix for m in {12, 20, 28} (listed below,
row by row, '+' = +1). ``M @ M.T = dim * I``. ``A_1`` and ``A_12`` are symmetric, so there the
inverse is the same transform; ``A_20`` and ``A_28`` are not, so the inverse applies ``A_m`` on the
left of the (m, 2^k) view after the Sylvester part: ``x = (y @ M.T) / dim``.
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


def forward(x: mx.array) -> mx.array:
    """Unnormalized transform along the last axis: ``x @ M`` (entries of M are ±1)."""
    return mx.hadamard_transform(x, scale=1.0)


def inverse(y: mx.array, scale: float = 1.0) -> mx.array:
    """``scale * (y @ M.T)``; with ``scale = 1/dim`` this undoes :func:`forward`."""
    dim = y.shape[-1]
    m, p = check_dim(dim)
    if m in (1, 12):  # symmetric: M.T == M
        return mx.hadamard_transform(y, scale=scale)
    z = y.reshape(*y.shape[:-1], m, p)
    if p > 1:
        z = mx.hadamard_transform(z, scale=1.0)
    z = _base_matrix_mx(m) @ z  # A_m applied on the left of the (m, p) view
    return (z * scale).reshape(y.shape)
