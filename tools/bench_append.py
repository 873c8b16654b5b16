"""A decode step's cache updates alone: mlx-lm's KVCache against RVQKVCache packed and resident.

What a model's step asks of its caches before attention, per layer: take the new token's keys and values and
hand back what attention reads. ``kv``: mlx-lm's KVCache (two slice updates, two slices); ``packed-B``: the
in-place append launch (attention reads the codes; the decode it hands back is built, never evaluated, as in a
served step); ``resident-B``: the in-place append that also decodes the token, two slice updates into the
decoded copy, two slices. ``ARM@VARIANT`` runs an arm with a setting of tools/kernel_variants.py (e.g.
``resident-2+2@noinplace``: codes staged, the step not bound). ``--layers`` caches per arm (default 32, one
model's), filled to each context with random fp16 vectors, then warmed up with single steps (so steady steps
are bound). A sample builds one update of every layer (``build_ms``) and then evaluates what attention would
read (``eval_ms``: packed, the count the append hands out; kv and resident, the arrays handed back); arms are
interleaved round by round, the new tokens rotate over a few sets; medians, and ratios to ``kv`` of the same run.

    python tools/bench_append.py [--contexts 1024,32768] [--arms kv,packed-2+2,resident-2+2] [--json out.json]
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

from rvqstore import RVQKVCache  # noqa: E402

import kernel_variants  # noqa: E402  (tools/)


def _make(arm: str):
    name = arm.split("@")[0]
    if name == "kv":
        from mlx_lm.models.cache import KVCache

        return KVCache()
    mode, bits = name.split("-")
    b1, b2 = (int(x) for x in bits.split("+"))
    return RVQKVCache((b1, b2), mode=mode)


def _update(caches, arm: str, toks) -> tuple[float, list]:
    """One update of every layer: (build seconds, what attention would read)."""
    packed = arm.startswith("packed")
    need = []
    t0 = time.perf_counter()
    for c, (k, v) in zip(caches, toks):
        kk, vv = c.update_and_fetch(k, v)
        if not packed:
            need += [kk, vv]
        elif c._keys._count is not None:  # written in place: the count orders attention after the write
            need.append(c._keys._count)
        else:  # the buffers attention reads
            need += [x for x in c._keys.live()[0] + c._values.live()[0] if x is not None]
    return time.perf_counter() - t0, need


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--arms", default="kv,packed-2+2,resident-2+2,packed-4+2,resident-4+2")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    arms = a.arms.split(",")
    h, d, layers = a.kv_heads, a.head_dim, a.layers
    rng = np.random.default_rng(0)
    sets = [[tuple(mx.array(rng.standard_normal((1, h, 1, d)).astype(np.float16)) for _ in range(2))
             for _ in range(layers)] for _ in range(4)]
    rows = []
    for n in (int(x) for x in a.contexts.split(",")):
        prompt = mx.array(rng.standard_normal((1, h, n, d)).astype(np.float16))
        caches = {}
        for arm in arms:
            variant = arm.split("@")[1] if "@" in arm else "default"
            old = kernel_variants.apply(variant)
            try:
                cs = [_make(arm) for _ in range(layers)]
                for c in cs:
                    c.update_and_fetch(prompt, prompt)
                mx.eval([x for c in cs for x in c.state if isinstance(x, mx.array)])
                for i in range(a.warmup):
                    _, need = _update(cs, arm, sets[i % len(sets)])
                    mx.eval(need)
                    del need
            finally:
                kernel_variants.restore(old)
            caches[arm] = cs
        build, evals = {arm: [] for arm in arms}, {arm: [] for arm in arms}
        for r in range(a.rounds):
            for arm in arms:
                variant = arm.split("@")[1] if "@" in arm else "default"
                old = kernel_variants.apply(variant)
                try:
                    mx.synchronize()
                    tb, need = _update(caches[arm], arm, sets[r % len(sets)])
                    t0 = time.perf_counter()
                    mx.eval(need)
                    mx.synchronize()
                    te = time.perf_counter() - t0
                    del need
                finally:
                    kernel_variants.restore(old)
                build[arm].append(tb * 1e3)
                evals[arm].append(te * 1e3)
        row = {"context": n, "build_ms": {k: statistics.median(v) for k, v in build.items()},
               "eval_ms": {k: statistics.median(v) for k, v in evals.items()}}
        row["total_ms"] = {k: row["build_ms"][k] + row["eval_ms"][k] for k in arms}
        if "kv" in arms:
            row["over_kv_ms"] = {k: row["total_ms"][k] - row["total_ms"]["kv"] for k in arms}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del caches, prompt
    out = {"command": "python tools/bench_append.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "what": __doc__.split("\n\n")[1].replace("\n", " "), "device": str(mx.default_device()),
           "layers": layers, "kv_heads": h, "head_dim": d, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
