"""Bits (Lloyd–Max codes) or grid steps (entropy-coded uniform grids) per (layer, side), from
measured sensitivity.

Sensitivity of a slot = mean token KL when only that slot is quantized with the probe setting and
everything else stays exact. Token KL grows about linearly with a small error, so a slot coded
with setting ``b`` is predicted to add ``sens * err(b) / err(probe)`` (``err``: the codec's
predicted relative error, data-free). Minimizing the predicted sum under the average budget is a
Lagrangian choice per slot (the lower convex hull of each slot's (bits, predicted KL) points),
then the leftover budget goes, best ratio first, to single upgrades.

Uniform grids (``RVQCodec(step=...)``, files saved with ``compress="best"``): a grid of step ``D``
errs ``D^2 / 12`` per coordinate and, entropy-coded, costs about ``h - log2 D`` bits, so equal
slopes of the Lagrangian give ``D_slot = scale / sqrt(sens_slot / mean sens)``: one number, ``scale``
(the step of a slot of average sensitivity), sets the rate. Measured on SmolLM2's keys and values
(tools/results/quality-ecsq-study.md) this rule lands within 0.5% of the token KL of the Lagrangian
over the measured (rate, error) curves of every slot, from 2.8 to 5.9 bits per coordinate.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Mapping, Sequence

from .codec import RVQCodec
from .errors import CodecConfigError

Slot = tuple[int, str]  # (layer, "k" | "v")


@lru_cache(maxsize=None)
def _bits(b: tuple[int, int], dim: int) -> float:
    return RVQCodec(dim, b).bits_per_coordinate


@lru_cache(maxsize=None)
def _err(b: tuple[int, int], dim: int) -> float:
    return RVQCodec(dim, b).predicted_relative_error()

PROBE = (2, 1)
# Settings a slot may get (3-bit stages pack 10 codes per word, 3.5 bits each: never on the hull).
OPTIONS: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 3), (4, 4))


def predicted(sens: Mapping[Slot, float], table: Mapping[Slot, tuple[int, int]], probe=PROBE, dim: int = 64) -> float:
    """Token KL the allocation is predicted to cost (a sum over slots)."""
    e0 = _err(tuple(probe), dim)
    return sum(s * _err(tuple(table[k]), dim) / e0 for k, s in sens.items())


def average_bits(table: Mapping[Slot, tuple[int, int]], dim: int = 64) -> float:
    return sum(_bits(tuple(b), dim) for b in table.values()) / len(table)


def allocate(sens: Mapping[Slot, float], budget: float, options: Sequence[tuple[int, int]] = OPTIONS,
             probe=PROBE, dim: int = 64) -> dict[Slot, tuple[int, int]]:
    """Settings per slot with average stored bits <= ``budget`` (bits per coordinate, norms counted)
    minimizing the predicted token KL."""
    if not sens:
        raise CodecConfigError("no slot sensitivities to allocate from")
    cost = {o: _bits(o, dim) for o in options}
    gain = {o: _err(o, dim) / _err(tuple(probe), dim) for o in options}
    cheapest = min(options, key=lambda o: cost[o])
    if cost[cheapest] > budget + 1e-9:
        raise CodecConfigError(f"budget {budget} is below the cheapest setting ({cost[cheapest]} bits)")
    slots = sorted(sens)

    def choose(lam: float) -> dict:
        return {k: min(options, key=lambda o: (max(sens[k], 0.0) * gain[o] + lam * cost[o], cost[o])) for k in slots}

    lo, hi = 0.0, 1e6  # lambda: price of a bit; a higher price spends fewer bits
    for _ in range(100):
        mid = (lo + hi) / 2
        if average_bits(choose(mid)) > budget:
            lo = mid
        else:
            hi = mid
    table = choose(hi)
    # spend what is left on the single upgrades with the best predicted gain per bit
    while True:
        room = budget * len(slots) - sum(cost[b] for b in table.values())
        best = None
        for k in slots:
            for o in options:
                extra = cost[o] - cost[table[k]]
                if 0 < extra <= room + 1e-9:
                    r = max(sens[k], 0.0) * (gain[table[k]] - gain[o]) / extra
                    if r > 0 and (best is None or r > best[0]):
                        best = (r, k, o)
        if best is None:
            return table
        table[best[1]] = best[2]


# Grid steps: at most STEP_MAX (a slot with almost no sensitivity still gets a usable code: error
# 0.33 of the vector's energy), and the fewest levels that span +-GRID_REACH standard deviations of the
# rotated coordinates (measured: +-3.5 leaves the error at step^2/12 within 0.1%; fewer levels clip).
STEP_MAX = 2.0
GRID_REACH = 3.5


def grid_bits(step: float, reach: float = GRID_REACH) -> tuple[int, int]:
    """(bits1, bits2) of the smallest grid of ``step`` spanning ``+-reach``: 2^(b1+b2) levels, stage 1
    up to 4 bits, at most 4+4 (a finer step than 2 * reach / 256 clips the tails)."""
    if not (isinstance(step, (int, float)) and math.isfinite(step) and step > 0):
        raise CodecConfigError(f"step must be a finite number > 0, got {step!r}")
    total = min(8, max(2, math.ceil(math.log2(2 * reach / step) - 1e-9)))
    return (min(4, total), total - min(4, total))


STEPS_PER_OCTAVE = 4


def ladder_step(step: float, per_octave: int = STEPS_PER_OCTAVE) -> float:
    """``step`` rounded to the nearest ``2^(k / per_octave)`` (4 significant digits)."""
    return float(f"{2.0 ** (round(math.log2(step) * per_octave) / per_octave):.4g}")


def allocate_steps(sens: Mapping[Slot, float], scale: float, step_max: float = STEP_MAX,
                   per_octave: int = STEPS_PER_OCTAVE) -> dict[Slot, float]:
    """Grid step per slot: ``scale / sqrt(sens / mean sens)``, at most ``step_max``, on a ladder of
    ``per_octave`` steps per octave (:func:`ladder_step`). The ladder is for the file: slots with one
    step share one quantizer map in the header (a 4+4 grid's tables take ~4.7 KB, 0.007 bits per
    coordinate of a 512-token SmolLM2 file each), and a step within 9% of the optimum costs <1% of KL."""
    if not sens:
        raise CodecConfigError("no slot sensitivities to allocate from")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise CodecConfigError(f"scale must be a finite number > 0, got {scale!r}")
    mean = sum(max(v, 0.0) for v in sens.values()) / len(sens)
    if not mean > 0:
        raise CodecConfigError("every slot sensitivity is zero: nothing to allocate from")
    out = {}
    for k, v in sens.items():
        d = step_max if v <= 0 else min(step_max, scale / math.sqrt(v / mean))
        out[k] = min(step_max, ladder_step(d, per_octave))
    return out


def load_profile(path) -> dict[Slot, float]:
    """Slot sensitivities ``{"slots": {"<layer>:k": kl, ...}}`` as written by tools/probe_sensitivity.py."""
    import json
    from pathlib import Path

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))["slots"]
        out = {(int(k.split(":")[0]), k.split(":")[1]): float(v) for k, v in raw.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise CodecConfigError(f"{path}: not a sensitivity profile ({type(e).__name__}: {e})") from None
    if any(s not in ("k", "v") or l < 0 or not v >= 0 for (l, s), v in out.items()):
        raise CodecConfigError(f"{path}: slots must be '<layer>:k|v' with non-negative sensitivities")
    return out
