"""Where the attention kernels' warps wait: CUPTI PC sampling of attention calls on packed codes (CUDA).

The GPU machine has no ``ncu``; CUPTI's PC sampling (``tools/pc_sampling.c``, built with gcc against the CUDA
headers and loaded with ctypes) samples every resident warp's PC and stall reason every 2^period cycles.
This tool fills one layer's packed cache (8B geometry by default) to each context, warms the calls up, then
samples ``--calls`` attention calls on the codes and writes, per kernel, the samples of each stall reason and
the PCs that hold most of them; ``--cubins DIR`` also saves the kernel cache's binaries (disassemble them with
``nvdisasm`` to read the PCs).

Each case runs in a process of its own: CUPTI did not sample kernels whose modules were loaded after an earlier
case's sampling had stopped (the 4+2 kernels were missing from a run of 2+2 then 4+2 in one process).

    python tools/pc_sample.py --lib libpcsampling.so --cupti libcupti.so.13 --contexts 32768,131072 \
        --bits 2+2 --json out.json [--raw DIR] [--cubins DIR]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from rvqstore import RVQKVCache, kernel_cache  # noqa: E402


def parse(path: Path) -> dict:
    """The sampler's text: ``{"reasons": {index: name}, "pcs": [(function, offset, {index: n})], "totals": [...]}``."""
    reasons, pcs, totals = {}, [], []
    for line in path.read_text().splitlines():
        f = line.split()
        if f[0] == "reason":
            reasons[int(f[1])] = f[2]
        elif f[0] == "pc":
            pcs.append((f[1], int(f[2]), {int(a): int(b) for a, b in (x.split(":") for x in f[3:])}))
        elif f[0] == "total":
            totals.append({"total": int(f[1]), "dropped": int(f[3]), "nonuser": int(f[5])})
    return {"reasons": reasons, "pcs": pcs, "totals": totals}


