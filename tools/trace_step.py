"""Where a decode step's time goes on the GPU: the device's own record of every kernel (CUPTI), beside the host's.

A step of an 8B-geometry model on the H200 is mostly host time (``bench_generation``: process CPU time per
step is ~the step's wall time, for mlx-lm's KVCache too), so a kernel that is faster alone need not make a
step faster. This tool answers, per arm and context, what the device did during a step: how long it was
busy (union of its kernels' intervals), how long it sat idle waiting for the host, which kernels took the
busy time (by class: rvqstore's, SDPA, matmuls, copies, elementwise), how many graph launches and API calls
the host made and what they cost it. Two ways of stepping:

- ``step``: one step built, then evaluated, then waited for (``bench_generation``'s step ms);
- ``stream``: mlx-lm's own ``generate_step`` loop (step t+1 built while the device runs step t).

    python tools/trace_step.py --arms kv,packed-2+2,packed-4+2,resident-2+2 --contexts 1024,32768,131072 \\
        --steps 6 --rounds 3 --json tools/results/trace-step-h200.json --md tools/results/trace-step-h200.md

Needs CUDA and ``libcupti.so.13`` (``tools/cupti_trace.py``: ``RVQSTORE_CUPTI``, ``.gpu/e/``, or the toolkit).
Tracing adds host time to every API call; its figures are for where time goes, ``bench_generation`` for speed.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import gc
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

import bench_generation as bg  # noqa: E402
from cupti_trace import Tracer, busy_ns  # noqa: E402

CLASSES = (  # first match wins; names are as the modules have them (mangled C++ for MLX's own kernels)
    ("rvq-attend", re.compile(r"rvq_attend|attend_mma|attend_merge", re.I)),
    ("rvq-append", re.compile(r"rvq_append|append", re.I)),
    ("rvq-other", re.compile(r"rvq", re.I)),
    ("sdpa", re.compile(r"sdpa|fmha|flash|attention", re.I)),
    ("matmul", re.compile(r"gemm|gemv|matmul|xmma|cutlass|sm90|ampere", re.I)),
    ("copy", re.compile(r"copy|slice|scatter|gather|concat", re.I)),
    ("norm/rope", re.compile(r"rms|norm|rope", re.I)),
    ("elementwise", re.compile(r"binary|unary|ternary|compiled|reduce|arg_|softmax", re.I)),
)


def kernel_class(name: str) -> str:
    for label, rx in CLASSES:
        if rx.search(name):
            return label
    return "other"


def summarize(acts, t_start, t_end, t_eval=None):
    """One window [t_start, t_end] of the trace: device busy/idle, kernels by class, host API calls."""
    kernels = [a for a in acts if a.kind in ("kernel", "memcpy", "memset") and t_start <= a.start <= t_end]
    api = [a for a in acts if a.kind in ("runtime", "driver") and t_start <= a.start <= t_end]
    busy = busy_ns([(a.start, a.end) for a in kernels])
    by_class, by_name, count = collections.Counter(), collections.Counter(), collections.Counter()
    for a in kernels:
        c = kernel_class(a.name) if a.kind == "kernel" else a.kind
        by_class[c] += a.end - a.start
        count[c] += 1
        by_name[a.name[:90] or a.kind] += a.end - a.start
    api_time, api_count = collections.Counter(), collections.Counter()
    for a in api:
        api_time[a.name] += a.end - a.start
        api_count[a.name] += 1
    out = {
        "wall_us": (t_end - t_start) / 1e3,
        "kernels": len(kernels),
        "busy_us": busy / 1e3,
        "first_kernel_us": ((kernels[0].start - (t_eval or t_start)) / 1e3) if kernels else None,
        "tail_us": ((t_end - max(a.end for a in kernels)) / 1e3) if kernels else None,
        "class_us": {k: v / 1e3 for k, v in by_class.most_common()},
        "class_count": dict(count),
        "top_kernels_us": {k: v / 1e3 for k, v in by_name.most_common(8)},
        "api_us": {k: v / 1e3 for k, v in api_time.most_common(8)},
        "api_count": {k: api_count[k] for k, _ in api_time.most_common(8)},
    }
    if kernels:
        first, last = kernels[0].start, max(a.end for a in kernels)
        out["span_us"] = (last - first) / 1e3
        out["idle_in_span_us"] = (last - first - busy) / 1e3
    return out


def median_of(rows, key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def merge_counters(rows, key):
    keys = set().union(*(r[key].keys() for r in rows))
    return {k: statistics.median([r[key].get(k, 0.0) for r in rows]) for k in sorted(keys)}


def reduce_rows(rows):
    out = {k: median_of(rows, k) for k in ("wall_us", "build_us", "eval_us", "kernels", "busy_us", "first_kernel_us",
                                             "tail_us", "span_us", "idle_in_span_us")}
    for k in ("class_us", "class_count", "api_us", "api_count"):
        out[k] = merge_counters(rows, k)
    out["top_kernels_us"] = merge_counters(rows, "top_kernels_us")
    out["top_kernels_us"] = dict(sorted(out["top_kernels_us"].items(), key=lambda kv: -kv[1])[:10])
    out["steps"] = len(rows)
    return out


def traced_steps(tracer, model, caches, token, n):
    marks = []
    for _ in range(n):
        mx.synchronize()
        t0 = tracer.now()
        logits = model(mx.array([[token % 1000]], dtype=mx.int32), cache=caches)[:, -1]
        y = mx.argmax(logits, axis=-1)
        t1 = tracer.now()
        mx.eval(y)
        t2 = tracer.now()
        token = int(y.item())
        marks.append((t0, t1, t2))
    mx.synchronize()
    tracer.flush()
    acts = tracer.take()
    rows = []
    for t0, t1, t2 in marks:
        r = summarize(acts, t0, t2, t_eval=t1)
        r["build_us"], r["eval_us"] = (t1 - t0) / 1e3, (t2 - t1) / 1e3
        rows.append(r)
    return rows, token


def traced_stream(tracer, model, caches, token, n):
    from mlx_lm.generate import generate_step

    mx.synchronize()
    tracer.take()
    marks = []
    for _ in generate_step(mx.array([token % 1000], dtype=mx.int32), model, max_tokens=n + 2, prompt_cache=caches):
        marks.append(tracer.now())
    mx.synchronize()
    tracer.flush()
    acts = tracer.take()
    rows = []
    for a, b in zip(marks[1:], marks[2:]):  # the first gap holds the prompt step
        r = summarize(acts, a, b)
        r["build_us"] = r["eval_us"] = None
        rows.append(r)
    return rows


def run(a):
    model, desc = bg.build_model(a)
    n_layers, kv_heads, head_dim = bg.geometry(model)
    dtype = getattr(mx, a.dtype)
    tracer = Tracer(api=not a.no_api)
    arms = a.arms.split(",")
    res = {"command": "python tools/trace_step.py " + " ".join(sys.argv[1:]),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "mlx": mx.__version__, "device": str(mx.default_device()), "model": desc, "cupti": tracer.version,
           "layers": n_layers, "contexts": {}}
    for n in [int(x) for x in a.contexts.split(",")]:
        caches = {}
        for arm in arms:
            cs = bg.make_caches(arm, n_layers)
            bg.fill(cs, n, kv_heads, head_dim, dtype)
            with bg.variant(arm):
                bg.step(model, cs, 1)
                bg.step(model, cs, 2)
                bg.stream(model, cs, 2, 3)
            caches[arm] = cs
        tracer.flush()
        tracer.take()
        step_rows = {arm: [] for arm in arms}
        stream_rows = {arm: [] for arm in arms}
        for r in range(a.rounds):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                with bg.variant(arm):
                    rows, _ = traced_steps(tracer, model, caches[arm], 3 + r, a.steps)
                    step_rows[arm] += rows
                    stream_rows[arm] += traced_stream(tracer, model, caches[arm], 7 + r, a.steps)
        res["contexts"][str(n)] = {arm: {"step": reduce_rows(step_rows[arm]), "stream": reduce_rows(stream_rows[arm])}
                                   for arm in arms}
        print(json.dumps({arm: {m: {k: v for k, v in d.items() if not isinstance(v, dict)} for m, d in x.items()}
                          for arm, x in res["contexts"][str(n)].items()}), flush=True)
        del caches
        gc.collect()
    tracer.close()
    return res


def fmt(x, nd=0):
    return "–" if x is None else f"{x:.{nd}f}"


def markdown(res):
    lines = [f"# Decode steps as the device saw them ({res['device']})", "",
             f"`{res['command']}` — {res['date']}; mlx {res['mlx']}; CUPTI {res['cupti']}; model: {res['model']}; "
             "batch 1. Medians over the traced steps (us). busy = union of the device's kernels and copies; idle = "
             "the gaps between the step's first and last kernel; first = from the start of the evaluation (step) or "
             "of the token (stream) to the first kernel; tail = after the last kernel until the host had the token.",
             "", "| context | arm | mode | wall | build | busy | idle in span | first | tail | kernels | rvq | sdpa | "
             "matmul | copy | other classes |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for n, arms in res["contexts"].items():
        for arm, modes in arms.items():
            for mode, r in modes.items():
                c = r["class_us"]
                rvq = sum(v for k, v in c.items() if k.startswith("rvq"))
                rest = ", ".join(f"{k} {v:.0f}" for k, v in c.items()
                                 if not k.startswith("rvq") and k not in ("sdpa", "matmul", "copy") and v >= 5)
                lines.append(f"| {n} | {arm} | {mode} | {fmt(r['wall_us'])} | {fmt(r['build_us'])} | "
                             f"{fmt(r['busy_us'])} | {fmt(r['idle_in_span_us'])} | {fmt(r['first_kernel_us'])} | "
                             f"{fmt(r['tail_us'])} | {fmt(r['kernels'])} | {rvq:.0f} | {c.get('sdpa', 0):.0f} | "
                             f"{c.get('matmul', 0):.0f} | {c.get('copy', 0):.0f} | {rest} |")
    lines += ["", "Host API calls per step (step mode, median us / count):", ""]
    for n, arms in res["contexts"].items():
        for arm, modes in arms.items():
            r = modes["step"]
            calls = ", ".join(f"{k} {v:.0f} us / {r['api_count'].get(k, 0):.0f}" for k, v in
                              sorted(r["api_us"].items(), key=lambda kv: -kv[1])[:5])
            lines.append(f"- {n} {arm}: {calls}")
    layers = res.get("layers")
    if layers:
        lines += ["", f"Attention-side kernels per layer (step mode, median us per step / {layers} layers):", ""]
        for n, arms in res["contexts"].items():
            for arm, modes in arms.items():
                per = {k: v / layers for k, v in modes["step"]["top_kernels_us"].items()
                       if kernel_class(k) in ("rvq-attend", "rvq-append", "rvq-other", "sdpa", "copy")}
                lines.append(f"- {n} {arm}: " + ", ".join(f"{kernel_class(k)} `{k[:32]}` {v:.1f}"
                                                           for k, v in per.items()))
    lines += ["", "Top kernels per step (step mode, median us):", ""]
    for n, arms in res["contexts"].items():
        for arm, modes in arms.items():
            tops = ", ".join(f"`{k[:60]}` {v:.0f}" for k, v in list(modes["step"]["top_kernels_us"].items())[:6])
            lines.append(f"- {n} {arm}: {tops}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random", choices=["random"])
    bg.add_geometry_args(ap)
    ap.add_argument("--arms", default="kv,packed-2+2,packed-4+2,resident-2+2")
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-api", action="store_true", help="kernels only (no runtime/driver API records)")
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args(argv)
    if not mx.cuda.is_available():
        print("needs MLX's CUDA backend", file=sys.stderr)
        return 2
    t = time.perf_counter()
    res = run(a)
    res["wall_s"] = time.perf_counter() - t
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    md = markdown(res)
    if a.md:
        Path(a.md).write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
