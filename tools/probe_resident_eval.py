"""Where a resident cache's step update costs the host: MLX's evaluation of the append launch and the copy's writes.

tools/bench_append.py put resident caches' updates at 1.3-2.4 ms over KVCache's per 32 layers (before 2026-12-04's
fix: a full cache staged its first 16 steps' codes, unbound), packed ones at 0.2-0.3 ms, while the device's own record
(tools/trace_step.py) gives the resident append 4.5 us per layer. This probe splits an update's evaluation into the host's part (``mx.async_eval``: MLX encodes the graph) and the wait
for the device, for what is handed out (``out``) or only the append's count (``count``), interleaved by round.

    python tools/probe_resident_eval.py [--contexts 1024,32768] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rvqstore import RVQKVCache, decode_step  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from mlx_lm.models.cache import KVCache
    rng = np.random.default_rng(0)
    h, d, layers = 8, 128, a.layers
    sets = [[tuple(mx.array(rng.standard_normal((1, h, 1, d)).astype(np.float16)) for _ in range(2))
             for _ in range(layers)] for _ in range(4)]
    arms = {"kv/out": ("kv", "out"), "resident/out": ("resident", "out"), "resident/count": ("resident", "count"),
            "packed/count": ("packed", "count")}
    rows = []
    for n in (int(x) for x in a.contexts.split(",")):
        prompt = mx.array(rng.standard_normal((1, h, n, d)).astype(np.float16))
        caches = {}
        for name, (kind, _) in arms.items():
            cs = [KVCache() if kind == "kv" else RVQKVCache((2, 2), mode=kind) for _ in range(layers)]
            for c in cs:
                c.update_and_fetch(prompt, prompt)
            mx.eval([x for c in cs for x in c.state if isinstance(x, mx.array)])
            caches[name] = cs
        res = {name: {"build": [], "encode": [], "wait": []} for name in arms}

        def update(name, r):
            kind, need = arms[name]
            out = []
            t0 = time.perf_counter()
            for c, (k, v) in zip(caches[name], sets[r % len(sets)]):
                kk, vv = c.update_and_fetch(k, v)
                out += [kk, vv] if need == "out" else [c._keys._count]
            return time.perf_counter() - t0, out

        for r in range(a.rounds + 4):
            for name in arms:
                mx.synchronize()
                tb, out = update(name, r)
                t0 = time.perf_counter()
                mx.async_eval(out)
                t1 = time.perf_counter()
                mx.eval(out)
                mx.synchronize()
                t2 = time.perf_counter()
                del out
                if r >= 4:
                    for key, val in (("build", tb), ("encode", t1 - t0), ("wait", t2 - t1)):
                        res[name][key].append(val * 1e3)
        row = {"context": n, "stats": dict(decode_step.stats),
               "ms": {name: {k: round(statistics.median(v), 4) for k, v in m.items()} for name, m in res.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del caches
    if a.json:
        Path(a.json).write_text(json.dumps({"command": " ".join(sys.argv), "device": str(mx.default_device()),
                                            "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
