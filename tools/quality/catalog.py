"""The named groups of methods the evaluation can run (``--methods rvq,rotated,...``)."""

from __future__ import annotations

from . import methods as M
from .allocate import allocate, allocate_steps, load_profile  # noqa: F401 - load_profile: part of this module's surface

# The points from 3 to 6 bits, where the goals are (1+1, 4+4 and 8-bit affine were measured on two texts
# and left out of the four-text runs for CPU time: 1.1-1.4 token KL, and 2-3e-4, respectively).
RVQ_BITS = ((2, 1), (2, 2), (4, 1), (4, 2))
# group 128 does not exist at head dim 64 (mx.quantize groups along the head dim, as mlx-lm does)
ROTATED = ((2, 32), (3, 64), (3, 32), (4, 64), (4, 32), (5, 64), (5, 32))
AFFINE = ((4, 64),)
SIDES = (((2, 1), (1, 1)), ((2, 2), (1, 1)), ((4, 1), (2, 1)), ((4, 1), (2, 2)), ((4, 2), (2, 1)), ((4, 2), (2, 2)),
         ((4, 2), (4, 1)))
BUDGETS = (3.0, 4.5, 6.0)  # default fixed-width targets of the alloc group (the on-disk ones: --fit, rvqstore.presets)


# Uniform grids (entropy-coded, files saved with compress="best"): (key step, value step) pairs and
# allocation scales fitted to the on-disk budgets 3 / 4.5 / 6 (tools/results/quality-fit-smollm2.json).
GRID_SIDES: tuple[tuple[float, float], ...] = ()
GRID_SCALES: tuple[float, ...] = ()


def group(name: str, *, dim: int = 64, profile: dict | None = None,
          targets: tuple[float, ...] = BUDGETS, grid_sides: tuple[tuple[float, float], ...] | None = None,
          grid_scales: tuple[float, ...] | None = None) -> list[M.Method]:
    """``targets``: the fixed-width averages of the alloc groups (bits per coordinate in memory);
    ``grid_sides`` / ``grid_scales``: the settings of the grid / grid-alloc groups."""
    if name == "rvq":
        return [M.uniform(M.rvq(b, dim), "RVQ") for b in RVQ_BITS]
    if name == "rotated":
        return [M.uniform(M.rotated_affine(b, g, dim), f"rotated affine g{g}") for b, g in ROTATED]
    if name == "affine":
        return [M.uniform(M.affine(b, g, dim), "affine (mlx-lm)") for b, g in AFFINE]
    if name == "fp16":
        return [M.uniform(M.float16(), "float16")]
    r = lambda b: M.rvq(b, dim)  # noqa: E731
    if name == "variants":  # cheap wins on the 2+2 point: sink token exact, key centering, both
        base = M.uniform(r((2, 2)), "RVQ")
        return [M.variant(base, sink=1), M.variant(base, center_keys=True),
                M.variant(base, sink=1, center_keys=True)]
    if name == "sides":  # keys are the sensitive side: more bits there, fewer on values
        return [M.per_side(r(k), r(v), "RVQ per side") for k, v in SIDES]
    if name == "sides+":
        return [M.variant(M.per_side(r(k), r(v), "RVQ per side"), sink=1, center_keys=True) for k, v in SIDES]
    if name == "alloc":
        if profile is None:
            raise ValueError("--methods alloc needs --profile (tools/probe_sensitivity.py)")
        out = []
        for b in targets:
            table = allocate(profile, b)
            out.append(M.allocated(table, f"RVQ alloc {b:g}", "RVQ allocated", dim=dim))
        return out
    if name == "alloc+":  # the allocation plus the two cheap wins (evaluation only: not in the codec yet)
        if profile is None:
            raise ValueError("--methods alloc+ needs --profile (tools/probe_sensitivity.py)")
        return [M.variant(m, sink=1, center_keys=True) for m in group("alloc", dim=dim, profile=profile,
                                                                            targets=targets)]
    if name == "grid":  # a uniform grid per side (keys finer than values)
        return [M.grid_per_side(k, v, "grid per side", dim=dim) for k, v in (grid_sides or GRID_SIDES)]
    if name == "grid-alloc":  # a grid step per (layer, side) from the profile: scale / sqrt(sens / mean)
        if profile is None:
            raise ValueError("--methods grid-alloc needs --profile (tools/probe_sensitivity.py)")
        return [M.grid_allocated(allocate_steps(profile, s), f"grid alloc {s:g}", "grid allocated", dim=dim)
                for s in (grid_scales or GRID_SCALES)]
    if name in ("grid+", "grid-alloc+"):  # the grids plus the two codec-state wins (sink token exact, key mean)
        return [M.variant(m, sink=1, center_keys=True) for m in group(name[:-1], dim=dim, profile=profile,
                                                                            grid_sides=grid_sides,
                                                                            grid_scales=grid_scales)]
    raise ValueError(f"unknown method group {name!r}")
