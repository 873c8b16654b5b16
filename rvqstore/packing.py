"""Bit-packing of code indices into uint32 words, LSB-first.

Layout for ``bits`` per code: ``per = 32 // bits`` codes share a word; code ``j`` of a vector goes to
word ``j // per`` at bit offset ``(j % per) * bits``; a vector of ``dim`` codes takes
``ceil(dim / per)`` words and unused high bits (and unused trailing code slots) are zero.

Worked example (bits = 3, per = 10, dim = 12): codes ``[1,2,3,4,5,6,7,0,1,2, 3,4]`` give

    word 0 = 1 | 2<<3 | 3<<6 | 4<<9 | 5<<12 | 6<<15 | 7<<18 | 0<<21 | 1<<24 | 2<<27 = 0x111F58D1
    word 1 = 3 | 4<<3                                                       = 0x00000023

(bits 30–31 of word 0 and everything above bit 5 of word 1 are zero).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from .errors import CodecConfigError, InputShapeError


def codes_per_word(bits: int) -> int:
    _check_bits(bits)
    return 32 // bits


def words_per_vector(dim: int, bits: int) -> int:
    per = codes_per_word(bits)
    return -(-dim // per)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 4:
        raise CodecConfigError(f"bits must be an integer in 1..4, got {bits!r}")


@lru_cache(maxsize=None)
def _shifts(bits: int) -> mx.array:
    return mx.arange(32 // bits, dtype=mx.uint32) * bits


def pack_codes(idx: mx.array, bits: int) -> mx.array:
    """Pack integer codes ``idx`` of shape ``(..., dim)`` (each < 2**bits) into ``(..., words)`` uint32.

    Codes are masked to ``bits`` bits; callers guarantee they fit (the quantizers do).
    """
    per = codes_per_word(bits)
    if idx.ndim == 0:
        raise InputShapeError("pack_codes needs at least one axis of codes")
    dim = idx.shape[-1]
    words = -(-dim // per)
    x = idx.astype(mx.uint32) & ((1 << bits) - 1)
    pad = words * per - dim
    if pad:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    x = x.reshape(*idx.shape[:-1], words, per)
    # disjoint bit fields, so the sum is the bitwise OR
    return mx.sum(x << _shifts(bits), axis=-1).astype(mx.uint32)


def unpack_codes(words: mx.array, bits: int, dim: int) -> mx.array:
    """Inverse of :func:`pack_codes`: ``(..., words)`` uint32 -> ``(..., dim)`` uint8 codes."""
    per = codes_per_word(bits)
    need = -(-dim // per)
    if words.ndim == 0 or words.shape[-1] != need:
        raise InputShapeError(
            f"unpack_codes: {dim} codes of {bits} bits need {need} words per vector, got shape {tuple(words.shape)}")
    w = words.astype(mx.uint32)
    x = (w[..., None] >> _shifts(bits)) & ((1 << bits) - 1)
    x = x.reshape(*words.shape[:-1], need * per)
    if need * per != dim:
        x = x[..., :dim]
    return x.astype(mx.uint8)
