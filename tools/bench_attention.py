"""Attention alone: attention on the packed codes vs mx.fast.scaled_dot_product_attention on fp16 K/V.

One layer of a given geometry (default Llama-3-8B: 32 query heads, 8 KV heads, head dim 128), batch 1,
one query (a decode step), caches filled with random keys/values to each context. Arms, interleaved
round by round: ``sdpa`` (mlx fast SDPA over fp16 K/V of the context), ``codes-2+2`` / ``codes-4+2``
(``RVQKVCache.attend_on_codes``: the split-K kernel, which rotates the queries, and the merge kernel,
which un-rotates), and with ``--breakdown`` on a GPU the split and merge kernels launched alone. Each
sample times ``k`` calls issued back to back (one sync), divided by ``k``; the arms' order rotates from round
to round; medians over rounds (``ms``). A
second sample of each arm builds its ``k`` calls first and times their evaluation alone (``eval_ms``: the
GPU's work and MLX's per-launch cost, without the Python that builds a call; what a decode step pays when its
host build overlaps the GPU). ``mma-kernel-*`` (with ``--breakdown``): the tensor-core split kernel alone.
``--layers N`` (default 1): N caches (and N fp16 K/V sets) per arm, each call the next one, as a model's layers
read theirs: with one, back-to-back calls re-read the same memory, and a 2+2 cache of 32k tokens (34 MB) sits in
the H200's 50 MB L2 while SDPA's fp16 K/V (134 MB) does not. Variants, breakdown, probes and the timeline use
the first cache.

    python tools/bench_attention.py [--contexts 1024,8192,32768,131072] [--json out.json]
    python tools/bench_attention.py --contexts 32768,131072 --bits 2+2 --target-groups 528,1056,2112,4224
    python tools/bench_attention.py --contexts 32768,131072 --variants first,nopair   # same-run kernel variants

Variants (``--variants``, timed as extra arms of the first bits): see tools/kernel_variants.py (``first``: the
first kernel's layout; ``nopair``, ``nostage``, ``klN``).
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

from rvqstore import RVQKVCache, fused  # noqa: E402
from rvqstore.attention import kernel, kernel_mma, launch_args  # noqa: E402

import kernel_variants  # noqa: E402  (tools/)


def _timeline(view, qs, hkv, hq, d, probe: int, calls: int = 5) -> dict:
    """Medians over ``calls`` launches of the tensor-core kernel's clocks (ns, warp 0 of each threadgroup):
    the kernel's span (first entry to last exit), per threadgroup setup / loop / merge, entry spread."""
    spans, setup, loop, loop_max, tail, spread = [], [], [], [], [], []
    for i in range(calls):
        kernel_mma.PROBE = probe
        try:
            o, _ = kernel_mma.launch(view, qs[i % len(qs)], 1, False, d ** -0.5)
        finally:
            kernel_mma.PROBE = 0
        mx.eval(o)
        t = _clocks(o)
        t = (t - t[:, :1].min()) % (1 << 32)  # relative to the first entry (low 32 bits of ns wrap)
        spans.append(int(t[:, 3].max()))
        setup.append(float(np.median(t[:, 1] - t[:, 0])))
        loop.append(float(np.median(t[:, 2] - t[:, 1])))
        loop_max.append(int((t[:, 2] - t[:, 1]).max()))
        tail.append(float(np.median(t[:, 3] - t[:, 2])))
        spread.append(int(t[:, 0].max()))
    med = statistics.median
    return {"threadgroups": int(t.shape[0]), "span_us": med(spans) / 1e3, "setup_us": med(setup) / 1e3,
            "loop_us": med(loop) / 1e3, "loop_max_us": med(loop_max) / 1e3, "merge_us": med(tail) / 1e3,
            "entry_spread_us": med(spread) / 1e3}


def _clocks(o) -> np.ndarray:
    t = np.array(o[:, :, 0, :4]).view(np.uint32).astype(np.int64).reshape(-1, 4)
    return t


