"""Bits per (layer, side) under an average budget, from measured sensitivity.

Sensitivity of a slot = mean token KL when only that slot is quantized with the probe setting and
everything else stays exact. Token KL grows about linearly with a small error, so a slot coded
with setting ``b`` is predicted to add ``sens * err(b) / err(probe)`` (``err``: the codec's
predicted relative error, data-free). Minimizing the predicted sum under the average budget is a
Lagrangian choice per slot (the lower convex hull of each slot's (bits, predicted KL) points),
then the leftover budget goes, best ratio first, to single upgrades.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .methods import Slot, rvq, rvq_error

PROBE = (2, 1)
# Settings a slot may get (3-bit stages pack 10 codes per word, 3.5 bits each: never on the hull).
OPTIONS: tuple[tuple[int, int], ...] = ((1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 3), (4, 4))


def predicted(sens: Mapping[Slot, float], table: Mapping[Slot, tuple[int, int]], probe=PROBE) -> float:
    e0 = rvq_error(probe)
    return sum(s * rvq_error(table[k]) / e0 for k, s in sens.items())


def average_bits(table: Mapping[Slot, tuple[int, int]]) -> float:
    return sum(rvq(b).bits for b in table.values()) / len(table)


def allocate(sens: Mapping[Slot, float], budget: float, options: Sequence[tuple[int, int]] = OPTIONS,
             probe=PROBE) -> dict[Slot, tuple[int, int]]:
    """Settings per slot with average stored bits <= ``budget`` (bits per coordinate, norms counted)
    minimizing the predicted token KL."""
    cost = {o: rvq(o).bits for o in options}
    gain = {o: rvq_error(o) / rvq_error(probe) for o in options}
    cheapest = min(options, key=lambda o: cost[o])
    if cost[cheapest] > budget + 1e-9:
        raise ValueError(f"budget {budget} is below the cheapest setting ({cost[cheapest]} bits)")
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
