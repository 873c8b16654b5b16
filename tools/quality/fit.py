"""The fixed-width allocation target that lands at an on-disk budget, measured.

Saved files are smaller than the in-memory width (zstd finds the key mean's byte patterns and the
4-bit stage's uneven cells), and by how much depends on the settings the allocation picks. So the
target is not guessed from a rule: the allocation is made at a fixed-width target, the tuning texts'
cached halves are saved as real files (``compress="auto"``) and the largest target whose files all
stay within the budget is kept (bisection; the allocation is a step function of the target).
Uniform grids (``fit_grid``): the same on a continuous parameter, the step or the allocation's scale,
measured for ``compress="best"`` (the rANS sections are what makes a grid small; while fitting, the
size is estimated from the "auto" file, ``disk_bits.best_from_auto``, and the evaluation measures the
real "best" file of the chosen setting).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from . import methods as M
from .allocate import allocate
from .disk_bits import rvq_bits_on_disk


def alloc_method(profile: dict, target: float, dim: int = 64) -> M.Method:
    return M.allocated(allocate(profile, target), f"RVQ alloc {target:g}", "RVQ allocated", dim=dim)


def fit_target(model: Any, tokenizer: Any, token_lists: Sequence[list[int]], profile: dict, budget: float, *,
               mode: str = "auto", span: float = 1.0, steps: int = 7, dim: int = 64,
               log: Callable[[str], None] = print) -> dict:
    """Largest fixed-width target in [budget, budget + span] (to 2^-steps of span, rounded down to a
    hundredth) whose allocation's files (one per token list: the cached halves) are all <= ``budget``
    bits per coordinate on disk. Returns {"target", "disk": [bits per list], "budget", "mode"}."""
    measured: dict[float, list[float]] = {}

    def disk(target: float) -> list[float]:
        if target not in measured:
            m = alloc_method(profile, target, dim)
            measured[target] = [rvq_bits_on_disk(model, tokenizer, ids, m, (mode,))[mode] for ids in token_lists]
            log(f"budget {budget:g}: fixed-width target {target:.2f} -> on disk {max(measured[target]):.3f} (max)")
        return measured[target]

    lo, hi = budget, budget + span
    if max(disk(lo)) > budget:
        raise ValueError(f"even the fixed-width target {budget} is over {budget} bits on disk")
    for _ in range(steps):
        mid = round((lo + hi) / 2, 2)
        if mid in (lo, hi):
            break
        if max(disk(mid)) <= budget:
            lo = mid
        else:
            hi = mid
    return {"budget": budget, "mode": mode, "target": lo, "disk": disk(lo),
            "tried": {f"{k:.2f}": max(v) for k, v in sorted(measured.items())}}


def fit_grid(model: Any, tokenizer: Any, token_lists: Sequence[list[int]], make: Callable[[float], M.Method],
             budget: float, guess: float, *, mode: str = "best~", tries: int = 6, slope: float = 0.9,
             log: Callable[[str], None] = print) -> dict:
    """The smallest grid parameter (a step, or the allocation's ``scale``: a larger one makes smaller
    files) whose files (one per token list, saved with ``mode``) are all <= ``budget`` bits per
    coordinate on disk. An entropy-coded grid's rate falls by about one bit per doubling of the step,
    so each try moves ``log2(param)`` by (measured - aim) / ``slope`` from the closest point so far
    (secant once two are known), aiming 0.004 bits under the budget; 4 significant digits. Returns
    {"param", "disk": [bits per list], "budget", "mode", "tried": {param: max bits}}."""
    measured: dict[float, list[float]] = {}
    aim = budget - 0.004

    def disk(p: float) -> float:
        if p not in measured:
            m = make(p)
            measured[p] = [rvq_bits_on_disk(model, tokenizer, ids, m, (mode,))[mode] for ids in token_lists]
            log(f"budget {budget:g}: {m.name} -> on disk {max(measured[p]):.3f} (max, {mode})")
        return max(measured[p])

    p = float(f"{guess:.4g}")
    for _ in range(tries):
        r = disk(p)
        pts = sorted(measured.items(), key=lambda kv: abs(max(kv[1]) - aim))
        if len(pts) >= 2 and abs(math.log2(pts[0][0] / pts[1][0])) > 1e-6:
            (pa, ra), (pb, rb) = pts[0], pts[1]
            s = (max(ra) - max(rb)) / (math.log2(pb) - math.log2(pa))  # bits per halving of the parameter
            s = min(max(s, 0.3), 1.5)
        else:
            s = slope
        best_p, best_r = pts[0][0], max(pts[0][1])
        nxt = float(f"{best_p * 2 ** ((best_r - aim) / s):.4g}")
        fitting = [q for q, v in measured.items() if max(v) <= budget]
        if nxt in measured or (fitting and 0 <= budget - disk(min(fitting)) < 0.01):
            break
        p = nxt
    fitting = [q for q, v in measured.items() if max(v) <= budget]
    if not fitting:
        raise ValueError(f"no grid parameter tried fits {budget} bits on disk: {sorted(measured.items())}")
    best = min(fitting)
    return {"budget": budget, "mode": mode, "param": best, "disk": measured[best],
            "tried": {f"{k:g}": max(v) for k, v in sorted(measured.items())}}
