"""Threads of a local prefix store's reads: ``longest_prefix`` of a stored prompt on 1, 2, 4, 8 threads.

Caches of SmolLM2-135M's shape (30 layers, 3 KV heads, head dim 64; random values: reading does not depend
on them), 4+2 bits, stored once in a temporary directory; each arm a fresh ``PrefixStore`` (as a restarted
process has) reading the whole prompt and evaluating the caches. The thread count is forced per arm (the
store's cap at the CPU cores lifted), arms in a rotated order per round, medians, same-run ratios. What
``PrefixStore._threads`` caps a local store at (one thread per core) comes from this:

    python tools/bench_store_workers.py --contexts 1024,4096,16384 --md tools/results/store-workers-cpu.md \
        --json tools/results/store-workers-cpu.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rvqstore.blas import maybe_reexec_with_openblas  # noqa: E402

maybe_reexec_with_openblas()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from rvqstore import RVQKVCache  # noqa: E402
from rvqstore.store import prefix_store  # noqa: E402
from rvqstore.store.prefix_store import PrefixStore  # noqa: E402

LAYERS, KV_HEADS, DIM = 30, 3, 64
FINGERPRINT = {"model": "bench-store-workers", "shape": f"{LAYERS}x{KV_HEADS}x{DIM}"}


def caches(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(LAYERS):
        c = RVQKVCache(bits=(4, 2))
        k, v = (mx.array(rng.standard_normal((1, KV_HEADS, n, DIM)).astype(np.float32)) for _ in range(2))
        c.update_and_fetch(k, v)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def measure(n: int, threads: list[int], rounds: int) -> dict:
    toks = np.random.default_rng(n).integers(0, 49152, n)
    with tempfile.TemporaryDirectory() as d:
        PrefixStore(d, fingerprint=FINGERPRINT, n_layers=LAYERS).put(toks, caches(n, n + 1))
        times: dict[int, list[float]] = {t: [] for t in threads}
        cpu_count = prefix_store.os.cpu_count
        prefix_store.os.cpu_count = lambda: 1 << 10  # the arm's thread count, uncapped
        try:
            for r in range(rounds + 1):  # round 0 warms up
                for t in threads[r % len(threads):] + threads[:r % len(threads)]:
                    st = PrefixStore(d, fingerprint=FINGERPRINT, n_layers=LAYERS, workers=t)
                    t0 = time.perf_counter()
                    got, cs = st.longest_prefix(toks)
                    mx.eval([c.state for c in cs])
                    if r:
                        times[t].append(time.perf_counter() - t0)
                    if got != n:
                        raise SystemExit(f"read {got} of {n} tokens")
        finally:
            prefix_store.os.cpu_count = cpu_count
    med = {t: statistics.median(v) for t, v in times.items()}
    return {"context": n, "blocks": -(-n // prefix_store.DEFAULT_BLOCK_SIZE), "median_s": med,
            "vs_8": {t: med[8] / m for t, m in med.items()} if 8 in med else {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--md")
    ap.add_argument("--json")
    a = ap.parse_args()
    threads = [int(x) for x in a.threads.split(",")]
    rows = []
    for n in (int(x) for x in a.contexts.split(",")):
        rows.append(measure(n, threads, a.rounds))
        print(json.dumps(rows[-1]), flush=True)
    meta = {"command": "python tools/bench_store_workers.py " + " ".join(sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "machine": platform.machine(), "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(meta, indent=1) + "\n")
    if a.md:
        lines = [f"# Threads of a local prefix store's reads ({meta['cpus']} CPUs, {meta['machine']})", "",
                 f"`{meta['command']}` ({meta['date']}); medians of {a.rounds} rounds, s "
                 "(ratio: 8 threads' time / this)",
                 "", "| tokens | blocks | " + " | ".join(f"{t} threads" for t in threads) + " |",
                 "|---:|---:|" + "---:|" * len(threads)]
        for r in rows:
            cells = [f"{r['median_s'][t]:.4f} ({r['vs_8'].get(t, float('nan')):.2f}x)" for t in threads]
            lines.append(f"| {r['context']} | {r['blocks']} | " + " | ".join(cells) + " |")
        Path(a.md).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
