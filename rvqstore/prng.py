"""The portable sign generator behind the randomized Hadamard rotation.

NumPy only promises a seed's stream on one build, so the rotation's signs come from SplitMix64
(Steele, Lea & Flood 2014), which is eight lines of integer arithmetic any language can repeat:

    state = seed mod 2^64
    for i in 0 .. n-1:
        state = (state + 0x9E3779B97F4A7C15) mod 2^64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) mod 2^64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) mod 2^64
        z =   z ^ (z >> 31)
        sign[i] = -1 if (z >> 63) == 1 else +1

The name recorded in files for this procedure is :data:`PRNG_NAME`.
"""

from __future__ import annotations

import numpy as np

PRNG_NAME = "splitmix64-msb-sign"
_MASK64 = (1 << 64) - 1


def splitmix64(seed: int, n: int) -> list[int]:
    """The first ``n`` SplitMix64 outputs for ``seed`` (taken modulo 2^64)."""
    state = seed & _MASK64
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return out


def rotation_signs(seed: int, dim: int) -> np.ndarray:
    """The ±1 float32 sign vector of length ``dim`` for ``seed``: -1 where the output's top bit is set."""
    return np.array([-1.0 if (z >> 63) else 1.0 for z in splitmix64(seed, dim)], dtype=np.float32)


def signs_to_bits(signs: np.ndarray) -> bytes:
    """Pack a ±1 vector LSB-first into bytes, bit = 1 for a negative sign (the on-disk form)."""
    return np.packbits(np.asarray(signs) < 0, bitorder="little").tobytes()


def bits_to_signs(data: bytes, dim: int) -> np.ndarray:
    """Inverse of :func:`signs_to_bits`; ``data`` must hold exactly ceil(dim/8) bytes."""
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")[:dim]
    return np.where(bits == 1, -1.0, 1.0).astype(np.float32)
