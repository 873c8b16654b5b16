"""What each evaluated method does to a key or value array, and what it costs in stored bits.

A :class:`Quantizer` reconstructs arrays ``(..., dim)`` of one side (keys or values) of one layer.
A :class:`Method` assigns a quantizer to every (layer, side) slot and may keep the first ``sink``
tokens of the context exact (float16), which is how bit allocation and sink tokens are expressed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Mapping

import mlx.core as mx

from rvqstore import RVQCodec

SIDES = ("k", "v")
Slot = tuple[int, str]  # (layer, "k" | "v")


@dataclass(frozen=True)
class Quantizer:
    name: str
    bits: float  # stored bits per coordinate: codes, scales/biases/norms and packing waste
    fn: Callable[[mx.array], mx.array] = field(compare=False, repr=False)
    # what a saved file holds (quality.disk_bits): RVQ stage bits, or affine (bits, group, rotated)
    rvq_bits: tuple[int, int] | None = None
    affine: tuple[int, int, bool] | None = None
    step: float | None = None  # RVQ on a uniform grid of this step (None: Lloyd–Max)


def float16() -> Quantizer:
    return Quantizer("float16", 16.0, lambda x: x.astype(mx.float16).astype(mx.float32))


@lru_cache(maxsize=None)
def rvq(bits: tuple[int, int], dim: int = 64, seed: int = 0) -> Quantizer:
    """The library's codec (conditional residual), exactly as RVQKVCache stores it."""
    codec = RVQCodec(dim, bits, seed)
    b1, b2 = codec.bits
    return Quantizer(f"{b1}+{b2}" if b2 else f"{b1}", codec.bits_per_coordinate,
                     lambda x: codec.decode(codec.encode(x, check_finite=False)), rvq_bits=(b1, b2))


@lru_cache(maxsize=None)
def grid(step: float, dim: int = 64, seed: int = 0, bits: tuple[int, int] | None = None) -> Quantizer:
    """The codec on a uniform grid of ``step`` (entropy-coded in files saved with ``compress="best"``),
    with the fewest levels that span the rotated coordinates (:func:`rvqstore.bit_allocation.grid_bits`)
    unless ``bits`` is given. ``bits`` of the Quantizer: the fixed width in memory."""
    from rvqstore.bit_allocation import grid_bits

    b = tuple(bits) if bits else grid_bits(step)
    codec = RVQCodec(dim, b, seed, step=step)
    return Quantizer(f"grid s{step:g}", codec.bits_per_coordinate,
                     lambda x: codec.decode(codec.encode(x, check_finite=False)), rvq_bits=codec.bits, step=step)


def rvq_error(bits: tuple[int, int], dim: int = 64) -> float:
    """The codec's predicted relative error on Gaussian data (no data needed)."""
    return RVQCodec(dim, bits).predicted_relative_error()


def _affine_bits(bits: int, group: int, dim: int) -> float:
    wq, s, b = mx.quantize(mx.zeros((1, dim), mx.float16), group_size=group, bits=bits)
    return (wq.nbytes + s.nbytes + b.nbytes) * 8 / dim


@lru_cache(maxsize=None)
def affine(bits: int, group: int, dim: int = 64) -> Quantizer:
    """mlx-lm's affine ``mx.quantize`` on the float16 cast (float16 scales and biases, as in a
    half-precision model's QuantizedKVCache)."""

    def fn(x):
        wq, s, b = mx.quantize(x.astype(mx.float16), group_size=group, bits=bits)
        return mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32)

    return Quantizer(f"affine {bits}b g{group}", _affine_bits(bits, group, dim), fn, affine=(bits, group, False))


@lru_cache(maxsize=None)
def rotated_affine(bits: int, group: int, dim: int = 64) -> Quantizer:
    """The baseline the issue names (llama.cpp's default, mlx-lm PR 1555): an orthonormal Hadamard
    transform of the head dim, then ``mx.quantize`` (float16 scales/biases), then the inverse
    transform (the orthonormal Sylvester Hadamard matrix is its own inverse)."""
    scale = 1.0 / math.sqrt(dim)

    def fn(x):
        y = mx.hadamard_transform(x, scale=scale).astype(mx.float16)
        wq, s, b = mx.quantize(y, group_size=group, bits=bits)
        y_hat = mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32)
        return mx.hadamard_transform(y_hat, scale=scale)

    return Quantizer(f"rot-affine {bits}b g{group}", _affine_bits(bits, group, dim), fn, affine=(bits, group, True))


@dataclass
class Method:
    """A quantizer per (layer, side) slot; the first ``sink`` tokens of the context stay float16.

    ``center_keys``: subtract a per-(layer, head) key mean before coding and add it back after
    (the mean of the first chunk the cache receives, sink tokens excluded, then fixed; stored as
    float16, 64 values per head, counted in the bits)."""

    name: str
    family: str  # plot series
    plan: Callable[[int, str], Quantizer] = field(repr=False)
    sink: int = 0
    center_keys: bool = False

    def bits(self, n_layers: int, n_tokens: int) -> float:
        """Stored bits per coordinate averaged over every slot (layers x sides are the same size)
        and over ``n_tokens`` tokens, the sink tokens counted at 16 bits."""
        per_slot = [self.plan(l, s).bits for l in range(n_layers) for s in SIDES]
        coded = sum(per_slot) / len(per_slot)
        k = min(self.sink, n_tokens)
        mean_bits = 16.0 / n_tokens / 2 if self.center_keys else 0.0  # one float16 vector per head, keys only
        return (k * 16.0 + (n_tokens - k) * coded) / n_tokens + mean_bits


def uniform(q: Quantizer, family: str, *, name: str | None = None, sink: int = 0) -> Method:
    return Method(name or q.name, family, lambda layer, side: q, sink=sink)


def per_side(k: Quantizer, v: Quantizer, family: str, *, sink: int = 0) -> Method:
    return Method(f"K {k.name} / V {v.name}", family, lambda layer, side: k if side == "k" else v, sink=sink)


def allocated(table: Mapping[Slot, tuple[int, int]], name: str, family: str, *, dim: int = 64,
              sink: int = 0) -> Method:
    """RVQ bits chosen per (layer, side) slot (:mod:`quality.allocate`)."""
    return Method(name, family, lambda layer, side: rvq(tuple(table[(layer, side)]), dim), sink=sink)


def grid_per_side(k_step: float, v_step: float, family: str, *, dim: int = 64) -> Method:
    """One grid step for every key, one for every value."""
    k, v = grid(k_step, dim), grid(v_step, dim)
    return Method(f"grid K s{k_step:g} / V s{v_step:g}", family, lambda layer, side: k if side == "k" else v)


def grid_allocated(steps: Mapping[Slot, float], name: str, family: str, *, dim: int = 64) -> Method:
    """A grid step per (layer, side) slot (:func:`rvqstore.bit_allocation.allocate_steps`)."""
    return Method(name, family, lambda layer, side: grid(steps[(layer, side)], dim))


def variant(base: Method, *, sink: int = 0, center_keys: bool = False) -> Method:
    tags = (["+mean K"] if center_keys else []) + ([f"+sink {sink}"] if sink else [])
    return Method(f"{base.name} {' '.join(tags)}", f"{base.family} {' '.join(tags)}", base.plan, sink=sink,
                  center_keys=center_keys)


def only(slot: Slot, q: Quantizer, name: str) -> Method:
    """``q`` on one slot, every other slot exact: a sensitivity probe."""
    exact = Quantizer("exact", 32.0, lambda x: x)
    return Method(name, "probe", lambda layer, side: q if (layer, side) == slot else exact)
