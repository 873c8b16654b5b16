"""TurboQuant-RVQ: the vector codec for keys and values of one attention head.

Per vector ``x`` of length ``dim`` (all arithmetic in float32):

1. ``scale = bfloat16(||x||_2)`` is kept; ``inv = 1 / float32(scale)`` (0 when scale is 0).
2. rotate and normalize: ``y = H(x * signs) * inv`` where ``H`` is the unnormalized Hadamard transform
   (:mod:`rvqstore.hadamard`) and ``signs`` the seeded ±1 vector (:mod:`rvqstore.prng`). The rotated
   unit vector is scaled by sqrt(dim), so the coordinates of ``y`` are close to N(0, 1).
3. stage 1: ``i = sum_k [y > b1[k]]`` against the Gaussian Lloyd–Max codebook (``c1``, ``b1``).
4. stage 2 refines the stage-1 cell, in one of two kinds (:mod:`rvqstore.codebooks`):

   * ``conditional`` (default; measured better): row ``i`` of the tables is the Lloyd–Max quantizer
     of N(0, 1) restricted to stage-1 cell ``i``, in ``y`` coordinates: ``j = sum_k [y > t2[i][k]]``
     and ``y_hat = v2[i][j]``. Its thresholds lie strictly inside cell ``i``, so ``i * 2^bits2 + j``
     is also the count of ``y`` over all thresholds of the interleaved sorted list (a faster, identical
     formulation used when that list is short).
   * ``shared``: one Laplacian Lloyd–Max table scaled to the stage-1 residual's variance, in residual
     coordinates: ``r = y - c1[i]``, ``j = sum_k [r > b2[k]]``, ``y_hat = c1[i] + c2[j]``.
   * a uniform grid (``step=``): conditional tables whose ``2^(bits1+bits2)`` points are ``step``
     apart (:func:`rvqstore.codebooks.uniform_grid`); the same rules, files and kernels, since
     everything reads the tables. Lower error per bit once a file entropy-codes the indices.

5. both index streams are bit-packed (:mod:`rvqstore.packing`).

Decoding: ``y_hat`` as above (float32), ``x_hat = (H^T(y_hat) / dim) * signs * scale``, cast to the
input dtype. Stage 1 alone (``y_hat = c1[i]``) is a valid ``bits1``-bit code.

Scales: a scale is NaN (the vector held NaN/Inf, or its norm is out of range) or finite with
``0 <= scale <= max_scale(dtype) = F * (1 - 2^-8) / A``: ``F`` the largest finite value of the output
dtype, ``A`` the largest ``|y_hat|`` any code decodes to (:attr:`RVQCodec.decode_bound`). Since
``|x_hat_k| <= scale * A``, every vector with a valid finite scale decodes to finite values in that
dtype whatever its codes (the margin covers float32 rounding). The encoder gives a vector beyond the
bound a NaN scale; readers reject any other scale (:meth:`RVQCodec.check_scales`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import numpy as np

from . import hadamard
from .codebooks import gaussian_codebook, grid_step, residual_tables, uniform_grid
from .errors import CodecConfigError, InputShapeError, InvalidScaleError, NonFiniteInputError
from .packing import pack_codes, unpack_codes, words_per_vector
from .prng import PRNG_NAME, bits_to_signs, rotation_signs, signs_to_bits

QUANTIZER_NAME = "turboquant-rvq"
QUANTIZER_VERSION = 1
RESIDUAL_KINDS = ("conditional", "shared")
# The library default, from the pooled results of four texts (docs/quality.md, SmolLM2-135M): 4+2
# is the lowest-loss single setting under 8 bits (mean token KL 0.0043, +1.2% perplexity; 2+2: 0.067,
# 4+1: 0.015). Smaller caches should give keys more bits than values: see rvqstore.presets.
DEFAULT_BITS = (4, 2)
_FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
_DTYPE_NAMES = {mx.float16: "float16", mx.bfloat16: "bfloat16", mx.float32: "float32"}
DTYPE_BY_NAME = {name: dt for dt, name in _DTYPE_NAMES.items()}  # the float dtypes caches and files hold


@dataclass(frozen=True)
class EncodedVectors:
    """The packed form of an array of shape ``(..., dim)``.

    ``scales``: ``(...)`` bfloat16 per-vector L2 norms (NaN marks a vector that had NaN/Inf);
    ``codes1``: ``(..., words1)`` uint32 stage-1 codes; ``codes2``: ``(..., words2)`` uint32 stage-2
    codes, or None in single-stage mode; ``dtype``: the input dtype that decode returns.
    """

    scales: mx.array
    codes1: mx.array
    codes2: mx.array | None
    dtype: mx.Dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """Leading shape (without the vector axis)."""
        return tuple(self.scales.shape)

    @property
    def nbytes(self) -> int:
        """Bytes actually held by the packed arrays."""
        return self.scales.nbytes + self.codes1.nbytes + (self.codes2.nbytes if self.codes2 is not None else 0)


def _parse_bits(bits: Any) -> tuple[int, int]:
    if isinstance(bits, int) and not isinstance(bits, bool):
        bits = (bits, 0)
    if not isinstance(bits, (tuple, list)) or len(bits) != 2:
        raise CodecConfigError(f"bits must be (bits1, bits2) or an int, got {bits!r}")
    b1, b2 = bits
    for b, lo in ((b1, 1), (b2, 0)):
        if not isinstance(b, int) or isinstance(b, bool) or not lo <= b <= 4:
            raise CodecConfigError(f"bits per stage must be integers, stage 1 in 1..4 and stage 2 in 0..4 "
                                   f"(0 = single stage), got {tuple(bits)!r}")
    return b1, b2


class RVQCodec:
    """Two-stage residual scalar quantizer for vectors of length ``dim`` after a seeded Hadamard rotation.

    Args:
        dim: vector length (attention head dim); ``m * 2^k`` with m in (1, 12, 20, 28).
        bits: ``(bits1, bits2)`` with bits1 in 1..4 and bits2 in 0..4 (0: single stage), or an int
            for single stage.
        seed: rotation seed (any integer; taken modulo 2^64).
        residual: ``"conditional"`` (stage-2 table chosen by the stage-1 index) or ``"shared"``.
        use_kernels: use the fused GPU kernels when the backend has them (output is identical).
        step: None (default) for the Gaussian Lloyd–Max tables; a float for the uniform grid of
            ``2^(bits1 + bits2)`` points ``step`` apart (:func:`rvqstore.codebooks.uniform_grid`), held
            as conditional tables (``residual`` must be ``"conditional"`` or ``bits2`` 0). In memory
            a grid code is as wide as any other; its point is that files entropy-code it near its
            entropy (``save_prompt_cache(..., compress="best")``) at a lower error per stored bit.
    """

    def __init__(self, dim: int, bits: tuple[int, int] | int = DEFAULT_BITS, seed: int = 0,
                 residual: str = "conditional", *, use_kernels: bool = True, step: float | None = None,
                 _tables: dict | None = None, _signs: np.ndarray | None = None):
        if not isinstance(dim, int) or isinstance(dim, bool):
            raise CodecConfigError(f"dim must be an int, got {dim!r}")
        hadamard.check_dim(dim)
        self.dim = dim
        self.bits1, self.bits2 = _parse_bits(bits)
        if residual not in RESIDUAL_KINDS:
            raise CodecConfigError(f"residual must be one of {RESIDUAL_KINDS}, got {residual!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise CodecConfigError(f"seed must be an int, got {seed!r}")
        self.residual = residual if self.bits2 else "none"
        self.seed = seed
        self.use_kernels = use_kernels
        self.signs = rotation_signs(seed, dim) if _signs is None else _signs
        if step is not None:
            if self.bits2 and residual != "conditional":
                raise CodecConfigError(f"a uniform grid (step={step!r}) is a conditional codebook; residual "
                                       f"{residual!r} does not fit it")
            _tables = uniform_grid(self.bits1, self.bits2, step)
            step = float(step)
        elif _tables is not None:  # tables from a file: a grid is recognized, for repr and settings only
            step = grid_step(_tables["c1"], _tables["b1"], _tables.get("c2") if self.bits2 else None,
                             _tables.get("b2") if self.bits2 else None)
        self.step = step
        if _tables is None:
            cb = gaussian_codebook(self.bits1)
            _tables = {"c1": cb.centroids, "b1": cb.boundaries}
            if self.bits2:
                rt = residual_tables(residual, self.bits1, self.bits2)
                _tables.update(c2=rt.centroids, b2=rt.boundaries)
        self.centroids1 = np.asarray(_tables["c1"], dtype=np.float32)
        self.boundaries1 = np.asarray(_tables["b1"], dtype=np.float32)
        self.centroids2 = np.asarray(_tables["c2"], dtype=np.float32) if self.bits2 else None
        self.boundaries2 = np.asarray(_tables["b2"], dtype=np.float32) if self.bits2 else None
        self.words1 = words_per_vector(dim, self.bits1)
        self.words2 = words_per_vector(dim, self.bits2) if self.bits2 else 0
        self._signs_mx = mx.array(self.signs)
        self._c1_mx = mx.array(self.centroids1)
        if self.bits2:
            self._c2_flat = mx.array(self.centroids2.reshape(-1))
            self._b2_cols = [mx.array(np.ascontiguousarray(self.boundaries2[:, k]))
                             for k in range(self.boundaries2.shape[1])]
            if self.residual == "conditional":
                _check_nested(self.boundaries1, self.boundaries2)
                # cell boundaries and the in-cell thresholds, interleaved: one sorted list
                fine = []
                for i, row in enumerate(self.boundaries2):
                    fine.extend(row)
                    if i < len(self.boundaries1):
                        fine.append(self.boundaries1[i])
                self._fine_thresholds = np.array(fine, dtype=np.float32)
        if self.step is not None:  # a grid's sorted thresholds, searched as data (_search_grid)
            self._thresholds_mx = mx.array(self._fine_thresholds if self.bits2 else self.boundaries1)
        # the thresholds _count_above compares with, as arrays: data of the compiled encode, not constants
        self._b1_mx = mx.array(self.boundaries1)
        if self.bits2:
            self._b2_row0_mx = mx.array(self.boundaries2[0])
            self._fine_mx = mx.array(self._fine_thresholds) if self.residual == "conditional" else None
        # up to this many thresholds, count over the flat list instead of gathering per cell; measured
        # on MLX's CPU backend the flat count wins or ties for every config (e.g. 2+4: 0.26 s vs 1.2 s,
        # 4+2: 0.39 vs 0.36 s per 12.8M coordinates); the gathered form stays for tests and as the spec's
        # own wording
        self.max_flat_thresholds = 255
        # compiled once per codec: fewer dispatches per call (what a per-token cache update pays)
        self._rotate_fn = mx.compile(self._rotate_reference)
        self._bounds: dict = {}  # dtype -> max_scale as a float32 array (rotate)
        self._same: dict[int, tuple["RVQCodec", bool]] = {}  # id(other) -> (other, same_code)
        self._scale_bits: dict = {}  # dtype -> (limit pattern, its mx.uint16 constants), for check_scales
        self._unrotate_fns: dict = {}
        self._quantize_fn = mx.compile(self._quantize_reference)
        self._dequantize_fn = mx.compile(self._dequantize_reference)
        self._luts: dict[str, tuple[mx.array, int]] = {}
        self._lut_fn = mx.compile(self._lut_decode)
        #: per-codec launch setups of the CUDA step kernels (rvqstore.cache_append, rvqstore.cache_fetch),
        #: made at their first use: an attribute, so a decode step finds them without a weak-dictionary lookup
        self.launch_setups: dict = {}

    # ---- description ------------------------------------------------------------------------------
    @property
    def bits(self) -> tuple[int, int]:
        return (self.bits1, self.bits2)

    @property
    def decode_bound(self) -> float:
        """``A``: the largest ``|y_hat|`` any code (either stage count) decodes to before unrotating."""
        a = float(np.max(np.abs(self.centroids1)))
        if self.bits2 and self.residual == "shared":
            c1, c2 = self.centroids1.astype(np.float64), self.centroids2[0].astype(np.float64)
            a = max(a, abs(c1.max() + c2.max()), abs(c1.min() + c2.min()))
        elif self.bits2:
            a = max(a, float(np.max(np.abs(self.centroids2))))
        return a

    def same_code(self, other: "RVQCodec") -> bool:
        """Whether ``other`` codes and decodes exactly as this codec does (geometry, tables, signs):
        settings alone do not say it, since tables come from files and grids. Remembered per ``other``
        (caches ask on every append; a codec's tables never change)."""
        if other is self:
            return True
        memo = self._same.get(id(other))
        if memo is not None and memo[0] is other:
            return memo[1]
        same = (self.dim, self.bits, self.residual) == (other.dim, other.bits, other.residual)
        if same:
            pairs = [(self.signs, other.signs), (self.centroids1, other.centroids1),
                     (self.boundaries1, other.boundaries1)]
            if self.bits2:
                pairs += [(self.centroids2, other.centroids2), (self.boundaries2, other.boundaries2)]
            same = all(np.array_equal(a, b) for a, b in pairs)
        self._same[id(other)] = (other, same)
        return same

    def max_scale(self, dtype: mx.Dtype) -> float:
        """The largest valid scale for vectors decoded to ``dtype`` (see the module docstring)."""
        if dtype not in _FLOAT_DTYPES:
            raise InputShapeError(f"expected a float16, bfloat16 or float32 dtype, got {dtype}")
        return float(mx.finfo(dtype).max) * (1.0 - 2.0 ** -8) / self.decode_bound

    def check_scales(self, scales: mx.array, dtype: mx.Dtype) -> None:
        """Raise InvalidScaleError unless every scale is NaN or in ``[0, max_scale(dtype)]``.

        For scales from outside (a file, ``from_packed``); one reduction over the scales, no decode.
        """
        if not isinstance(scales, mx.array) or scales.dtype != mx.bfloat16:
            raise InputShapeError(f"scales must be a bfloat16 mx.array, got {getattr(scales, 'dtype', type(scales))}")
        if scales.size == 0:
            return
        if bool(mx.any(self.refused_scales(scales, dtype)).item()):
            s = scales.astype(mx.float32).reshape(-1)
            bad = self.refused_scales(scales, dtype).reshape(-1)
            first = float(s[int(mx.argmax(bad).item())].item())
            raise InvalidScaleError(f"{int(mx.sum(bad).item())} scale(s) are neither NaN nor in "
                                    f"[0, {self.max_scale(dtype):.6g}] (vectors would decode beyond "
                                    f"{_DTYPE_NAMES[dtype]}'s range), first {first!r}")

    def refused_scales(self, scales: mx.array, dtype: mx.Dtype) -> mx.array:
        """Where bfloat16 ``scales`` are neither NaN nor in ``[0, max_scale(dtype)]`` (bools, same shape).

        On the bit patterns (a load checks every scale of a file): non-negative bfloat16 values order as
        their patterns do, so the refused ones are the patterns in ``(limit, 0x7F80]`` (above the bound, and
        +Inf) and in ``(0x8000, 0xFF80]`` (negative non-zero, and -Inf); -0.0 and NaN patterns pass. Each
        range is one wrapping uint16 subtraction and one compare. ``limit``: the largest pattern whose value
        is ``<= max_scale`` as float32, the comparison MLX makes between a bfloat16 array cast to float32
        and a Python float."""
        c = self._scale_bits.get(dtype)
        if c is None:
            values = (np.arange(0x7F81, dtype=np.uint32) << 16).view(np.float32)
            with np.errstate(over="ignore"):  # a bound past float32's range is +Inf there, as in MLX's compare
                bound = np.float32(self.max_scale(dtype))
            limit = int(np.nonzero(values <= bound)[0].max())
            c = self._scale_bits[dtype] = tuple(mx.array(v, dtype=mx.uint16) for v in
                                                (limit + 1, 0x7F80 - limit, 0x8001, 0x7F80))
        u = scales.view(mx.uint16)
        return ((u - c[0]) < c[1]) | ((u - c[2]) < c[3])

    @property
    def bits_per_coordinate(self) -> float:
        """Stored bits per coordinate, counting the bfloat16 scale and unused bits in the words."""
        return (32 * (self.words1 + self.words2) + 16) / self.dim

    def __repr__(self) -> str:
        grid = "" if self.step is None else f", step={self.step!r}"
        return (f"RVQCodec(dim={self.dim}, bits={self.bits}, seed={self.seed}, residual={self.residual!r}{grid}, "
                f"{self.bits_per_coordinate:.3f} bits/coord)")

    # ---- public API -------------------------------------------------------------------------------
    def encode(self, x: mx.array, *, check_finite: bool = True) -> EncodedVectors:
        """Encode ``x`` of shape ``(..., dim)`` (float16/bfloat16/float32).

        With ``check_finite`` (default) an input holding NaN or Inf, or a vector whose norm exceeds
        :meth:`max_scale` of its dtype, raises NonFiniteInputError (this costs one reduction and a
        sync). Without it, each such vector gets a NaN scale and the codes of the zero vector, and
        decodes to all-NaN; other vectors are unaffected.
        """
        x = self._check_input(x)
        lead = tuple(x.shape[:-1])
        if x.size == 0:
            return EncodedVectors(mx.zeros(lead, mx.bfloat16), mx.zeros(lead + (self.words1,), mx.uint32),
                                  mx.zeros(lead + (self.words2,), mx.uint32) if self.bits2 else None, x.dtype)
        y, scales = self.rotate(x)
        if check_finite and not bool(mx.all(mx.isfinite(scales)).item()):
            raise NonFiniteInputError("RVQCodec.encode: input contains NaN or Inf, or a vector whose norm is "
                                      f"beyond {self.max_scale(x.dtype):.6g} (the most {_DTYPE_NAMES[x.dtype]} "
                                      "can decode to); pass check_finite=False to encode such vectors as NaN")
        codes1, codes2 = self.quantize(y)
        return EncodedVectors(scales, codes1, codes2, x.dtype)

    def decode(self, enc: EncodedVectors, *, stage1_only: bool = False, dtype: mx.Dtype | None = None) -> mx.array:
        """Reconstruct the array ``enc`` came from, in its dtype (or ``dtype``)."""
        self.check_encoded(enc)
        out_dtype = dtype or enc.dtype
        if out_dtype not in _FLOAT_DTYPES:
            raise InputShapeError(f"decode returns float16, bfloat16 or float32, not {out_dtype}")
        if enc.scales.size == 0:
            return mx.zeros(enc.shape + (self.dim,), out_dtype)
        y_hat = self.dequantize(enc.codes1, None if stage1_only else enc.codes2)
        return self.unrotate(y_hat, enc.scales, out_dtype)

    # ---- the stages, exposed for kernels, caches and tests ------------------------------------------
    def rotate(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """``(y, scales)``: rotated coordinates scaled to ~N(0, 1) (float32) and bfloat16 norms."""
        bound = self._bounds.get(x.dtype)
        if bound is None:  # an input, not a constant: MLX's CPU backend compiles C++ per constant value,
            # and a grid's bound changes with its step (seconds per new step on a cold machine)
            bound = self._bounds[x.dtype] = mx.array(self.max_scale(x.dtype), mx.float32)
        return self._rotate_fn(x, bound)

    def _rotate_reference(self, x: mx.array, bound: mx.array | float | None = None) -> tuple[mx.array, mx.array]:
        xf = x.astype(mx.float32)
        norm = mx.sqrt(mx.sum(xf * xf, axis=-1))
        # a vector is coded when its stored (bfloat16) norm is finite and within the dtype's bound
        # (max_scale, as float32); NaN/Inf norms fail the comparison too
        if bound is None:
            bound = mx.array(self.max_scale(x.dtype), mx.float32)
        finite = norm.astype(mx.bfloat16).astype(mx.float32) <= bound
        scales = mx.where(finite, norm, mx.array(float("nan"), mx.float32)).astype(mx.bfloat16)
        s32 = scales.astype(mx.float32)
        # normalize by the stored (rounded) scale, so the rounding of the scale costs no accuracy
        inv = mx.where(finite & (s32 > 0), 1.0 / mx.where(s32 > 0, s32, 1.0), 0.0)
        y = hadamard.forward(mx.where(finite[..., None], xf, 0.0) * self._signs_mx) * inv[..., None]
        return y, scales

    def quantize(self, y: mx.array) -> tuple[mx.array, mx.array | None]:
        """Packed ``(codes1, codes2)`` for rotated coordinates ``y`` (float32, ``(..., dim)``)."""
        if self.use_kernels:
            from . import fused  # local import: the kernel module needs a GPU backend to be useful

            out = fused.quantize_pack(self, y)
            if out is not None:
                return out
        return self._quantize_fn(y)

    def dequantize(self, codes1: mx.array, codes2: mx.array | None) -> mx.array:
        """Rotated-domain reconstruction ``y_hat`` (float32) from packed codes (codes2 None: stage 1 only)."""
        if self.use_kernels:
            from . import fused

            out = fused.unpack_dequantize(self, codes1, codes2)
            if out is not None:
                return out
        two = codes2 is not None and self.bits2 > 0
        lut = self._group_lut(two)
        if lut is not None:
            return self._lut_fn(codes1, codes2 if two else codes1, lut[0], lut[1], two)
        if not two:
            return mx.take(self._c1_mx, unpack_codes(codes1, self.bits1, self.dim).astype(mx.uint32))
        return self._dequantize_fn(codes1, codes2)

    # ---- table decoding: a faster, bit-identical formulation for 1/2/4-bit codes ---------------------
    def _group_lut(self, two_stage: bool) -> tuple[mx.array, int] | None:
        """``(table, g)``: the codes of ``g`` consecutive coordinates (stage-1 bits, then stage-2 bits
        above them) index ``table``, whose row holds their ``g`` float32 decoded values. One gather per
        ``g`` coordinates instead of one per coordinate. None for 3-bit codes (they straddle fields)."""
        b1, b2 = self.bits1, (self.bits2 if two_stage else 0)
        if b1 not in (1, 2, 4) or (two_stage and b2 not in (1, 2, 4)):
            return None
        key = "lut2" if two_stage else "lut1"
        if key not in self._luts:
            g = 8 // max(b1, b2)
            w1 = g * b1
            i = np.arange(1 << (g * (b1 + b2)))
            table = np.empty((len(i), g), np.float32)
            for j in range(g):
                i1 = (i >> (j * b1)) & ((1 << b1) - 1)
                if not two_stage:
                    table[:, j] = self.centroids1[i1]
                    continue
                i2 = (i >> (w1 + j * b2)) & ((1 << b2) - 1)
                if self.residual == "shared":  # same float32 add as the reference path
                    table[:, j] = self.centroids1[i1] + self.centroids2[0][i2]
                else:
                    table[:, j] = self.centroids2[i1, i2]
            self._luts[key] = (mx.array(table), g)
        return self._luts[key]

    @staticmethod
    def _fields(words: mx.array, width: int) -> mx.array:
        """Split uint32 words into their ``32 // width`` fields of ``width`` bits, LSB first."""
        if width == 8:
            return words.view(mx.uint8).astype(mx.uint32)
        if width == 16:
            return words.view(mx.uint16).astype(mx.uint32)
        shifts = mx.arange(32 // width, dtype=mx.uint32) * width
        f = (words[..., None] >> shifts) & ((1 << width) - 1)
        return f.reshape(*words.shape[:-1], -1)

    def _lut_decode(self, codes1: mx.array, codes2: mx.array, table: mx.array, g: int, two_stage: bool) -> mx.array:
        n = -(-self.dim // g)  # groups per vector (code slots past dim are zero padding)
        idx = self._fields(codes1, g * self.bits1)[..., :n]
        if two_stage:
            idx = idx | (self._fields(codes2, g * self.bits2)[..., :n] << (g * self.bits1))
        y = mx.take(table, idx, axis=0).reshape(*codes1.shape[:-1], n * g)
        return y[..., : self.dim] if n * g != self.dim else y

    def unrotate(self, y_hat: mx.array, scales: mx.array, dtype: mx.Dtype = mx.float32) -> mx.array:
        """``(H^T(y_hat) / dim) * signs * scale`` in ``dtype``."""
        fn = self._unrotate_fns.get(dtype)
        if fn is None:  # mx.compile takes arrays, not dtypes: one compiled function per output dtype
            fn = self._unrotate_fns[dtype] = mx.compile(lambda y, s: self._unrotate_reference(y, s, dtype))
        return fn(y_hat, scales)

    def _unrotate_reference(self, y_hat: mx.array, scales: mx.array, dtype: mx.Dtype) -> mx.array:
        u = hadamard.inverse(y_hat, 1.0 / self.dim) * self._signs_mx
        return (u * scales.astype(mx.float32)[..., None]).astype(dtype)

    # ---- reference (unfused) paths: the definition of correct -----------------------------------------
    def _quantize_reference(self, y: mx.array) -> tuple[mx.array, mx.array | None]:
        if self.step is not None:
            p = self._search_grid(y)  # the point's index among all 2^(bits1+bits2): stage 1 on top
            codes1 = pack_codes(p >> self.bits2, self.bits1)
            return codes1, (pack_codes(p, self.bits2) if self.bits2 else None)  # pack_codes keeps the low bits
        idx1 = self._count_above(y, self._b1_mx)
        codes1 = pack_codes(idx1, self.bits1)
        if not self.bits2:
            return codes1, None
        i1 = idx1.astype(mx.uint32)
        if self.residual == "shared":
            idx2 = self._count_above(y - mx.take(self._c1_mx, i1), self._b2_row0_mx)
        elif len(self._fine_thresholds) <= self.max_flat_thresholds:
            idx2 = self._count_above(y, self._fine_mx) & ((1 << self.bits2) - 1)
        else:
            idx2 = mx.zeros(y.shape, mx.uint8)
            for col in self._b2_cols:
                idx2 = idx2 + (y > mx.take(col, i1)).astype(mx.uint8)
        return codes1, pack_codes(idx2, self.bits2)

    def _search_grid(self, v: mx.array) -> mx.array:
        """``#{k : v > t[k]}`` over a grid's sorted thresholds, by binary search on the table as an array.

        Counting with the thresholds as constants (``_count_above``) makes MLX's CPU backend compile C++
        with those constants: 10-40 s at 63-127 thresholds, for every new step. Here the compiled code
        is the same for every grid of a bit width (the table is data), and runs as fast (4+3: 14-22 ms
        against 21 ms per 262k coordinates). Same count as the kernels' binary search."""
        p = mx.zeros(v.shape, mx.uint32)
        for s in range(self.bits1 + self.bits2 - 1, -1, -1):
            st = 1 << s
            p = mx.where(mx.take(self._thresholds_mx, p + (st - 1)) < v, p + st, p)
        return p

    @staticmethod
    def _count_above(v: mx.array, boundaries: mx.array | np.ndarray) -> mx.array:
        """``#{k : v > boundaries[k]}``, the boundaries rounded to ``v``'s dtype (as a Python scalar would be).

        Unrolled compares: the fastest formulation on MLX's CPU backend. Each boundary is an element of an
        array, not a Python float: a compiled encode then embeds no constants, so MLX generates and compiles
        its fused kernels once per number of thresholds rather than once per codec's table. With the values
        as constants a fresh machine's first encode cost 17 s (2+2) to 120 s (4+4) of C++ builds on the CPU
        backend (and, by all signs, the 434 s of a first 4+4 encode on the H200: tools/results/suite-gpu.txt)."""
        t = mx.array(boundaries) if isinstance(boundaries, np.ndarray) else boundaries
        t = t.astype(v.dtype)
        idx = mx.zeros(v.shape, mx.uint8)
        for k in range(t.shape[0]):
            idx = idx + (v > t[k]).astype(mx.uint8)
        return idx

    def _dequantize_reference(self, codes1: mx.array, codes2: mx.array) -> mx.array:
        i1 = unpack_codes(codes1, self.bits1, self.dim).astype(mx.uint32)
        i2 = unpack_codes(codes2, self.bits2, self.dim).astype(mx.uint32)
        if self.residual == "shared":
            return mx.take(self._c1_mx, i1) + mx.take(self._c2_flat, i2)
        return mx.take(self._c2_flat, i1 * (1 << self.bits2) + i2)

    # ---- checks --------------------------------------------------------------------------------------
    def _check_input(self, x: Any) -> mx.array:
        if isinstance(x, np.ndarray):
            x = mx.array(x)
        if not isinstance(x, mx.array):
            raise InputShapeError(f"expected an mx.array, got {type(x).__name__}")
        if x.dtype not in _FLOAT_DTYPES:
            raise InputShapeError(f"expected float16, bfloat16 or float32 input, got {x.dtype}")
        if x.ndim == 0 or x.shape[-1] != self.dim:
            raise InputShapeError(f"expected shape (..., {self.dim}), got {tuple(x.shape)}")
        return x

    def check_encoded(self, enc: EncodedVectors) -> None:
        """Raise InputShapeError unless ``enc`` has this codec's array types, dtypes and word counts."""
        if not isinstance(enc, EncodedVectors):
            raise InputShapeError(f"expected EncodedVectors, got {type(enc).__name__}")
        for name in ("scales", "codes1", "codes2"):
            a = getattr(enc, name)
            if not isinstance(a, mx.array) and not (name == "codes2" and a is None):
                raise InputShapeError(f"EncodedVectors.{name} must be an mx.array, got {type(a).__name__}")
        lead = tuple(enc.scales.shape)
        if enc.codes1.dtype != mx.uint32 or tuple(enc.codes1.shape) != lead + (self.words1,):
            raise InputShapeError(f"codes1 must be uint32 of shape {lead + (self.words1,)}, "
                                  f"got {enc.codes1.dtype} {tuple(enc.codes1.shape)}")
        if self.bits2 and enc.codes2 is not None and (
                enc.codes2.dtype != mx.uint32 or tuple(enc.codes2.shape) != lead + (self.words2,)):
            raise InputShapeError(f"codes2 must be uint32 of shape {lead + (self.words2,)}, "
                                  f"got {enc.codes2.dtype} {tuple(enc.codes2.shape)}")
        if self.bits2 and enc.codes2 is None:
            raise InputShapeError("codes2 missing for a two-stage codec (use stage1_only=True)")

    # ---- serialization (the `quantizer` map of the .rvq header) ---------------------------------------
    def to_header(self) -> dict[str, Any]:
        """A msgpack-ready description holding everything a decoder needs (tables and signs included)."""
        h: dict[str, Any] = {
            "name": QUANTIZER_NAME,
            "version": QUANTIZER_VERSION,
            "dim": self.dim,
            "bits1": self.bits1,
            "bits2": self.bits2,
            "residual": self.residual,
            "scale_dtype": "bfloat16",
            "rotation": {"kind": "randomized-hadamard", "seed": self.seed & ((1 << 64) - 1),
                         "prng": PRNG_NAME, "signs": signs_to_bits(self.signs)},
            "centroids1": [float(v) for v in self.centroids1],
            "boundaries1": [float(v) for v in self.boundaries1],
        }
        if self.bits2:
            h["centroids2"] = [[float(v) for v in row] for row in self.centroids2]
            h["boundaries2"] = [[float(v) for v in row] for row in self.boundaries2]
        return h

    @classmethod
    def from_header(cls, h: dict[str, Any], *, use_kernels: bool = True) -> "RVQCodec":
        """Rebuild a codec from :meth:`to_header`'s map, using the stored tables and signs.

        Raises CodecConfigError on anything malformed (wrong types, sizes, unsorted tables, ...).
        """
        try:
            if h.get("name") != QUANTIZER_NAME:
                raise CodecConfigError(f"unknown quantizer {h.get('name')!r}")
            if h.get("version") != QUANTIZER_VERSION:
                raise CodecConfigError(f"unsupported {QUANTIZER_NAME} version {h.get('version')!r}")
            dim, b1, b2 = h["dim"], h["bits1"], h["bits2"]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (dim, b1, b2)):
                raise CodecConfigError("dim/bits1/bits2 must be integers")
            hadamard.check_dim(dim)
            b1, b2 = _parse_bits((b1, b2))
            residual = h["residual"]
            if (residual == "none") != (b2 == 0) or (b2 and residual not in RESIDUAL_KINDS):
                raise CodecConfigError(f"residual kind {residual!r} does not fit bits2={b2}")
            if h.get("scale_dtype") != "bfloat16":
                raise CodecConfigError(f"unsupported scale dtype {h.get('scale_dtype')!r}")
            rot = h["rotation"]
            if rot.get("kind") != "randomized-hadamard" or rot.get("prng") != PRNG_NAME:
                raise CodecConfigError(f"unsupported rotation {rot.get('kind')!r}/{rot.get('prng')!r}")
            seed, signs = rot["seed"], rot["signs"]
            if not isinstance(seed, int) or not isinstance(signs, bytes) or len(signs) != -(-dim // 8):
                raise CodecConfigError("rotation seed/signs malformed")
            tables = {"c1": _table(h["centroids1"], (1 << b1,)), "b1": _table(h["boundaries1"], ((1 << b1) - 1,))}
            if b2:
                tables["c2"] = _table(h["centroids2"], (1 << b1, 1 << b2))
                tables["b2"] = _table(h["boundaries2"], (1 << b1, (1 << b2) - 1))
        except (KeyError, TypeError, AttributeError) as e:
            raise CodecConfigError(f"malformed quantizer header: {e!r}") from None
        return cls(dim, (b1, b2), seed, residual if b2 else "conditional", use_kernels=use_kernels,
                   _tables=tables, _signs=bits_to_signs(signs, dim))

    # ---- expected quality ------------------------------------------------------------------------------
    def predicted_relative_error(self, *, stage1_only: bool = False) -> float:
        """E||x - x_hat||^2 / ||x||^2 predicted from the tables, for directions uniform on the sphere.

        The coordinates of ``y`` then follow ``f(y) ~ (1 - y^2/dim)^((dim-3)/2)`` on ``|y| < sqrt(dim)``
        (N(0, 1) as dim grows); the prediction integrates the float32 quantizer's squared error
        against that density numerically.
        """
        return _predicted_error(self.dim, self.centroids1.tobytes(), self.boundaries1.tobytes(),
                                None if (stage1_only or not self.bits2) else self.centroids2.tobytes(),
                                None if (stage1_only or not self.bits2) else self.boundaries2.tobytes(),
                                self.bits1, self.bits2, self.residual == "shared")


_SETTINGS_CHECKED: dict[str, float | None] = {}  # repr of (bits, seed, residual, step) -> the step kept


def scales_pass(checks) -> bool:
    """Whether every ``(codec, scales, dtype)`` of ``checks`` would pass :meth:`RVQCodec.check_scales`, found by
    one reduction over all of them (a load's one device round trip for a whole file instead of one per layer
    side). False also where an entry is not bfloat16 scales: check those one by one, for the typed error."""
    flags = []
    for codec, scales, dtype in checks:
        if not isinstance(scales, mx.array) or scales.dtype != mx.bfloat16 or dtype not in _FLOAT_DTYPES:
            return False
        if scales.size:
            flags.append(mx.any(codec.refused_scales(scales, dtype)))
    return not flags or not bool(mx.any(mx.stack(flags)).item())


def checked_step(bits: Any, seed: Any, residual: Any, step: Any) -> float | None:
    """Check codec settings as :class:`RVQCodec` does (its typed errors) and return the ``step`` a codec
    keeps; each distinct setting is checked once per process (a resume builds a cache per layer, each
    checking its settings: 0.2 ms a codec). Keyed by ``repr``, so ``True`` is never taken for ``1``."""
    key = repr((bits, seed, residual, step))
    if key not in _SETTINGS_CHECKED:
        kept = RVQCodec(64, bits, seed, residual, step=step).step  # raises for bad settings: nothing kept
        if len(_SETTINGS_CHECKED) < 1024:
            _SETTINGS_CHECKED[key] = kept
        return kept
    return _SETTINGS_CHECKED[key]


def _check_nested(b1: np.ndarray, t2: np.ndarray) -> None:
    """Conditional thresholds must lie strictly inside their stage-1 cell (the codes rely on it)."""
    lo = np.concatenate([[-np.inf], b1])[:, None]
    hi = np.concatenate([b1, [np.inf]])[:, None]
    if not (np.all(t2 > lo) and np.all(t2 < hi)):
        raise CodecConfigError("conditional stage-2 thresholds must lie strictly inside their stage-1 cell")


def _table(v: Any, shape: tuple[int, ...]) -> np.ndarray:
    try:
        a = np.asarray(v, dtype=np.float64)
    except (ValueError, TypeError, OverflowError):  # ragged rows, strings, bytes, huge ints
        raise CodecConfigError(f"codebook table must be {'x'.join(map(str, shape))} numbers") from None
    with np.errstate(over="ignore"):
        finite = np.all(np.isfinite(a.astype(np.float32)))  # finite as the float32 it is used as
    if a.shape != shape or not finite:
        raise CodecConfigError(f"codebook table of shape {a.shape} (expected {shape}) or non-finite")
    if a.shape[-1] > 1 and not np.all(np.diff(a, axis=-1) > 0):
        raise CodecConfigError("codebook table not strictly increasing")
    return a.astype(np.float32)


@lru_cache(maxsize=64)
def _predicted_error(dim, c1b, b1b, c2b, b2b, bits1, bits2, shared) -> float:
    c2b_shared = (shared,)
    c1, b1 = np.frombuffer(c1b, np.float32), np.frombuffer(b1b, np.float32)
    lim = min(math.sqrt(dim), 12.0)
    y = np.linspace(-lim, lim, 2_000_001, dtype=np.float64)
    if dim > 3:
        f = np.power(np.clip(1.0 - y * y / dim, 0.0, None), (dim - 3) / 2.0)
    else:
        f = np.exp(-0.5 * y * y)
    f /= np.trapezoid(f, y)
    y32 = y.astype(np.float32)
    i1 = np.searchsorted(b1, y32, side="left")  # == number of boundaries strictly below y
    yh = c1[i1]
    if c2b is not None:
        c2 = np.frombuffer(c2b, np.float32).reshape(1 << bits1, 1 << bits2)
        b2 = np.frombuffer(b2b, np.float32).reshape(1 << bits1, (1 << bits2) - 1)
        if c2b_shared[0]:
            i2 = ((y32 - yh)[:, None] > b2[0]).sum(axis=1)
            yh = yh + c2[0][i2]
        else:
            i2 = (y32[:, None] > b2[i1]).sum(axis=1)
            yh = c2[i1, i2]
    err = (y - yh.astype(np.float64)) ** 2
    return float(np.trapezoid(err * f, y))
