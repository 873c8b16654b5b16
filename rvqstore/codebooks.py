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
import numbers
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import CodecConfigError

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


# ---- uniform grids (entropy-constrained scalar quantization) --------------------------------------
def uniform_grid(bits1: int, bits2: int, step: float) -> dict[str, np.ndarray]:
    """A uniform grid of ``L = 2^(bits1 + bits2)`` points as two-stage conditional tables.

    Points ``v_k = (k - (L - 1) / 2) * step`` (float64, rounded once to float32); the thresholds are
    the float32 midpoints of consecutive points. Stage 2 row ``i`` holds the ``2^bits2`` points of
    coarse cell ``i`` and the thresholds between them; stage-1 boundaries are the thresholds at the
    cell edges (every ``2^bits2``-th), stage-1 centroids the mean of each cell's points, so stage 1
    alone is still a valid code. A grid's squared error is about ``step^2 / 12`` wherever the
    values sit (an offset costs nothing but range), and its indices are worth entropy coding: unlike
    Lloyd–Max cells, grid cells are far from equiprobable.

    Returns ``dict(c1=, b1=)`` plus ``c2=, b2=`` when ``bits2 > 0`` (float32 numpy arrays, the shapes
    of :class:`ResidualTables`). CodecConfigError for a step that is not a finite positive number, or
    one so small or large that the float32 points and thresholds are not strictly increasing.
    """
    for b, lo in ((bits1, 1), (bits2, 0)):
        if not isinstance(b, int) or isinstance(b, bool) or not lo <= b <= 4:
            raise CodecConfigError(f"uniform grid bits must be stage 1 in 1..4 and stage 2 in 0..4, "
                                   f"got {(bits1, bits2)!r}")
    if not isinstance(step, numbers.Real) or isinstance(step, bool):
        raise CodecConfigError(f"step must be a real number, got {step!r}")
    step = float(step)
    if not math.isfinite(step) or step <= 0.0:
        raise CodecConfigError(f"step must be finite and > 0, got {step!r}")
    levels = 1 << (bits1 + bits2)
    k = np.arange(levels, dtype=np.float64)
    with np.errstate(over="ignore"):
        v = ((k - (levels - 1) / 2.0) * step).astype(np.float32)
        t = ((v[:-1].astype(np.float64) + v[1:].astype(np.float64)) / 2.0).astype(np.float32)
    # strictly increasing points with every threshold strictly between its two points (and all finite)
    if not (np.all(np.isfinite(v)) and np.all(v[:-1] < t) and np.all(t < v[1:])):
        raise CodecConfigError(f"step {step!r} is too {'small' if step < 1.0 else 'large'} for a {levels}-point "
                          f"float32 grid (points and thresholds must be finite and strictly increasing)")
    l2 = 1 << bits2
    if bits2 == 0:
        return {"c1": v, "b1": t}
    cells = v.reshape(-1, l2)
    out = {"c1": cells.astype(np.float64).mean(axis=1).astype(np.float32),
           "b1": np.ascontiguousarray(t[l2 - 1::l2]),
           "c2": np.ascontiguousarray(cells),
           "b2": np.ascontiguousarray(np.append(t, np.float32(0)).reshape(-1, l2)[:, :-1])}
    if not np.all(np.diff(out["c1"]) > 0):  # the means of neighbouring cells (cannot fail once v is valid)
        raise CodecConfigError(f"step {step!r}: stage-1 centroids of the grid are not strictly increasing")
    return out


def grid_step(c1: np.ndarray, b1: np.ndarray, c2: np.ndarray | None, b2: np.ndarray | None) -> float | None:
    """The step of :func:`uniform_grid` that gives exactly these float32 tables, or None when they are
    no uniform grid (Lloyd–Max, or anything else a file holds). Informational: decoding uses the tables."""
    points = np.asarray(c1 if c2 is None else c2, np.float32).reshape(-1)
    levels = points.size
    bits1 = int(np.asarray(c1).size).bit_length() - 1
    bits2 = int(levels // np.asarray(c1).size).bit_length() - 1
    m = np.arange(levels, dtype=np.float64) - (levels - 1) / 2.0
    if levels < 2 or not np.all(np.isfinite(points)):
        return None
    # each point pins the step to an interval (its float32 rounding interval / multiplier): intersect them
    nz = m != 0
    p = points.astype(np.float64)[nz]
    half_ulp = np.spacing(np.abs(points[nz])).astype(np.float64) / 2.0
    lo = np.max((p - np.sign(m[nz]) * half_ulp) / m[nz])
    hi = np.min((p + np.sign(m[nz]) * half_ulp) / m[nz])
    if not (lo <= hi and hi > 0):
        return None
    mid = 0.5 * (lo + hi)
    # short decimal forms first, so a grid made with step=0.3 reports 0.3
    for step in [float(f"{mid:.{d}g}") for d in range(6, 10)] + [mid, lo, hi]:
        if not lo <= step <= hi:
            continue
        try:
            g = uniform_grid(bits1, bits2, float(step))
        except CodecConfigError:  # not a grid this rule makes
            continue
        given = {"c1": c1, "b1": b1} if c2 is None else {"c1": c1, "b1": b1, "c2": c2, "b2": b2}
        if all(np.array_equal(g[k], np.asarray(v, np.float32)) for k, v in given.items()):
            return float(step)
    return None
