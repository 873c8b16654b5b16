"""What the codec state (sink tokens + key mean, rvqstore.cache_state) costs a decode step and memory.

Arms: ``packed`` / ``resident`` RVQKVCache at 4+2, each plain and with ``sink_tokens=1,
center_keys=True`` (``+state``). Model: the bundled SmolLM2-135M in float32 on MLX's CPU backend (the
machine this runs on; a GPU run takes ``--device gpu``). Each arm's caches are prefilled with the same
``--context`` tokens of the bundled text; then rounds interleave the arms: in a round an arm runs
``--steps`` single-token decode steps (each evaluated) and trims back, so the context stays put.
Medians over all steps of all rounds (wall time, and process CPU time: steadier on a shared machine),
and the same-run ratios state / plain per mode. Whole-model steps on a busy shared machine move by
tens of percent from round to round, so the cost is also measured per layer (``--layer-reps``): one
SmolLM2-geometry layer (3 KV heads, GQA 3, head dim 64) at the same context, a single-token
``update_and_fetch`` plus its attention (on the codes in packed mode, SDPA on the returned arrays in
resident mode), evaluated, then trimmed back; arms interleaved in blocks of 5, medians. Memory: the
caches' ``nbytes`` and ``packed_nbytes`` summed over layers (the state: 1 sink token of keys and values
plus one key mean per head, float16).

    python tools/bench_cache_state.py --context 1024 --rounds 5 --steps 8 --json tools/results/cache-state-cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rvqstore.blas import maybe_reexec_with_openblas  # noqa: E402

maybe_reexec_with_openblas()

import mlx.core as mx  # noqa: E402

ARMS = {"packed": dict(mode="packed"), "packed+state": dict(mode="packed", sink_tokens=1, center_keys=True),
        "resident": dict(mode="resident"), "resident+state": dict(mode="resident", sink_tokens=1, center_keys=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--layer-reps", type=int, default=200)
    ap.add_argument("--json")
    a = ap.parse_args()
    mx.set_default_device(mx.cpu if a.device == "cpu" else mx.gpu)

    from importlib import resources

    from rvqstore import RVQKVCache
    from rvqstore.model import load_model

    layer = layer_steps(RVQKVCache, a.context, a.layer_reps)

    model, tok = load_model()
    text = resources.files("rvqstore").joinpath("data/python_docs_excerpt.txt").read_text(encoding="utf-8")
    ids = tok.encode(text)
    while len(ids) < a.context + a.steps + 1:
        ids = ids + ids
    prompt = mx.array(ids[:a.context])[None]
    nxt = ids[a.context:a.context + a.steps]

    caches = {}
    for name, kw in ARMS.items():
        cs = [RVQKVCache((4, 2), **kw) for _ in model.layers]
        for s in range(0, a.context, 512):  # prefill in chunks, as mlx-lm does
            mx.eval(model(prompt[:, s:s + 512], cache=cs))
        caches[name] = cs

    def run(cs) -> list[tuple[float, float]]:
        times = []
        for t in nxt:
            t0, c0 = time.perf_counter(), time.process_time()
            mx.eval(model(mx.array([[t]]), cache=cs))
            times.append((time.perf_counter() - t0, time.process_time() - c0))
        for c in cs:
            c.trim(len(nxt))
        return times

    for cs in caches.values():  # warm-up: compiles, first-use checks
        run(cs)
    steps = {name: [] for name in ARMS}
    for _ in range(a.rounds):
        for name, cs in caches.items():
            steps[name] += run(cs)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "model": "SmolLM2-135M float32", "device": a.device, "context": a.context, "rounds": a.rounds,
           "steps": a.steps, "bits": [4, 2], "arms": {}}
    for name, cs in caches.items():
        res["arms"][name] = {"step_ms_median": 1e3 * statistics.median(w for w, _ in steps[name]),
                             "cpu_ms_median": 1e3 * statistics.median(c for _, c in steps[name]),
                             "nbytes": sum(c.nbytes for c in cs), "packed_nbytes": sum(c.packed_nbytes for c in cs)}
    res["layer"] = layer
    for mode in ("packed", "resident"):
        for what in ("step_ms_median", "cpu_ms_median"):
            res[f"{mode}_state_over_plain_{what[:-7]}"] = res["arms"][f"{mode}+state"][what] / res["arms"][mode][what]
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


def layer_steps(cache_cls, context: int, reps: int) -> dict:
    """Median wall/CPU microseconds of one layer's decode step per arm (see the module docstring)."""
    import numpy as np

    rng = np.random.default_rng(0)
    b, h, d, g = 1, 3, 64, 3

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    caches = {}
    for name, kw in ARMS.items():
        c = cache_cls((4, 2), **kw)
        c.update_and_fetch(arr(b, h, context, d), arr(b, h, context, d))
        caches[name] = c
    k1, v1, q = arr(b, h, 1, d), arr(b, h, 1, d), arr(b, h * g, 1, d)
    mx.eval(k1, v1, q)

    def step(c) -> tuple[float, float]:
        t0, p0 = time.perf_counter(), time.process_time()
        k, v = c.update_and_fetch(k1, v1)
        out = c.attend_on_codes(q, scale=0.125)
        if out is None:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125)
        mx.eval(out)
        took = (time.perf_counter() - t0, time.process_time() - p0)
        c.trim(1)
        return took

    for c in caches.values():
        for _ in range(20):
            step(c)
    got = {n: [] for n in caches}
    for _ in range(max(1, reps // 5)):
        for n, c in caches.items():
            got[n] += [step(c) for _ in range(5)]
    res = {n: {"wall_us_median": 1e6 * statistics.median(w for w, _ in r),
               "cpu_us_median": 1e6 * statistics.median(p for _, p in r)} for n, r in got.items()}
    for mode in ("packed", "resident"):
        res[f"{mode}_state_over_plain_wall"] = res[f"{mode}+state"]["wall_us_median"] / res[mode]["wall_us_median"]
    return res


if __name__ == "__main__":
    main()
