"""Codec throughput on this machine's default MLX device: encode and decode vs a plain copy.

Method (see the seed post): warm up every arm, interleave the arms round by round, rotate a pool of
distinct inputs so no arm sees the same buffer twice in a row, report medians, and express speed as a
ratio to a copy of the same input bytes (``np.copyto`` into a preallocated buffer) measured in
the same run.

    python tools/bench_codec.py [--dims 64 128] [--n 10000 100000 1000000] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rvqstore import RVQCodec  # noqa: E402
from rvqstore.blas import blas_is_fast  # noqa: E402

CONFIGS = [(1, 1), (2, 2), (3, 3), (4, 4), (1, 0), (2, 0), (3, 0), (4, 0)]


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(dim: int, n: int, bits: tuple[int, int], rounds: int, pool: int) -> dict:
    rng = np.random.default_rng(dim * 7 + n)
    xs_np = [rng.standard_normal((n, dim)).astype(np.float16) for _ in range(pool)]
    xs = [mx.array(a) for a in xs_np]
    mx.eval(xs)
    codec = RVQCodec(dim, bits, seed=1)
    encs = [codec.encode(x) for x in xs]
    mx.eval([(e.scales, e.codes1, e.codes2) for e in encs])

    def enc(i):
        e = codec.encode(xs[i], check_finite=False)
        mx.eval(e.scales, e.codes1, *(() if e.codes2 is None else (e.codes2,)))

    def dec(i):
        mx.eval(codec.decode(encs[i]))

    dst = np.empty_like(xs_np[0])  # preallocated: a fresh buffer per call would time page faults

    def cpy(i):
        np.copyto(dst, xs_np[i])

    arms = {"encode": enc, "decode": dec, "copy": cpy}
    for f in arms.values():  # warm-up (compiles, allocator)
        f(0)
    times = {k: [] for k in arms}
    for r in range(rounds):
        for name, f in arms.items():
            times[name].append(timed(lambda: f(r % pool)))
    med = {k: statistics.median(v) for k, v in times.items()}
    in_bytes = n * dim * 2
    row = {"dim": dim, "n": n, "bits": list(bits), "input_bytes": in_bytes,
           "bits_per_coord": codec.bits_per_coordinate}
    for k in ("encode", "decode"):
        row[f"{k}_s"] = med[k]
        row[f"{k}_vectors_per_s"] = n / med[k]
        row[f"{k}_gb_per_s"] = in_bytes / med[k] / 1e9
        row[f"{k}_fraction_of_copy"] = med["copy"] / med[k]
    row["copy_s"] = med["copy"]
    row["copy_gb_per_s"] = in_bytes / med["copy"] / 1e9
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--n", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--bits", type=str, nargs="+", default=None, help="configs like 2+2 or 4+0")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--pool", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    configs = CONFIGS if args.bits is None else [tuple(int(v) for v in b.split("+")) for b in args.bits]
    meta = {"device": str(mx.default_device()), "mlx": mx.__version__, "machine": platform.machine(),
            "fast_blas": blas_is_fast(), "date": time.strftime("%Y-%m-%d")}
    print(f"# {meta}")
    print(f"{'dim':>4} {'n':>8} {'bits':>5} {'bpc':>6} | {'enc vec/s':>10} {'enc GB/s':>8} {'xcopy':>6} | "
          f"{'dec vec/s':>10} {'dec GB/s':>8} {'xcopy':>6} | {'copy GB/s':>9}")
    rows = []
    for dim in args.dims:
        for n in args.n:
            for bits in configs:
                r = bench(dim, n, bits, args.rounds, args.pool)
                rows.append(r)
                print(f"{dim:>4} {n:>8} {bits[0]}+{bits[1]:<3} {r['bits_per_coord']:6.3f} | "
                      f"{r['encode_vectors_per_s']:10.3g} {r['encode_gb_per_s']:8.3f} {r['encode_fraction_of_copy']:6.3f} | "
                      f"{r['decode_vectors_per_s']:10.3g} {r['decode_gb_per_s']:8.3f} {r['decode_fraction_of_copy']:6.3f} | "
                      f"{r['copy_gb_per_s']:9.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
