"""Cold start: a fresh process's first cache update and first attention on the codes.

Run it twice: the first process after installing may build the kernels (MLX's CUDA backend keeps
built kernels on disk), the second shows what every later process pays. Prints one JSON line:
import time, the first ``update_and_fetch`` of a 1,024-token block (encode + write, evaluated), the
first ``attend_on_codes`` (evaluated), and the same two calls again (warm), in seconds.

    python tools/bench_cold_start.py [--bits 2+2] [--heads 32 --kv-heads 8 --head-dim 128]
"""

from __future__ import annotations

import argparse
import json
import sys
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
    a = ap.parse_args(argv)
    bits = tuple(int(x) for x in a.bits.split("+"))
    k = mx.random.normal((1, a.kv_heads, 1024, a.head_dim)).astype(mx.float16)
    v = mx.random.normal((1, a.kv_heads, 1024, a.head_dim)).astype(mx.float16)
    q = mx.random.normal((1, a.heads, 1, a.head_dim)).astype(mx.float16)
    k1 = mx.random.normal((1, a.kv_heads, 1, a.head_dim)).astype(mx.float16)
    mx.eval(k, v, q, k1)
    out = {"device": str(mx.default_device()), "bits": a.bits, "import_s": T_IMPORT}
    c = RVQKVCache(bits)
    for tag in ("first", "warm"):
        t0 = time.perf_counter()
        if tag == "first":
            c.update_and_fetch(k, v)
        else:
            c.update_and_fetch(k1, k1)
        mx.eval(c.state)
        t1 = time.perf_counter()
        mx.eval(c.attend_on_codes(q, scale=a.head_dim ** -0.5))
        t2 = time.perf_counter()
        out[f"{tag}_update_s"], out[f"{tag}_attend_s"] = t1 - t0, t2 - t1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
