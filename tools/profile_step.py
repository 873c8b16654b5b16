"""Where a decode step's host time goes: graph building vs evaluation, per arm, and a cProfile.

A decode step of an mlx-lm model is host-bound on a fast GPU: building the lazy graph (Python, MLX
op calls, compiled-call replays) and evaluating it (one launch or more per primitive) cost more than
the GPU's work. This tool times the two halves of single-token steps separately (``build`` = the
model call without evaluation; ``eval`` = ``mx.eval`` of the next token), counts the graph's nodes
per layer (``mx.export_to_dot``), and with ``--profile`` prints the functions where a packed step's
building spends its time.

    python tools/profile_step.py --layers 32 --context 1024 --arms kv,packed-2+2 --profile
    python tools/profile_step.py --small   # a small geometry for a CPU (the build half is what counts)
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import pstats
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from tools.bench_generation import add_geometry_args, build_model, fill, geometry, make_caches  # noqa: E402


def primitives(arrays) -> collections.Counter:
    """The primitives (by name) of the lazy graph that evaluating ``arrays`` would run."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    return collections.Counter(re.findall(r'label ="([^"]+)"', buf.getvalue()))


class Clock:
    """Host time spent inside some methods (graph building: nothing is evaluated there)."""

    def __init__(self):
        self.ms = collections.defaultdict(float)
        self.undo = []

    def wrap(self, owner, name, label):
        f = getattr(owner, name)

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                self.ms[label] += (time.perf_counter() - t0) * 1e3

        setattr(owner, name, timed)
        self.undo.append((owner, name, f))

    def restore(self):
        for owner, name, f in reversed(self.undo):
            setattr(owner, name, f)


def micro(reps: int = 200) -> dict:
    """Calibration: host cost of evaluating one tiny primitive, a slice update, a custom-kernel-free
    chain; ms per primitive (build + eval), medians of 5."""
    out = {}
    a = mx.zeros((8, 1024, 64), mx.uint32)
    mx.eval(a)
    x = mx.ones((1, 8, 1, 128), mx.float16)
    mx.eval(x)

    def chain():
        y = x
        for _ in range(reps):
            y = y + 1
        return [y]

    src = [mx.full((8, 1, 64), i, mx.uint32) for i in range(reps)]
    mx.eval(src)

    def updates():
        for i in range(reps):
            a[:, i:i + 1] = src[i]
        return [a]

    def slices():
        return [a[:, i:i + 1] for i in range(reps)]

    arms = [("elementwise", chain), ("slice_update", updates), ("slice", slices)]
    from rvqstore import fused

    if fused.gpu_backend() == "cuda":
        body = "uint i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 1024u) out[i] = inp[i] + T(1);"
        k = mx.fast.cuda_kernel(name="profile_copy", input_names=["inp"], output_names=["out"], source=body,
                                header="typedef unsigned int uint;")

        def custom():
            y = mx.ones((1024,), mx.float16)
            for _ in range(reps):
                y = k(inputs=[y], template=[("T", mx.float16)], grid=(1024, 1, 1), threadgroup=(256, 1, 1),
                      output_shapes=[(1024,)], output_dtypes=[mx.float16])[0]
            return [y]

        arms.append(("custom_kernel", custom))
    for name, f in arms:
        ts, bs = [], []
        for _ in range(6):
            mx.synchronize()
            t0 = time.perf_counter()
            arrs = f()
            t1 = time.perf_counter()
            mx.eval(arrs)
            mx.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3 / reps)
            bs.append((t1 - t0) * 1e3 / reps)
        out[name] = {"ms_per_op": round(statistics.median(ts[1:]), 5),
                     "build_ms_per_op": round(statistics.median(bs[1:]), 5)}
    return out


def time_arm(model, caches, steps: int, tok0: int) -> dict:
    build, ev, total = [], [], []
    tok = tok0
    for _ in range(steps):
        mx.synchronize()
        t0 = time.perf_counter()
        logits = model(mx.array([[tok]], dtype=mx.int32), cache=caches)[:, -1]
        y = mx.argmax(logits, axis=-1)
        t1 = time.perf_counter()
        mx.eval(y)
        mx.synchronize()
        t2 = time.perf_counter()
        tok = int(y.item()) % 1000
        build.append((t1 - t0) * 1e3)
        ev.append((t2 - t1) * 1e3)
        total.append((t2 - t0) * 1e3)
    return {"build_ms": build, "eval_ms": ev, "total_ms": total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random")
    add_geometry_args(ap)
    ap.add_argument("--small", action="store_true", help="8 layers, hidden 512, MLP 1024, vocab 1024 (CPU)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--arms", default="kv,packed-2+2,resident-2+2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile the build of the RVQ arms' steps")
    ap.add_argument("--micro", action="store_true", help="also time single primitives (calibration)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.small:
        a.layers, a.hidden, a.intermediate, a.vocab = 8, 512, 1024, 1024
    model, desc = build_model(a)
    n_layers, kv_heads, head_dim = geometry(model)
    dtype = getattr(mx, a.dtype)
    arms = [x for x in a.arms.split(",") if x]
    caches = {}
    for arm in arms:
        cs = make_caches(arm, n_layers)
        fill(cs, a.context, kv_heads, head_dim, dtype)
        time_arm(model, cs, 3, 1)  # warm-up: compiles, first-use checks
        caches[arm] = cs
    from mlx_lm.models import cache as mlx_cache

    from rvqstore import RVQKVCache
    from rvqstore.attention import kernel

    clock = Clock()
    clock.wrap(RVQKVCache, "update_and_fetch", "rvq.update_and_fetch")
    clock.wrap(RVQKVCache, "attend_on_codes", "rvq.attend_on_codes")
    clock.wrap(kernel, "launch", "kernel.launch")
    clock.wrap(kernel, "merge", "kernel.merge")
    clock.wrap(mlx_cache.KVCache, "update_and_fetch", "kv.update_and_fetch")
    res = {arm: {"build_ms": [], "eval_ms": [], "total_ms": []} for arm in arms}
    parts = {arm: collections.defaultdict(float) for arm in arms}
    for r in range(a.rounds):
        for arm in (arms if r % 2 == 0 else arms[::-1]):
            clock.ms.clear()
            t = time_arm(model, caches[arm], a.steps, 3 + r)
            for k, v in clock.ms.items():
                parts[arm][k] += v / (a.steps * a.rounds)
            for k, v in t.items():
                res[arm][k] += v
    clock.restore()
    out = {"device": str(mx.default_device()), "model": desc, "context": a.context, "arms": {}}
    if a.micro:
        out["micro"] = micro()
        print(json.dumps({"micro": out["micro"]}), flush=True)
    for arm in arms:
        logits = model(mx.array([[7]], dtype=mx.int32), cache=caches[arm])
        prims = primitives([logits])
        mx.eval(logits)
        row = {k: round(statistics.median(v), 3) for k, v in res[arm].items()}
        row["build_parts_ms_per_step"] = {k: round(v, 3) for k, v in parts[arm].items()}
        row["primitives"] = sum(prims.values())
        row["primitives_per_layer"] = round(sum(prims.values()) / n_layers, 1)
        row["primitive_counts"] = dict(prims.most_common())
        out["arms"][arm] = row
        print(json.dumps({arm: row}), flush=True)
    if a.profile:
        for arm in arms:
            if arm == "kv":
                continue
            pr = cProfile.Profile()
            for i in range(20):
                pr.enable()
                logits = model(mx.array([[5 + i]], dtype=mx.int32), cache=caches[arm])
                pr.disable()
                mx.eval(logits)
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
            print(f"==== cProfile of 20 step builds, {arm} (tottime) ====\n" + s.getvalue()[:6000], flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
