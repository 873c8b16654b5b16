"""Bits per (layer, side) under an average budget, from measured sensitivity.

Sensitivity of a slot = mean token KL when only that slot is quantized with the probe setting and
everything else stays exact. Token KL grows about linearly with a small error, so a slot coded
with setting ``b`` is predicted to add ``sens * err(b) / err(probe)`` (``err``: the codec's
predicted relative error, data-free). Minimizing the predicted sum under the average budget is a
Lagrangian choice per slot (the lower convex hull of each slot's (bits, predicted KL) points),
then the leftover budget goes, best ratio first, to single upgrades.
"""

from __future__ import annotations

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
