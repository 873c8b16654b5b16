"""The host side of a pinned upload, piece by piece: where a section's bytes spend their time before the copy kernel.

Sections like a 32k-token 8B cache's 4+2 codes (``--section-mb`` each, ``--sections`` of them, zstd level 3 as
the writer's ``auto``) decompressed or copied on ``--threads`` threads into: pinned memory
(:mod:`rvqstore.pinned_memory`, as :mod:`rvqstore.device_upload` does), ordinary pre-faulted host memory, or new
``bytes`` (``ZstdDecompressor.decompress``, the regular reader). Also plain copies into pinned memory and reads
out of it. Medians of ``--rounds``; GB/s of decoded bytes; JSON to ``--json``.

    python tools/bench_upload.py --json tools/results/upload-host-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def codes(nbytes: int, seed: int) -> bytes:
    """4-bit stage-1 and 2-bit stage-2 codes of Gaussian-ish data, as packed words look: near-incompressible."""
    rng = np.random.default_rng(seed)
    hi = np.clip(np.round(rng.normal(7.5, 3.0, nbytes)), 0, 15).astype(np.uint8)
    lo = rng.integers(0, 16, nbytes, dtype=np.uint8)
    return ((hi << 4) | lo).tobytes()


def main(argv=None):
    import zstandard

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--section-mb", type=float, default=24.0)
    ap.add_argument("--sections", type=int, default=16)
    ap.add_argument("--threads", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    n = int(a.section_mb * (1 << 20)) // 16 * 16
    raw = [codes(n, i) for i in range(a.sections)]
    comp = [zstandard.ZstdCompressor(level=3).compress(r) for r in raw]
    total = n * a.sections
    out = {"section_bytes": n, "sections": a.sections, "compressed_fraction": sum(map(len, comp)) / total}
    pinned = None
    try:
        from rvqstore import pinned_memory

        t0 = time.perf_counter()
        pinned = pinned_memory.allocate(total)
        out["pinned_alloc_s"] = time.perf_counter() - t0
    except Exception as e:  # no CUDA here: the ordinary-memory arms only
        out["pinned"] = f"unavailable: {e}"
    t0 = time.perf_counter()
    plain = np.empty(total, np.uint8)
    plain[:] = 0
    out["plain_alloc_touch_s"] = time.perf_counter() - t0

    def into(dst, k):
        view = memoryview(dst[k * n:(k + 1) * n])
        with zstandard.ZstdDecompressor().stream_reader(comp[k], read_across_frames=False) as r:
            got = 0
            while got < n:
                m = r.readinto(view[got:])
                if not m:
                    break
                got += m
        view.release()

    def via_bytes(dst, k):
        b = zstandard.ZstdDecompressor().decompress(comp[k])
        if dst is not None:
            np.copyto(dst[k * n:(k + 1) * n], np.frombuffer(b, np.uint8))

    def copy_raw(dst, k):
        np.copyto(dst[k * n:(k + 1) * n], np.frombuffer(raw[k], np.uint8))

    def read_back(src, k):
        np.copyto(plain[k * n:(k + 1) * n], src[k * n:(k + 1) * n])

    arms = {"readinto plain": (into, plain), "decompress to bytes": (via_bytes, None), "raw copy to plain": (copy_raw, plain)}
    if pinned is not None:
        arms.update({"readinto pinned": (into, pinned.array), "decompress + copy to pinned": (via_bytes, pinned.array),
                     "raw copy to pinned": (copy_raw, pinned.array), "read pinned into plain": (read_back, pinned.array)})
    res = {}
    for threads in [int(x) for x in a.threads.split(",")]:
        times = {k: [] for k in arms}
        with ThreadPoolExecutor(threads) as pool:
            for r in range(a.rounds):
                for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                    fn, dst = arms[name]
                    t0 = time.perf_counter()
                    list(pool.map(lambda k: fn(dst, k), range(a.sections)))
                    times[name].append(time.perf_counter() - t0)
        for name, t in times.items():
            s = statistics.median(t)
            res[f"{name}, {threads} threads"] = {"s": round(s, 4), "GB/s": round(total / s / 1e9, 2)}
            print(f"{name:30s} {threads:2d} threads {s:.4f} s {total / s / 1e9:6.2f} GB/s", flush=True)
    out["arms"] = res
    if pinned is not None:
        pinned.free()
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
