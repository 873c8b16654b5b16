"""Where the time goes on MLX's CPU backend: one layer's decode attention, and a resume, by phase.

Part 1, one attention layer of SmolLM2's geometry (9 query / 3 KV heads, head dim 64, float32, one
query), caches of random unit-variance keys/values at each context and bits:

- ``sdpa``: ``mx.fast.scaled_dot_product_attention`` on the decoded float32 keys/values (what a
  KVCache step runs), ``ops``: the MLX-ops formulation on the codes, ``host``: the numpy one
  (rvqstore.attention.host, what a packed cache runs on CPU);
- the host path's phases: ``inputs`` (evaluate and view the code streams), ``index`` (group-table
  indices of keys and values), ``gather`` (the table rows), ``matmul+softmax`` (scores, softmax,
  values, un-rotation: the rest);
- ``append``: one token into the layer (``update_and_fetch`` then ``trim``), RVQKVCache vs KVCache.

Part 2, a resume on the bundled model (``--resume-context`` tokens, files from random caches): an
``.rvq`` file (2+2 and 4+2, ``compress="auto"``) is ``open`` (preamble + header), ``read`` (every
section: checksum, zstd, copy into MLX), ``codecs`` (one per quantizer map), ``load`` (the whole
``load_prompt_cache``: reads, checks, caches), ``first step`` (one token through the model on the
loaded caches); mlx-lm's ``KVCache`` files the same way, as the model's float32 (``kv``) and cast
to float16 (``kv-fp16``, the issue's reference, as tools/bench_resume.py makes it); mlx-lm's load is
lazy, so its bytes are read during the first step.

Method: warm-up, arms interleaved round by round, medians of wall time and of process CPU time (all
threads; resists other load on a shared machine). Results: JSON + markdown.

    python tools/bench_resume_cpu.py --json tools/results/generation-cpu-profile.json \\
        --md tools/results/generation-cpu-profile.md
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rvqstore.blas import maybe_reexec_with_openblas  # noqa: E402

maybe_reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def timed_rounds(arms: dict, rounds: int, reps: int) -> dict:
    """``{arm: (median wall ms, median CPU ms)}``: each round runs every arm ``reps`` times, in
    alternating order."""
    for f in arms.values():
        f()
        f()
    wall = {k: [] for k in arms}
    cpu = {k: [] for k in arms}
    names = list(arms)
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            for _ in range(reps):
                t0, c0 = time.perf_counter(), time.process_time()
                arms[k]()
                wall[k].append((time.perf_counter() - t0) * 1e3)
                cpu[k].append((time.process_time() - c0) * 1e3)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in arms}


def layer_profile(n: int, bits: tuple, rounds: int, reps: int) -> dict:
    from mlx_lm.models.cache import KVCache

    from rvqstore import RVQKVCache
    from rvqstore.attention import host, ops

    hkv, group, d = 3, 3, 64
    mx.random.seed(n + bits[0])
    k, v = mx.random.normal((1, hkv, n, d)), mx.random.normal((1, hkv, n, d))
    cache, kv = RVQKVCache(bits), KVCache()
    K, V = cache.update_and_fetch(k, v)
    kv.update_and_fetch(K, V)
    mx.eval(K, V, cache.state, kv.state)
    q = mx.random.normal((1, hkv * group, 1, d))
    view = cache.codes_view()
    scale = d ** -0.5
    two = {"k": True, "v": True}
    consts = (host._codec_consts(view.key_codec, True), host._codec_consts(view.value_codec, True))
    a = {name: np.asarray(x) for name, x in host._inputs(view, q, None, None, two).items()}
    nk1 = mx.random.normal((1, hkv, 1, d))

    def inputs():
        lazy = host._inputs(view, q, None, None, two)
        mx.eval(list(lazy.values()))
        return {name: np.asarray(x) for name, x in lazy.items()}

    def index():
        for side, (codec, c) in (("k", (view.key_codec, consts[0])), ("v", (view.value_codec, consts[1]))):
            host._index(a[side + "1"], a[side + "2"], codec, c[1], -(-codec.dim // c[1]))

    idx = {}
    for side, (codec, c) in (("k", (view.key_codec, consts[0])), ("v", (view.value_codec, consts[1]))):
        idx[side] = host._index(a[side + "1"], a[side + "2"], codec, c[1], -(-codec.dim // c[1])).copy()

    def gather():
        for side, c in (("k", consts[0]), ("v", consts[1])):
            np.take(c[0], idx[side], axis=0, mode="clip")

    def whole_compute():
        with host.host_blas.one_thread():
            host._compute(view, a, consts, q.shape, scale, False, first=view.n_total - 1)

    def append_rvq():
        cache.update_and_fetch(nk1, nk1)
        mx.eval(cache.state)
        cache.trim(1)

    def append_kv():
        kv.update_and_fetch(nk1, nk1)
        mx.eval(kv.state)
        kv.trim(1)

    arms = {
        "sdpa": lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, K, V, scale=scale)),
        "ops": lambda: mx.eval(ops.attend(view, q, scale)),
        "host": lambda: mx.eval(host.attend(view, q, scale)),
        "host: inputs": inputs,
        "host: index": index,
        "host: gather": gather,
        "host: compute (index+gather+matmul+softmax)": whole_compute,
        "append rvq": append_rvq,
        "append kv": append_kv,
    }
    res = timed_rounds(arms, rounds, reps)
    return {k: {"wall_ms": w, "cpu_ms": c} for k, (w, c) in res.items()}


def to_fp16(caches: list) -> list:
    """mlx-lm KVCaches holding the same keys/values as float16 (the whole buffer, as mlx-lm saves it)."""
    from mlx_lm.models.cache import KVCache

    out = []
    for c in caches:
        n = KVCache()
        n.state = (c.keys.astype(mx.float16), c.values.astype(mx.float16), c.offset)
        out.append(n)
    mx.eval([c.keys for c in out], [c.values for c in out])
    return out


def resume_profile(n: int, rounds: int, tmp: str | None) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_generation as bg
    from mlx_lm.models.cache import load_prompt_cache as lm_load

    import rvqstore
    from rvqstore.format import open_rvq
    from rvqstore.model import load_model

    model, _ = load_model()
    n_layers, kv_heads, head_dim = bg.geometry(model)
    out = {}
    with tempfile.TemporaryDirectory(dir=tmp) as d:
        files = {}
        for arm in ("kv", "packed-2+2", "packed-4+2"):
            cs = bg.make_caches(arm, n_layers)
            bg.fill(cs, n, kv_heads, head_dim, mx.float32)
            files[arm] = os.path.join(d, arm + (".safetensors" if arm == "kv" else ".rvq"))
            out.setdefault(arm, {})["file_bytes"] = bg.save(arm, cs, files[arm])
            if arm == "kv":
                files["kv-fp16"] = os.path.join(d, "kv-fp16.safetensors")
                out["kv-fp16"] = {"file_bytes": bg.save("kv", to_fp16(cs), files["kv-fp16"])}
            del cs
            gc.collect()
        bg.step(model, lm_load(files["kv"]), 5)  # warm-up: compiles, first-use checks

        def phases(arm):
            path = files[arm]
            t = {}
            t0 = time.perf_counter()
            if arm.startswith("kv"):
                caches = lm_load(path)
                t["load"] = time.perf_counter() - t0
            else:
                with open_rvq(path) as f:
                    t["open"] = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    for layer in f.layers:
                        f.layer_arrays(layer, as_mx=True)
                    t["read"] = time.perf_counter() - t1
                    t1 = time.perf_counter()
                    for layer in f.layers:
                        f.codec_for(layer, "keys"), f.codec_for(layer, "values")
                    t["codecs"] = time.perf_counter() - t1
                t1 = time.perf_counter()
                caches = rvqstore.load_prompt_cache(path)
                t["load"] = time.perf_counter() - t1
            t1 = time.perf_counter()
            bg.step(model, caches, 5)
            t["first step"] = time.perf_counter() - t1
            t["resume (load + first step)"] = t["load"] + t["first step"]
            return t

        samples = {arm: [] for arm in files}
        for r in range(rounds + 1):
            for arm in (list(files) if r % 2 == 0 else list(files)[::-1]):
                gc.collect()
                t = phases(arm)
                if r:  # round 0 is a warm-up
                    samples[arm].append(t)
        for arm, ts in samples.items():
            for key in ts[0]:
                out[arm][key + " s"] = statistics.median(x[key] for x in ts)
        for arm in files:
            for ref in ("kv", "kv-fp16"):
                out[arm][f"{ref} resume / resume"] = (out[ref]["resume (load + first step) s"]
                                                      / out[arm]["resume (load + first step) s"])
    return out


def markdown(res: dict) -> str:
    lines = [f"# Where the time goes on the CPU: one attention layer and a resume ({res['device']})", "",
             f"`{res['command']}` — {res['date']}, {res['wall_s']:.0f} s wall; mlx {res['mlx']}; load average "
             f"{res['load_before']} before, {res['load_after']} after (2 cores, shared). Medians; ratios from this "
             "run. CPU ms = process CPU time (all threads).", "",
             "## One attention layer (9/3 heads, head dim 64, float32, one query)", "",
             "| context | bits | arm | wall ms | CPU ms | wall / sdpa |", "|---:|---|---|---:|---:|---:|"]
    for key, rows in res["layers"].items():
        n, bits = key.split(" ")
        base = rows["sdpa"]["wall_ms"]
        for arm, r in rows.items():
            lines.append(f"| {n} | {bits} | {arm} | {r['wall_ms']:.3f} | {r['cpu_ms']:.3f} | {r['wall_ms'] / base:.2f} |")
    lines += ["", f"## Resume of {res['resume_context']} tokens on the bundled SmolLM2 (seconds)", "",
              "| arm | file MB | phase | s |", "|---|---:|---|---:|"]
    for arm, r in res["resume"].items():
        for k, val in r.items():
            if k.endswith(" s"):
                lines.append(f"| {arm} | {r['file_bytes'] / 1e6:.1f} | {k[:-2]} | {val:.4f} |")
        for ref in ("kv", "kv-fp16"):
            lines.append(f"| {arm} | | {ref} resume / resume | {r[f'{ref} resume / resume']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--bits", default="2+2,4+2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--resume-context", type=int, default=4096)
    ap.add_argument("--resume-rounds", type=int, default=5)
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    a = ap.parse_args(argv)
    mx.set_default_device(mx.cpu)
    t0 = time.time()
    res = {"command": "python tools/bench_resume_cpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "device": str(mx.default_device()), "mlx": mx.__version__,
           "load_before": round(os.getloadavg()[0], 2), "layers": {}}
    for n in (int(x) for x in a.contexts.split(",")):
        for bits in a.bits.split(","):
            b = tuple(int(x) for x in bits.split("+"))
            res["layers"][f"{n} {bits}"] = layer_profile(n, b, a.rounds, a.reps)
            print(n, bits, json.dumps(res["layers"][f"{n} {bits}"]), flush=True)
    res["resume_context"] = a.resume_context
    res["resume"] = resume_profile(a.resume_context, a.resume_rounds, a.tmp)
    print(json.dumps(res["resume"]), flush=True)
    res["wall_s"] = time.time() - t0
    res["load_after"] = round(os.getloadavg()[0], 2)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    if a.md:
        Path(a.md).write_text(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