def _timeline_pair(view, qs, hkv, hq, d, flush_mb: int, calls: int = 5) -> dict:
    """Probe 4 twice in a row: a launch right after ``flush_mb`` MB streamed through the device (the model's
    matmuls stream its weights between two layers' attention: what L2 held is gone), then the same launch again
    right after it (only a one-element ``where`` between them). Per launch: the threadgroups' setup / loop /
    merge and the launch's span (medians over ``calls``). Where the second launch's fixed costs fall, what the
    first paid was its code and data being fetched again, not its work."""
    flush = mx.zeros((flush_mb << 18,), dtype=mx.float32)
    mx.eval(flush)
    rows = {"cold": [], "warm": []}
    for i in range(calls):
        q = qs[i % len(qs)]
        kernel_mma.PROBE = 4
        try:
            f = (flush + 1.0).sum()  # every byte of the flush read once, then the first launch
            o1, _ = kernel_mma.launch(view, mx.where(mx.isnan(f), q, q), 1, False, d ** -0.5)
            o2, _ = kernel_mma.launch(view, mx.where(mx.isnan(o1[0, 0, 0, 0]), q, q), 1, False, d ** -0.5)
        finally:
            kernel_mma.PROBE = 0
        mx.eval(o1, o2)
        for key, o in (("cold", o1), ("warm", o2)):
            t = _clocks(o)
            t = (t - t[:, :1].min()) % (1 << 32)
            rows[key].append((int(t[:, 3].max()), float(np.median(t[:, 1] - t[:, 0])),
                              float(np.median(t[:, 2] - t[:, 1])), float(np.median(t[:, 3] - t[:, 2]))))
    med = statistics.median
    return {key: {"span_us": med(r[0] for r in v) / 1e3, "setup_us": med(r[1] for r in v) / 1e3,
                  "loop_us": med(r[2] for r in v) / 1e3, "merge_us": med(r[3] for r in v) / 1e3}
            for key, v in rows.items()} | {"flush_mb": flush_mb}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,8192,32768,131072")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--bits", default="2+2,4+2")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--breakdown", action="store_true", help="also time the split and merge kernels alone")
    ap.add_argument("--target-groups", default="", help="comma list: also time the first bits' codes arm with "
                    "launch_args.TARGET_GROUPS set to each (threadgroups per launch the split plan aims at)")
    ap.add_argument("--variants", default="", help="comma list of kernel variants (see above)")
    ap.add_argument("--probes", default="", help="with --breakdown: also time the tensor-core kernel with parts "
                    "switched off (kernel_mma.PROBE: 1 no code loads, 2 no table reads, 3 neither; wrong results)")
    ap.add_argument("--timeline", action="store_true", help="CUDA: the tensor-core kernel's own clock per threadgroup "
                    "(probe 4: entry, loop start, loop end, exit; with 5/6/7 also probes 1/2/3; probe 4 again "
                    "under each --variants entry), first bits")
    ap.add_argument("--timeline-pair", type=int, default=0, metavar="MB", help="with --timeline: also probe 4 "
                    "after MB megabytes streamed through the device and again right after (cold / warm launch)")
    ap.add_argument("--mma-targets", default="", help="with --breakdown: also time the tensor-core kernel alone "
                    "with kernel_mma.TARGET_GROUPS set to each (comma list)")
    ap.add_argument("--layers", type=int, default=1, help="caches per arm, called in turn (see above)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    if a.layers < 1:
        raise SystemExit("--layers must be at least 1")
    hq, hkv, d = a.heads, a.kv_heads, a.head_dim
    default_groups = launch_args.TARGET_GROUPS
    out = {"device": str(mx.default_device()), "geometry": [hq, hkv, d], "layers": a.layers, "rows": []}
    for n in (int(x) for x in a.contexts.split(",")):
        mx.random.seed(n)
        kvs = []
        for _ in range(a.layers):
            kvs.append((mx.random.normal((1, hkv, n, d)).astype(mx.float16),
                        mx.random.normal((1, hkv, n, d)).astype(mx.float16)))
            mx.eval(kvs[-1])
        k, v = kvs[0]
        qs = [mx.random.normal((1, hq, 1, d)).astype(mx.float16) for _ in range(4)]
        turn = [0]  # the cache (layer) the next call of a rotating arm takes

        def rotating(calls):
            def f(q):
                i = turn[0] = (turn[0] + 1) % len(calls)
                return calls[i](q)
            return f

        arms = {"sdpa": rotating([(lambda k, v: lambda q: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=d ** -0.5))(k_, v_) for k_, v_ in kvs])}
        arms_views = []
        for bits in a.bits.split(","):
            b = tuple(int(x) for x in bits.split("+"))
            layers = []
            for k_, v_ in kvs:
                c = RVQKVCache(b)
                for s in range(0, n, 4096):  # fill in blocks (what a chunked prefill does)
                    c.update_and_fetch(k_[:, :, s:s + 4096], v_[:, :, s:s + 4096])
                mx.eval(c.state)
                layers.append(c)
            c = layers[0]
            arms[f"codes-{bits}"] = rotating([(lambda c: lambda q: c.attend_on_codes(q, scale=d ** -0.5))(c_)
                                              for c_ in layers])
            for tg in (int(x) for x in a.target_groups.split(",") if x and bits == a.bits.split(",")[0]):
                def sweep(q, c=c, tg=tg):
                    launch_args.TARGET_GROUPS = tg
                    try:
                        return c.attend_on_codes(q, scale=d ** -0.5)
                    finally:
                        launch_args.TARGET_GROUPS = default_groups
                arms[f"codes-{bits}-tg{tg}"] = sweep
            for var in (x for x in a.variants.split(",") if x and bits == a.bits.split(",")[0]):
                arms[f"codes-{bits}-{var}"] = (lambda c, var: lambda q: kernel_variants.run(
                    var, lambda: c.attend_on_codes(q, scale=d ** -0.5)))(c, var)
            dialect = fused.gpu_backend()
            if bits == a.bits.split(",")[0]:
                arms_views.append(c.codes_view())
            if a.breakdown and dialect and bits == a.bits.split(",")[0]:
                # the two launches alone (no Python dispatch around them): where the time goes
                view = c.codes_view()
                split = (lambda view: lambda q: kernel.launch(view, q.reshape(1, hkv, hq // hkv, d), 1, False,
                                                              dialect, scale=d ** -0.5))(view)
                o, ml = split(qs[0])
                mx.eval(o, ml)
                arms[f"split-kernel-{bits}"] = split
                arms[f"merge-kernel-{bits}"] = (lambda view, o, ml: lambda q: kernel.merge(
                    view, o, ml, (1, hq, 1, d), q.dtype, dialect))(view, o, ml)
                if kernel_mma.takes(view, hq // hkv, mx.float16, dialect):
                    for probe in [0] + [int(x) for x in a.probes.split(",") if x]:
                        def mma(q, view=view, probe=probe):
                            kernel_mma.PROBE = probe
                            try:
                                return kernel_mma.launch(view, q, 1, False, d ** -0.5)
                            finally:
                                kernel_mma.PROBE = 0
                        arms[f"mma-kernel-{bits}" + (f"-probe{probe}" if probe else "")] = mma
                    for tg in (int(x) for x in a.mma_targets.split(",") if x):
                        def mma_tg(q, view=view, tg=tg):
                            old, kernel_mma.TARGET_GROUPS = kernel_mma.TARGET_GROUPS, tg
                            try:
                                return kernel_mma.launch(view, q, 1, False, d ** -0.5)
                            finally:
                                kernel_mma.TARGET_GROUPS = old
                        arms[f"mma-kernel-{bits}-tg{tg}"] = mma_tg
        timeline = {}
        if a.timeline and dialect == "cuda":
            view = arms_views[0] if arms_views else None
            for probe in (4, 5, 6, 7) if view is not None else ():
                timeline[f"probe{probe}"] = _timeline(view, qs, hkv, hq, d, probe)
            if a.timeline_pair and view is not None:
                timeline["pair"] = _timeline_pair(view, qs, hkv, hq, d, a.timeline_pair)
            for var in (x for x in a.variants.split(",") if x and view is not None):  # probe 4 under each variant
                timeline[f"probe4-{var}"] = kernel_variants.run(var, lambda: _timeline(view, qs, hkv, hq, d, 4))
        times = {name: [] for name in arms}
        evals = {name: [] for name in arms}
        for name, f in arms.items():  # warm up: compile, first-use checks
            mx.eval(f(qs[0]))
        names = list(arms)
        for r in range(a.rounds):
            # the arms' order rotates from round to round: no arm always runs right after the same one
            for name in names[r % len(names):] + names[:r % len(names)]:
                f = arms[name]
                mx.synchronize()
                t0 = time.perf_counter()
                outs = [f(qs[(r + i) % len(qs)]) for i in range(a.k)]
                mx.eval(outs)
                mx.synchronize()
                times[name].append((time.perf_counter() - t0) / a.k * 1e3)
                # the same calls, the graph built first: the evaluation alone (the GPU's work and MLX's
                # per-launch cost, without the Python that builds the calls)
                outs = [f(qs[(r + i + 1) % len(qs)]) for i in range(a.k)]
                mx.synchronize()
                t0 = time.perf_counter()
                mx.eval(outs)
                mx.synchronize()
                evals[name].append((time.perf_counter() - t0) / a.k * 1e3)
        row = {"context": n, "timeline": timeline, "ms": {name: statistics.median(t) for name, t in times.items()},
               "eval_ms": {name: statistics.median(t) for name, t in evals.items()}}
        row["speedup_vs_sdpa"] = {name: row["ms"]["sdpa"] / ms for name, ms in row["ms"].items()
                                  if name.startswith("codes")}
        row["eval_speedup_vs_sdpa"] = {name: row["eval_ms"]["sdpa"] / ms for name, ms in row["eval_ms"].items()
                                       if name != "sdpa"}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        del k, v, kvs, arms
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
