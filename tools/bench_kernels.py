"""Fused GPU kernels vs the reference (MLX ops) path, against a plain copy of the same bytes.

For each (dim, N, bits, residual) case, in one run on the default (GPU) device:

* ``copy``: the ceiling -- a float4 copy kernel over the case's y bytes (read + write), and MLX's
  own ``y + 0``; the faster of the two is the ceiling.
* ``enc_fused`` / ``enc_ref``: ``codec.quantize(y)`` with and without the kernels (y float32 (N, dim)).
* ``dec_fused`` / ``dec_ref``: ``codec.dequantize(codes1, codes2)`` with and without the kernels.

Method (see the seed post and the device notes): warm every arm up (compiles, first-use checks), then
run the arms interleaved round by round, each call on the next input of a rotating pool of distinct
inputs, each timed with a sync before and after; report medians. GB/s counts the bytes the op must
move (encode: y read + codes written; decode: codes read + y_hat written; copy: y read + written).
Each arm's fraction is its GB/s over the copy ceiling's; the speedup is reference time / fused time.

    python tools/bench_kernels.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rvqstore import RVQCodec, fused  # noqa: E402

_COPY_SRC = {
    "cuda": """
  const uint i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < params[0]) {
    reinterpret_cast<float4*>(out)[i] = reinterpret_cast<const float4*>(inp)[i];
  }
""",
    "metal": """
  const uint i = thread_position_in_grid.x;
  if (i < params[0]) {
    ((device float4*)out)[i] = ((const device float4*)inp)[i];
  }
