"""Loading a big prompt cache: ``.rvq`` files against mlx-lm's fp16 prompt-cache files, by bytes and seconds.

What a resume at long context costs before its first token is mostly this load (on an H200 at 32k the
first token takes ~20 ms of the 1-3 s). Caches of a model's geometry (default Llama-3-8B: 32 layers, 8 KV
heads, head dim 128, float16) are filled with random unit-variance keys and values (the codes of
Gaussian data, so zstd finds what it finds in real codes) and saved once per context:

- ``kv``: mlx-lm's ``save_prompt_cache`` of float16 ``KVCache``s; loaded with mlx-lm's
  ``load_prompt_cache`` and evaluated (its load is lazy: the bytes are read on evaluation);
- ``rvq-B auto`` / ``rvq-B raw``: ``rvqstore.save_prompt_cache`` with ``compress="auto"`` (the default:
  zstd where it saves >= 2 %) and ``"none"``; loaded with ``rvqstore.load_prompt_cache`` and evaluated,
  with sections read on ``rvqstore.format.reader.READ_THREADS`` threads (``tN``) and on one (``t1``).

Files sit in the page cache (each was read before; ``--cold`` also evicts every file before each of its
loads with ``posix_fadvise(DONTNEED)``). Method: one warm-up load per arm, then rounds interleaving the
arms in a rotated order; medians, and each arm's ratio to ``kv`` from the same run.

    python tools/bench_load.py --contexts 8192 --bits 2+2,4+2 --rounds 5 \\
        --json tools/results/load-cpu.json --md tools/results/load-cpu.md
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from rvqstore.blas import maybe_reexec_with_openblas  # noqa: E402

maybe_reexec_with_openblas()

import mlx.core as mx  # noqa: E402

import rvqstore  # noqa: E402
from bench_resume import evict  # noqa: E402
from rvqstore.format import reader  # noqa: E402

BLOCK = 4096


def _filled(make, n, layers, heads, dim, dtype, seed):
    caches = []
    for layer in range(layers):
        c = make()
        for s in range(0, n, BLOCK):  # every block its own draw (a repeated block would zstd away)
            t = min(BLOCK, n - s)
            kk, kv = mx.random.split(mx.random.key(seed + (layer << 20) + s))
            k = mx.random.normal((1, heads, t, dim), key=kk).astype(dtype)
            v = mx.random.normal((1, heads, t, dim), key=kv).astype(dtype)
            c.update_and_fetch(k, v)
        mx.eval(c.state)
        caches.append(c)
    return caches


def make_files(a, n: int, d: str) -> dict[str, str]:
    from mlx_lm.models.cache import KVCache, save_prompt_cache

    dtype = getattr(mx, a.dtype)
    files = {}
    path = os.path.join(d, f"kv-{n}.safetensors")
    save_prompt_cache(path, _filled(KVCache, n, a.layers, a.kv_heads, a.head_dim, dtype, 0))
    files["kv"] = path
    gc.collect()
    for bits in a.bits.split(","):
        b = tuple(int(x) for x in bits.split("+"))
        caches = _filled(lambda: rvqstore.RVQKVCache(b), n, a.layers, a.kv_heads, a.head_dim, dtype, 0)
        for comp, label in (("auto", "auto"), ("none", "raw")):
            path = os.path.join(d, f"rvq-{bits}-{label}-{n}.rvq")
            rvqstore.save_prompt_cache(path, caches, compress=comp)
            files[f"rvq-{bits} {label}"] = path
        del caches
        gc.collect()
    return files


def load_once(path: str, threads: int) -> float:
    mx.synchronize()
    t = time.perf_counter()
    if path.endswith(".safetensors"):
        from mlx_lm.models.cache import load_prompt_cache

        caches = load_prompt_cache(path)
    else:
        reader.READ_THREADS = threads
        caches = rvqstore.load_prompt_cache(path)
    mx.eval([c.state for c in caches])
    mx.synchronize()
    took = time.perf_counter() - t
    del caches
    gc.collect()
    return took


def run_context(a, n: int) -> dict:
    default_threads = reader.READ_THREADS
    with tempfile.TemporaryDirectory(dir=a.tmp) as d:
        files = make_files(a, n, d)
        arms = {"kv": (files["kv"], 1)}
        for name, path in files.items():
            if name != "kv":
                arms[f"{name} t{default_threads}"] = (path, default_threads)
                if default_threads > 1:
                    arms[f"{name} t1"] = (path, 1)
        times: dict[str, list[float]] = {k: [] for k in arms}
        names = list(arms)
        for name in names:  # warm-up: the page cache, MLX's allocator, the codecs' first use
            load_once(*arms[name])
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[: r % len(names)]:
                if a.cold:
                    evict(arms[name][0])
                times[name].append(load_once(*arms[name]))
        rows = {}
        for name, (path, threads) in arms.items():
            med = statistics.median(times[name])
            size = os.path.getsize(path)
            rows[name] = {"file_bytes": size, "threads": threads, "load_s": med, "gb_per_s": size / med / 1e9,
                          "times_s": times[name]}
        for r in rows.values():
            r["kv_over_this"] = rows["kv"]["load_s"] / r["load_s"]
        reader.READ_THREADS = default_threads
        return rows


def markdown(res: dict) -> str:
    lines = [f"# Loading big prompt caches ({res['device']}, {res['cpus']} CPUs)", "",
             f"`{res['command']}` — {res['date']}, {res['wall_s']:.0f} s wall; mlx {res['mlx']}; {res['geometry']}; "
             f"files {'evicted from' if res['cold'] else 'in'} the page cache. Medians of {res['rounds']} rounds, "
             "arms interleaved; `kv / this` = mlx-lm's fp16 file's load time over this arm's, same run.", "",
             "| context | arm | file MB | load s | GB/s of file | kv / this |", "|---:|---|---:|---:|---:|---:|"]
    for n, rows in res["contexts"].items():
        for arm, r in rows.items():
            lines.append(f"| {n} | {arm} | {r['file_bytes'] / 1e6:.1f} | {r['load_s']:.3f} | {r['gb_per_s']:.2f} | "
                         f"{r['kv_over_this']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="8192")
    ap.add_argument("--bits", default="2+2,4+2")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--json")
    ap.add_argument("--md")
    a = ap.parse_args(argv)
    t0 = time.time()
    res = {"command": "python tools/bench_load.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "mlx": mx.__version__, "device": str(mx.default_device()), "cpus": os.cpu_count(),
           "geometry": f"{a.layers} layers x {a.kv_heads} KV heads x head dim {a.head_dim}, {a.dtype}",
           "rounds": a.rounds, "cold": a.cold, "contexts": {}}
    for n in (int(x) for x in a.contexts.split(",")):
        res["contexts"][n] = run_context(a, n)
        print(json.dumps({n: {k: round(v["load_s"], 3) for k, v in res["contexts"][n].items()}}), flush=True)
    res["wall_s"] = time.time() - t0
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")
    if a.md:
        Path(a.md).write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