def summarize(raw: dict, top: int = 40) -> dict:
    """Per function: samples per stall reason (largest first) and the ``top`` PCs by samples."""
    names = raw["reasons"]
    per = collections.defaultdict(collections.Counter)
    by_pc = collections.defaultdict(collections.Counter)
    for fn, off, counts in raw["pcs"]:
        for r, n in counts.items():
            if n:
                name = names.get(r, str(r))
                per[fn][name] += n
                if not name.endswith("_not_issued"):  # a subset of its reason's samples: counted once
                    by_pc[fn][off] += n
    out = {}
    for fn, c in per.items():
        total = sum(n for r, n in c.items() if not r.endswith("_not_issued"))
        pcs = []
        for off, n in by_pc[fn].most_common(top):
            reasons = collections.Counter()
            for f2, o2, counts in raw["pcs"]:
                if f2 == fn and o2 == off:
                    for r, k in counts.items():
                        if k:
                            reasons[names.get(r, str(r))] += k
            pcs.append({"pc": off, "samples": n, "reasons": dict(reasons.most_common(4))})
        out[fn] = {"samples": total, "reasons": {k: v for k, v in c.most_common()}, "top_pcs": pcs}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True, help="libpcsampling.so (tools/pc_sampling.c)")
    ap.add_argument("--cupti", required=True, help="libcupti.so.13")
    ap.add_argument("--cuda", default="libcuda.so.1")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--bits", default="2+2")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--period", type=int, default=8, help="sample every 2^period cycles (5..31)")
    ap.add_argument("--serialized", action="store_true", help="CUPTI's kernel-serialized mode")
    ap.add_argument("--raw", help="folder for the sampler's raw text per case")
    ap.add_argument("--cubins", help="tar file for the kernel cache's binaries")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    cases = [(int(n), bits) for n in a.contexts.split(",") for bits in a.bits.split(",")]
    if len(cases) > 1:
        return run_each_case(a, cases, argv if argv is not None else sys.argv[1:])
    lib = ctypes.CDLL(a.lib)
    lib.pcs_start.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.pcs_stop.argtypes = [ctypes.c_char_p]
    lib.pcs_error.restype = ctypes.c_char_p
    hq, hkv, d = a.heads, a.kv_heads, a.head_dim
    raw_dir = Path(a.raw) if a.raw else Path(a.json).parent
    raw_dir.mkdir(parents=True, exist_ok=True)
    out = {"geometry": [hq, hkv, d], "period": a.period, "calls": a.calls, "cases": []}
    for n in (int(x) for x in a.contexts.split(",")):
        for bits in a.bits.split(","):
            b = tuple(int(x) for x in bits.split("+"))
            mx.random.seed(n)
            k = mx.random.normal((1, hkv, n, d)).astype(mx.float16)
            v = mx.random.normal((1, hkv, n, d)).astype(mx.float16)
            c = RVQKVCache(b)
            for s in range(0, n, 4096):
                c.update_and_fetch(k[:, :, s:s + 4096], v[:, :, s:s + 4096])
            mx.eval(c.state)
            del k, v
            qs = [mx.random.normal((1, hq, 1, d)).astype(mx.float16) for _ in range(4)]
            for i in range(20):  # warm: builds, checks, first launches
                mx.eval(c.attend_on_codes(qs[i % 4], scale=d ** -0.5))
            mx.synchronize()
            rc = lib.pcs_start(a.cupti.encode(), a.cuda.encode(), a.period, int(a.serialized))
            if rc:
                raise SystemExit(f"pcs_start: {lib.pcs_error().decode()}")
            outs = [c.attend_on_codes(qs[i % 4], scale=d ** -0.5) for i in range(a.calls)]
            mx.eval(outs)
            mx.synchronize()
            path = raw_dir / f"pcsamples-{n}-{bits}.txt"
            rc = lib.pcs_stop(str(path).encode())
            if rc:
                raise SystemExit(f"pcs_stop: {lib.pcs_error().decode()}")
            raw = parse(path)
            out["cases"].append({"context": n, "bits": bits, "totals": raw["totals"], "functions": summarize(raw)})
            print(json.dumps({"context": n, "bits": bits, "functions": {
                fn: {"samples": s["samples"], "reasons": dict(list(s["reasons"].items())[:6])}
                for fn, s in out["cases"][-1]["functions"].items()}}), flush=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    if a.cubins:
        d_ = kernel_cache.cache_dir()
        with tarfile.open(a.cubins, "w:gz") as t:
            for p in sorted(d_.glob("*.bin")) if d_ else []:
                got = kernel_cache.read_binary(p.stem)
                if got:
                    name, binary = got
                    info = tarfile.TarInfo(f"{name}-{p.stem[:12]}.cubin")
                    info.size = len(binary)
                    t.addfile(info, io.BytesIO(binary))
    return 0


def run_each_case(a, cases, argv) -> int:
    """Samples every case in a fresh process and joins their JSON into ``a.json``."""
    keep, skip = [], {"--contexts", "--bits", "--json", "--cubins"}
    it = iter(argv)
    for x in it:
        if x.split("=")[0] in skip:
            if "=" not in x:
                next(it, None)
        else:
            keep.append(x)
    out = {"geometry": [a.heads, a.kv_heads, a.head_dim], "period": a.period, "calls": a.calls, "cases": []}
    for i, (n, bits) in enumerate(cases):
        part = Path(a.json).with_suffix(f".case{i}.json")
        cmd = [sys.executable, __file__, *keep, "--contexts", str(n), "--bits", bits, "--json", str(part)]
        if a.cubins and i == len(cases) - 1:  # the kernel cache on disk then holds every case's binaries
            cmd += ["--cubins", a.cubins]
        rc = subprocess.call(cmd)
        if rc:
            return rc
        out["cases"] += json.loads(part.read_text())["cases"]
        part.unlink()
    Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
