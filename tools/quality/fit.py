"""The fixed-width allocation target that lands at an on-disk budget, measured.

Saved files are smaller than the in-memory width (zstd finds the key mean's byte patterns and the
4-bit stage's uneven cells), and by how much depends on the settings the allocation picks. So the
target is not guessed from a rule: the allocation is made at a fixed-width target, the tuning texts'
cached halves are saved as real files (``compress="auto"``) and the largest target whose files all
stay within the budget is kept (bisection; the allocation is a step function of the target).
"""

from __future__ import annotations

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
