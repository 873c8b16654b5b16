"""Host time to build a decode step's cache graph: one-token ``update_and_fetch`` per layer, per cache
kind and mode, nothing evaluated inside the timing. With ``--against TREE`` (a folder holding another
copy of the ``rvqstore`` package, e.g. ``git archive`` of an older commit) both are loaded side by
side and stepped in turns, alternating which goes first, so a refactor's before/after is read as
the median of per-step ratios on the same load; ``--against`` this very tree gives the noise floor.

    python tools/bench_step_build.py --rounds 20
    python tools/bench_step_build.py --rounds 20 --against /tmp/before --json tools/results/step-build-cpu.json

Each round: 32 one-token steps over 8 layers (8 KV heads, head dim 128, float16, 2+2 bits), then a
trim back; ``RVQKVCache`` holds 1,024 tokens, ``RVQRotatingKVCache(320, keep=4)`` 256. Round 0 is a
warm-up (compiled-call traces). Between steps the codes (and, resident, the returned copy) are
evaluated outside the timing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

import rvqstore  # noqa: E402

H, D, CTX, WINDOW, LAYERS, STEPS = 8, 128, 1024, 256, 8, 32
KINDS = ("packed", "resident", "rot-packed", "rot-resident")


def load_as(name: str, tree: Path):
    """The ``rvqstore`` package under ``tree``, imported as ``name`` (its imports are relative)."""
    pkg = tree / "rvqstore"
    spec = importlib.util.spec_from_file_location(name, pkg / "__init__.py", submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def make(m, kind: str) -> list:
    if kind.startswith("rot"):
        return [m.RVQRotatingKVCache(WINDOW + 64, 4, (2, 2), mode=kind[4:]) for _ in range(LAYERS)]
    return [m.RVQKVCache((2, 2), mode=kind) for _ in range(LAYERS)]


def run(packages: dict, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    k = mx.array(rng.standard_normal((1, H, CTX + STEPS, D)).astype(np.float16))
    v = mx.array(rng.standard_normal((1, H, CTX + STEPS, D)).astype(np.float16))
    steps = [(k[:, :, i:i + 1], v[:, :, i:i + 1]) for i in range(CTX, CTX + STEPS)]
    mx.eval(k, v, steps)
    names = list(packages)
    out = {}
    for kind in KINDS:
        fill = WINDOW if kind.startswith("rot") else CTX
        sets = {}
        for name, m in packages.items():
            sets[name] = make(m, kind)
            for c in sets[name]:
                c.update_and_fetch(k[:, :, :fill], v[:, :, :fill])
            mx.eval([c.state for c in sets[name]])
        times = {name: [] for name in names}
        for r in range(rounds + 1):
            for i, (kk, vv) in enumerate(steps):
                for name in (names if (r + i) % 2 == 0 else names[::-1]):
                    caches = sets[name]
                    t0 = time.perf_counter()
                    res = [c.update_and_fetch(kk, vv) for c in caches]
                    dt = (time.perf_counter() - t0) / LAYERS * 1e6
                    if r:
                        times[name].append(dt)
                    mx.eval([c.state for c in caches], res if "resident" in kind else [])
            for caches in sets.values():
                for c in caches:
                    c.trim(STEPS)
                mx.eval([c.state for c in caches])
        row = {f"{name}_us_per_layer": round(statistics.median(t), 2) for name, t in times.items()}
        if len(names) == 2:
            ratios = [b / a for a, b in zip(times[names[0]], times[names[1]])]
            row[f"median_ratio_{names[1]}_over_{names[0]}"] = round(statistics.median(ratios), 4)
        row["steps"] = len(times[names[0]])
        out[kind] = row
        print(kind, row, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--against", type=Path, help="a folder holding another copy of the rvqstore package")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    packages = {}
    if a.against is not None:
        packages["against"] = load_as("rvqstore_against", a.against.resolve())
    packages["this"] = rvqstore
    result = {"rounds": a.rounds, "against": None if a.against is None else str(a.against), "kinds": run(packages, a.rounds)}
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