""",
}
_copy_kernel = None


def copy_kernel(x: mx.array, dialect: str) -> mx.array:
    global _copy_kernel
    if _copy_kernel is None:
        make = mx.fast.metal_kernel if dialect == "metal" else mx.fast.cuda_kernel
        _copy_kernel = make(name="rvq_bench_copy4", input_names=["inp", "params"], output_names=["out"],
                            source=_COPY_SRC[dialect],
                            header="typedef unsigned int uint;\n" if dialect == "cuda" else "")
    n4 = x.size // 4
    return _copy_kernel(inputs=[x, mx.array([n4], dtype=mx.uint32)], grid=(n4, 1, 1), threadgroup=(256, 1, 1),
                        output_shapes=[x.shape], output_dtypes=[x.dtype])[0]


def _sync_time(fn, k: int) -> float:
    """Seconds per call of ``fn(0) .. fn(k-1)`` issued back to back and evaluated together (k calls
    amortize the sync and Python overhead so the GPU time shows at small sizes)."""
    mx.synchronize()
    t = time.perf_counter()
    mx.eval([fn(j) for j in range(k)])
    mx.synchronize()
    return (time.perf_counter() - t) / k


def bench_case(dim, n, bits, residual, rounds, pool, dialect, variants=False, with_ref=True) -> dict:
    key = mx.random.key(dim * 1000 + n + 17 * bits[0] + bits[1])
    kc = RVQCodec(dim, bits, seed=1, residual=residual, use_kernels=True)
    rc = RVQCodec(dim, bits, seed=1, residual=residual, use_kernels=False)
    ys = []
    for k in mx.random.split(key, pool):
        ys.append(kc.rotate(mx.random.normal((n, dim), key=k))[0])  # distinct inputs, drawn on the device
    mx.eval(ys)
    codes = [rc.quantize(y) for y in ys]
    mx.eval(codes)
    c2_of = (lambda c: c[1])
    plan_e = fused.make_plan(kc, fused.ENCODE)
    arms = {
        "copy_kernel": lambda i: copy_kernel(ys[i], dialect),
        "copy_mlx": lambda i: ys[i] + 0.0,
        "enc_fused": lambda i: kc.quantize(ys[i]),
        "dec_fused": lambda i: kc.dequantize(codes[i][0], c2_of(codes[i])),
    }
    if with_ref:
        # the codec without kernels (what it runs on the GPU otherwise) ...
        arms["enc_ref"] = lambda i: rc.quantize(ys[i])
        arms["dec_ref"] = lambda i: rc.dequantize(codes[i][0], c2_of(codes[i]))
        # ... and, for decode, the unfused reference formulation (unpack + gather, mx.compile'd)
        arms["dec_refunfused"] = lambda i: (rc._dequantize_fn(codes[i][0], codes[i][1]) if kc.bits2 else
                                            fused._reference_dequantize(rc, codes[i][0], None))
    if variants:  # layouts, search strategies and block sizes, side by side
        plan_d = fused.make_plan(kc, fused.DECODE)
        variants_e = [(fused.LAYOUT_CHUNK, "chunk", fused.SEARCH_BINARY, "binary", 256),
                      (fused.LAYOUT_CHUNK, "chunk", fused.SEARCH_BINARY, "binary", 512),
                      (fused.LAYOUT_CHUNK, "chunk", fused.SEARCH_LINEAR, "linear", 256)]
        variants_d = [(fused.LAYOUT_CHUNK, "chunk", 256)]
        if plan_e.lanes_ok:
            variants_e.append((fused.LAYOUT_LANES, "lanes", fused.SEARCH_BINARY, "binary", 256))
            variants_d += [(fused.LAYOUT_LANES, "lanes", 128), (fused.LAYOUT_LANES, "lanes", 256)]
        for lay, lname, s, sname, tpg in variants_e:
            arms[f"enc_{lname}_{sname}_t{tpg}"] = (lambda i, s=s, t=tpg, lay=lay: fused.launch_encode(
                plan_e, ys[i], dialect, search=s, layout=lay, threads_per_group=t))
        for lay, lname, tpg in variants_d:
            arms[f"dec_{lname}_t{tpg}"] = (lambda i, t=tpg, lay=lay: fused.launch_decode(
                plan_d, codes[i][0], codes[i][1], dialect, layout=lay, threads_per_group=t))
    # warm-up: compiles, first-use checks; and a parity spot check on this very data
    t0 = time.perf_counter()
    for name, fn in arms.items():
        for i in range(min(pool, 2)):
            mx.eval(fn(i))
    warm_s = time.perf_counter() - t0
    got, ref = kc.quantize(ys[0]), codes[0]
    same_enc = fused._same(got[0], ref[0]) and (ref[1] is None or fused._same(got[1], ref[1]))
    same_dec = fused._same(kc.dequantize(*ref), rc.dequantize(*ref))
    if fused.disabled():
        raise RuntimeError(f"kernel latched off: {fused.disabled()}")
    times = {k: [] for k in arms}
    order = list(arms)
    # calls per sample: ~8 GB of traffic per sample, so launch and sync overhead stay small
    calls = int(min(32, max(1, round(4e9 / (2 * n * dim * 4)))))
    for r in range(rounds):
        for a, k in enumerate(order if r % 2 == 0 else order[::-1]):  # interleaved, alternating order
            # each arm walks the pool, and neighbouring calls read different inputs (no L2 reuse)
            times[k].append(_sync_time(lambda j: arms[k]((r + a + j) % pool), calls))
    med = {k: statistics.median(v) for k, v in times.items()}
    w = kc.words1 + kc.words2
    ybytes = n * dim * 4
    moved = {"copy": 2 * ybytes, "enc": ybytes + n * w * 4, "dec": ybytes + n * w * 4}
    gbps = {k: moved[k.split("_")[0]] / med[k] / 1e9 for k in med if med[k] > 0}
    ceiling = max(gbps["copy_kernel"], gbps["copy_mlx"])
    res = {
        "dim": dim, "n": n, "bits": list(bits), "residual": kc.residual, "rounds": rounds, "pool": pool,
        "calls_per_sample": calls, "layout": "lanes" if plan_e.layout == fused.LAYOUT_LANES else "chunk",
        "bytes": moved, "median_ms": {k: v * 1e3 for k, v in med.items()},
        "spread_ms": {k: [min(v) * 1e3, max(v) * 1e3] for k, v in times.items()},
        "gbps": gbps, "copy_ceiling_gbps": ceiling,
        "frac_of_copy": {k: gbps[k] / ceiling for k in gbps},
        "parity_spot_check": {"encode": same_enc, "decode": same_dec}, "warmup_s": warm_s,
    }
    if with_ref:
        res["speedup"] = {"enc": med["enc_ref"] / med["enc_fused"], "dec": med["dec_ref"] / med["dec_fused"],
                          "dec_vs_unfused": med["dec_refunfused"] / med["dec_fused"]}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="a few small cases (smoke test)")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    dialect = fused.gpu_backend()
    if dialect is None or mx.default_device().type != mx.DeviceType.gpu:
        sys.exit("no GPU backend: the fused kernels only run on Metal or CUDA")
    K, M = 1024, 1024 * 1024
    cases = []  # (dim, n, bits, residual, variants, with_ref)
    if args.quick:
        cases = [(128, 64 * K, (2, 2), "conditional", True, True), (64, 8 * K, (3, 1), "shared", False, True)]
    else:
        for n in (8 * K, 64 * K, 256 * K, 1 * M, 4 * M):
            cases.append((128, n, (2, 2), "conditional", n == 1 * M, True))
        for dim in (64, 256):
            for n in (1 * M, 4 * M):
                cases.append((dim, n, (2, 2), "conditional", False, True))
        for bits, res in (((2, 2), "shared"), ((4, 4), "conditional"), ((1, 1), "conditional"),
                          ((3, 3), "shared"), ((4, 0), "conditional"), ((3, 1), "conditional")):
            cases.append((128, 1 * M, bits, res, False, True))
    results = []
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mlx": mx.__version__, "backend": dialect, "device": str(mx.default_device()),
        "device_info": {k: (v if isinstance(v, (int, float, str)) else str(v))
                        for k, v in _device_info().items()},
        "python": platform.python_version(), "machine": platform.machine(),
        "threads_per_group": fused.THREADS_PER_GROUP, "linear_max_thresholds": fused.LINEAR_MAX_THRESHOLDS,
        "results": results,
    }
    for dim, n, bits, res, variants, with_ref in cases:
        pool = 4 if n * dim * 4 <= 2**31 else 3
        rounds = args.rounds if n <= 1 * M else max(5, args.rounds // 2)
        r = bench_case(dim, n, bits, res, rounds, pool, dialect, variants, with_ref)
        results.append(r)
        sp = r.get("speedup", {})
        print(f"dim={dim:4d} N={n:8d} bits={bits} {r['residual']:11s} copy {r['copy_ceiling_gbps']:7.0f} GB/s | "
              f"enc {r['gbps']['enc_fused']:7.0f} GB/s {r['frac_of_copy']['enc_fused']:5.2f} x{sp.get('enc', 0):6.1f} | "
              f"dec {r['gbps']['dec_fused']:7.0f} GB/s {r['frac_of_copy']['dec_fused']:5.2f} x{sp.get('dec', 0):6.1f}"
              f" (x{sp.get('dec_vs_unfused', 0):5.1f} unfused) "
              f"| parity {r['parity_spot_check']}", flush=True)
        if variants:
            for k in sorted(r["median_ms"]):
                print(f"    {k:22s} {r['median_ms'][k]:9.4f} ms  {r['gbps'][k]:7.0f} GB/s  "
                      f"{r['frac_of_copy'][k]:5.2f}", flush=True)
        if args.json:  # after every case: a run cut short keeps what it measured
            args.json.write_text(json.dumps(info, indent=1))
    if args.json:
        print(f"wrote {args.json}")


def _device_info() -> dict:
    try:
        return dict(mx.device_info())
    except Exception:
        try:
            return dict(mx.metal.device_info())
        except Exception:
            return {}


if __name__ == "__main__":
    main()
