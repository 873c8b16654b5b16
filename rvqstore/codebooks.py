"""Scalar codebooks: Lloyd–Max quantizers for the standard Gaussian, its truncations, and the Laplacian.

Everything here is computed in float64 from closed-form interval moments, by one deterministic
procedure (so every platform gets the same tables):

1. start from the 2^b equal-probability cells of the distribution (their conditional means),
2. repeat: boundaries = midpoints of neighbouring centroids; centroids = conditional means of the
   cells the boundaries make; until no centroid moves by more than 1e-13, at most 20000 rounds,
3. make the tables exactly mirror-symmetric (``v[k] = (v[k] - v[-1-k]) / 2``; the laws are
   symmetric, and this removes last-bit noise), then round to float32 (the tables the codec and
   the file store).

A quantizer's index is the number of boundaries the value exceeds: ``idx = sum_k [v > boundary_k]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


# ---- standard normal interval moments ------------------------------------------------------------
def _phi(x: float) -> float:
    return 0.0 if math.isinf(x) else _INV_SQRT_2PI * math.exp(-0.5 * x * x)


def _cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / _SQRT2)


def _sf(x: float) -> float:
    return 0.5 * math.erfc(x / _SQRT2)


def normal_moments(a: float, b: float) -> tuple[float, float, float]:
    """(P, E[Y 1{a<Y<b}], E[Y^2 1{a<Y<b}]) for Y ~ N(0, 1); uses the upper tail for accuracy."""
    p = (_sf(a) - _sf(b)) if a >= 0 else (_cdf(b) - _cdf(a))
    m1 = _phi(a) - _phi(b)
    ta = 0.0 if math.isinf(a) else a * _phi(a)
    tb = 0.0 if math.isinf(b) else b * _phi(b)
    m2 = p + ta - tb
    return p, m1, m2


def _normal_quantile(q: float) -> float:
    """Inverse CDF by bisection (only used for the deterministic starting point)."""
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _cdf(mid) < q:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


# ---- Laplacian (unit scale beta = 1) interval moments --------------------------------------------
def laplace_moments(a: float, b: float) -> tuple[float, float, float]:
    """(P, E[X 1{..}], E[X^2 1{..}]) for X ~ Laplace(0, 1) on (a, b)."""
    if a < 0 < b:
        p1, f1, s1 = laplace_moments(a, 0.0)
        p2, f2, s2 = laplace_moments(0.0, b)
        return p1 + p2, f1 + f2, s1 + s2
    if b <= 0:  # mirror to the positive side
        p, f, s = laplace_moments(-b, -a)
        return p, -f, s

    # on [0, inf): density e^{-x}/2; antiderivatives of x^k e^{-x}/2
    def g(x: float) -> tuple[float, float, float]:
        if math.isinf(x):
            return 0.0, 0.0, 0.0
        e = math.exp(-x)
        return 0.5 * e, 0.5 * e * (x + 1.0), 0.5 * e * (x * x + 2.0 * x + 2.0)

    ga, gb = g(a), g(b)
    return ga[0] - gb[0], ga[1] - gb[1], ga[2] - gb[2]


def _laplace_quantile(q: float) -> float:
    return math.log(2.0 * q) if q < 0.5 else -math.log(2.0 * (1.0 - q))


# ---- Lloyd–Max on an interval ---------------------------------------------------------------------
def lloyd_max(moments, quantile, levels: int, lo: float = -math.inf, hi: float = math.inf,
              tol: float = 1e-13, max_iter: int = 20000) -> tuple[np.ndarray, np.ndarray]:
    """Lloyd–Max quantizer with ``levels`` cells for the distribution restricted to (lo, hi).

    ``moments(a, b)`` gives the interval's (P, first, second) moments; ``quantile`` inverts the CDF.
    Returns float64 (centroids, boundaries) with ``len(boundaries) == levels - 1``.
    """
    p_lo = moments(-math.inf, lo)[0] if not math.isinf(lo) else 0.0
    p_tot = moments(lo, hi)[0]
    edges = [lo] + [quantile(p_lo + p_tot * i / levels) for i in range(1, levels)] + [hi]
    cent = [_cond_mean(moments, edges[i], edges[i + 1]) for i in range(levels)]
    for _ in range(max_iter):
        bnd = [0.5 * (cent[i] + cent[i + 1]) for i in range(levels - 1)]
        edges = [lo] + bnd + [hi]
        new = [_cond_mean(moments, edges[i], edges[i + 1]) for i in range(levels)]
        delta = max(abs(x - y) for x, y in zip(new, cent))
        cent = new
        if delta < tol:
            break
    bnd = [0.5 * (cent[i] + cent[i + 1]) for i in range(levels - 1)]
    return np.array(cent, dtype=np.float64), np.array(bnd, dtype=np.float64)


def _cond_mean(moments, a: float, b: float) -> float:
    p, m1, _ = moments(a, b)
    if p <= 0.0:  # a cell with no mass: sit at its finite end (cannot happen for our tables)
        return a if not math.isinf(a) else b
    return m1 / p


# ---- the codec's tables ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Codebook:
    """A scalar quantizer: sorted float32 ``centroids`` and the midpoints between them."""

    centroids: np.ndarray  # (levels,)
    boundaries: np.ndarray  # (levels - 1,)


@dataclass(frozen=True)
class ResidualTables:
    """Stage-2 tables, one row per stage-1 cell: ``centroids[i]``, ``boundaries[i]``.

    ``shared`` kind: all rows equal, in residual coordinates ``r = y - c1[i]`` (a Laplacian Lloyd–Max
    codebook). ``conditional`` kind: row i is the Lloyd–Max quantizer of N(0, 1) restricted to
    stage-1 cell i, in ``y`` coordinates (its boundaries lie strictly inside the cell).
    """

    kind: str
    centroids: np.ndarray  # (levels1, levels2) float32
    boundaries: np.ndarray  # (levels1, levels2 - 1) float32


def _antisymmetric(v: np.ndarray) -> np.ndarray:
    """Exact mirror symmetry (v[k] == -v[-1-k], middle 0 where there is one) for symmetric laws."""
    return (v - v[::-1]) / 2.0


@lru_cache(maxsize=None)
def _gaussian64(bits: int) -> tuple[np.ndarray, np.ndarray]:
    c, b = lloyd_max(normal_moments, _normal_quantile, 1 << bits)
    return _antisymmetric(c), _antisymmetric(b)


def gaussian_codebook(bits: int) -> Codebook:
    """The ``bits``-bit Lloyd–Max codebook of N(0, 1)."""
    c, b = _gaussian64(bits)
    return Codebook(c.astype(np.float32), b.astype(np.float32))


def stage1_mse(bits: int) -> float:
    """Expected squared error of the Gaussian codebook on N(0, 1) (float64, from the float64 table)."""
    c, b = _gaussian64(bits)
    return mse_of_scalar_quantizer(c, b)


def mse_of_scalar_quantizer(cent: np.ndarray, bnd: np.ndarray) -> float:
    edges = [-math.inf] + [float(v) for v in bnd] + [math.inf]
    total = 0.0
    for i, c in enumerate(cent):
        p, m1, m2 = normal_moments(edges[i], edges[i + 1])
        total += m2 - 2.0 * c * m1 + c * c * p
    return total


@lru_cache(maxsize=None)
def _residual64(kind: str, bits1: int, bits2: int) -> tuple[np.ndarray, np.ndarray]:
    c1, b1 = _gaussian64(bits1)
    levels1, levels2 = len(c1), 1 << bits2
    if kind == "shared":
        # Laplacian Lloyd–Max scaled so its variance (2 beta^2) equals the stage-1 residual's
        beta = math.sqrt(stage1_mse(bits1) / 2.0)
        c, b = lloyd_max(laplace_moments, _laplace_quantile, levels2)
        c, b = _antisymmetric(c) * beta, _antisymmetric(b) * beta
        return np.tile(c, (levels1, 1)), np.tile(b, (levels1, 1))
    if kind == "conditional":
        edges = [-math.inf] + list(b1) + [math.inf]
        cents, bnds = [], []
        for i in range(levels1):
            lo, hi = edges[i], edges[i + 1]
            c, b = lloyd_max(normal_moments, _normal_quantile, levels2, lo, hi)
            cents.append(c)  # in y coordinates: the Lloyd–Max quantizer of N(0,1) on cell i
            bnds.append(b)
        # the law is symmetric, so the table is too: row i is row (levels1-1-i) mirrored
        cents, bnds = np.array(cents), np.array(bnds)
        return (cents - cents[::-1, ::-1]) / 2.0, (bnds - bnds[::-1, ::-1]) / 2.0
    raise ValueError(f"unknown residual codebook kind {kind!r}")


def residual_tables(kind: str, bits1: int, bits2: int) -> ResidualTables:
    c, b = _residual64(kind, bits1, bits2)
    return ResidualTables(kind, c.astype(np.float32), b.astype(np.float32))
