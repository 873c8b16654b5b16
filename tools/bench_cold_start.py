"""Cold start: a fresh process's first cache update and first attention on the codes.

Run it several times, each a fresh process: the first on a machine compiles rvqstore's CUDA kernels
with NVRTC and keeps them (and the verdicts of their first-use checks) in the kernel cache
(``rvqstore.kernel_cache``: ``RVQSTORE_KERNEL_CACHE``, default ``~/.cache/rvqstore/kernels``); later
processes load them from there. ``RVQSTORE_KERNEL_CACHE=off`` gives the old behaviour (MLX's JIT in
every process). Prints one JSON line: import time, the first ``update_and_fetch`` of a 1,024-token
block (encode + write, evaluated), the first ``attend_on_codes`` (evaluated), the same two calls again
(warm: the first one-token step), the median of ``--steps`` further one-token steps (update +
attention, evaluated), and what the kernel cache did (compiled, loaded, checks skipped), in seconds.

    python tools/bench_cold_start.py [--bits 2+2] [--heads 32 --kv-heads 8 --head-dim 128] [--steps 50] [--profile 25]

``--profile N`` also prints the N functions with the most cumulative time in the first update and the
first attention (cProfile), and the number of files in MLX's own CUDA kernel cache on disk
(``MLX_PTX_CACHE_DIR``, default ``<tmp>/mlx/<version>/ptx``) and in rvqstore's, before and after.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from rvqstore import RVQKVCache, kernel_cache  # noqa: E402

T_IMPORT = time.perf_counter() - T0


def _files(d) -> int:
    return sum(len(f) for _, _, f in os.walk(d)) if d and os.path.isdir(d) else -1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="2+2")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=0, help="then time this many warm one-token steps (median)")
    ap.add_argument("--profile", type=int, default=0, help="print the top N cumulative functions (cProfile)")
    a = ap.parse_args(argv)
    mlx_dir = os.environ.get("MLX_PTX_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "mlx", mx.__version__, "ptx")
    ours = kernel_cache.cache_dir()
    files_before = [_files(mlx_dir), _files(ours)]
    bits = tuple(int(x) for x in a.bits.split("+"))
    k = mx.random.normal((1, a.kv_heads, 1024, a.head_dim)).astype(mx.float16)
    v = mx.random.normal((1, a.kv_heads, 1024, a.head_dim)).astype(mx.float16)
    q = mx.random.normal((1, a.heads, 1, a.head_dim)).astype(mx.float16)
    k1 = mx.random.normal((1, a.kv_heads, 1, a.head_dim)).astype(mx.float16)
    mx.eval(k, v, q, k1)
    out = {"device": str(mx.default_device()), "bits": a.bits, "kernel_cache": str(ours) if ours else "off",
           "import_s": T_IMPORT}
    c = RVQKVCache(bits)
    prof = cProfile.Profile() if a.profile else None
    for tag in ("first", "warm"):
        if prof is not None and tag == "first":
            prof.enable()
        t0 = time.perf_counter()
        if tag == "first":
            c.update_and_fetch(k, v)
        else:
            c.update_and_fetch(k1, k1)
        mx.eval(c.state)
        t1 = time.perf_counter()
        mx.eval(c.attend_on_codes(q, scale=a.head_dim ** -0.5))
        t2 = time.perf_counter()
        if prof is not None and tag == "first":
            prof.disable()
        out[f"{tag}_update_s"], out[f"{tag}_attend_s"] = t1 - t0, t2 - t1
    out["first_total_s"] = out["first_update_s"] + out["first_attend_s"]
    if a.steps:
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            c.update_and_fetch(k1, k1)
            mx.eval(c.state, c.attend_on_codes(q, scale=a.head_dim ** -0.5))
            times.append(time.perf_counter() - t0)
        out["step_median_ms"] = 1e3 * statistics.median(times)
    out["kernel_cache_stats"] = dict(kernel_cache.stats)
    if a.profile:
        out["cache_files_mlx_ours"] = [files_before, [_files(mlx_dir), _files(ours)]]
    print(json.dumps(out))
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(a.profile)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
