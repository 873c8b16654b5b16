"""Cold start: a fresh process's first cache update and first attention on the codes.

Run it twice: the first process after installing may build the kernels (MLX's CUDA backend keeps
built kernels on disk), the second shows what every later process pays. Prints one JSON line:
import time, the first ``update_and_fetch`` of a 1,024-token block (encode + write, evaluated), the
first ``attend_on_codes`` (evaluated), and the same two calls again (warm), in seconds.

    python tools/bench_cold_start.py [--bits 2+2] [--heads 32 --kv-heads 8 --head-dim 128] [--profile 25]

``--profile N`` also prints the N functions with the most cumulative time in the first update and the
first attention (cProfile), and the number of files in MLX's CUDA kernel cache on disk
(``MLX_PTX_CACHE_DIR``, default ``<tmp>/mlx/<version>/ptx``) before and after: where a cold start goes.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from rvqstore import RVQKVCache  # noqa: E402

T_IMPORT = time.perf_counter() - T0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", default="2+2")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--profile", type=int, default=0, help="print the top N cumulative functions (cProfile)")
    a = ap.parse_args(argv)
    cache_dir = os.environ.get("MLX_PTX_CACHE_DIR") or os.path.join(tempfile.gettempdir(), "mlx", mx.__version__,
                                                                    "ptx")
    def cached() -> int:
        return len(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else -1
    files_before = cached()
    bits = tuple(int(x) for x in a.bits.split("+"))
    k = mx.random.normal((1, a.kv_heads, 1024, a.head_dim)).astype(mx.float16)
    v = mx.random.normal((1, a.kv_heads, 1024, a.head_dim)).astype(mx.float16)
    q = mx.random.normal((1, a.heads, 1, a.head_dim)).astype(mx.float16)
    k1 = mx.random.normal((1, a.kv_heads, 1, a.head_dim)).astype(mx.float16)
    mx.eval(k, v, q, k1)
    out = {"device": str(mx.default_device()), "bits": a.bits, "import_s": T_IMPORT}
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
    if a.profile:
        out["kernel_cache_files"] = [files_before, cached()]
    print(json.dumps(out))
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(a.profile)
        print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
