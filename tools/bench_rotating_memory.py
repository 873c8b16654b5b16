"""Memory of the RVQ sliding-window cache vs mlx-lm's float16 RotatingKVCache (issue 10's goal: <= 0.3x at 2+2).

For each layer geometry of a real sliding-window model (KV heads, head dim, window) and each context
length (1k, 8k, 32k tokens), the same float16 keys/values are fed to both caches the way mlx-lm's
generate does (prefill in chunks of 512 tokens, then single decode tokens), and ``nbytes`` (allocated
buffers) is read after the prefill and after 16 decode steps. The plain caches that grow without
bound (mlx-lm's KVCache, RVQKVCache: the workaround before rotating support) are listed for scale.
Memory is deterministic: one run, no timing.

    python tools/bench_rotating_memory.py [--json tools/results/rotating-memory.json] [--md tools/results/rotating-memory.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models import cache as lm  # noqa: E402

from rvqstore import RVQKVCache  # noqa: E402
from rvqstore.rotating_cache import RVQRotatingKVCache  # noqa: E402

# (name, kv heads, head dim, window) of sliding layers in mlx-lm models
GEOMETRIES = [
    ("gpt-oss-20b sliding layer", 8, 64, 128),
    ("gemma-3-1b sliding layer", 1, 256, 512),
    ("gemma-3-12b sliding layer", 8, 256, 1024),
    ("ministral-8b sliding layer", 8, 128, 4096),
]
LENGTHS = (1024, 8192, 32768)
CHUNK, DECODE = 512, 16


def run_one(heads: int, dim: int, window: int, n: int, bits: tuple[int, int]) -> dict:
    mx.random.seed(0)
    caches = {"mlx-lm RotatingKVCache fp16": lm.RotatingKVCache(window),
              f"RVQRotatingKVCache {bits[0]}+{bits[1]}": RVQRotatingKVCache(window, 0, bits)}
    unbounded = {"mlx-lm KVCache fp16": lm.KVCache(), f"RVQKVCache {bits[0]}+{bits[1]}": RVQKVCache(bits)}
    out: dict = {}
    steps = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else []) + [1] * DECODE
    for i, s in enumerate(steps):
        k = mx.random.normal((1, heads, s, dim)).astype(mx.float16)
        v = mx.random.normal((1, heads, s, dim)).astype(mx.float16)
        for c in caches.values():
            mx.eval(c.update_and_fetch(k, v))
        for c in unbounded.values():  # for scale only: their state, not the (quadratic) decode of all history
            c.update_and_fetch(k, v)
            mx.eval(c.state)
        if i == len(steps) - DECODE - 1:
            out["after_prefill"] = {name: c.nbytes for name, c in caches.items()}
    out["after_decode"] = {name: c.nbytes for name, c in caches.items()}
    out["unbounded_after_decode"] = {name: c.nbytes for name, c in unbounded.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="tools/results/rotating-memory.json")
    ap.add_argument("--md", default="tools/results/rotating-memory.md")
    ap.add_argument("--bits", default="2+2,4+2")
    args = ap.parse_args()
    rows = []
    for bits in [tuple(int(x) for x in b.split("+")) for b in args.bits.split(",")]:
        for name, heads, dim, window in GEOMETRIES:
            for n in LENGTHS:
                r = run_one(heads, dim, window, n, bits)
                ref, rvq = (f"mlx-lm RotatingKVCache fp16", f"RVQRotatingKVCache {bits[0]}+{bits[1]}")
                row = dict(geometry=name, kv_heads=heads, head_dim=dim, window=window, tokens=n, bits=f"{bits[0]}+{bits[1]}",
                           fp16_prefill=r["after_prefill"][ref], rvq_prefill=r["after_prefill"][rvq],
                           fp16_decode=r["after_decode"][ref], rvq_decode=r["after_decode"][rvq],
                           kvcache_fp16=r["unbounded_after_decode"]["mlx-lm KVCache fp16"],
                           rvqkvcache=r["unbounded_after_decode"][f"RVQKVCache {bits[0]}+{bits[1]}"])
                row["ratio_prefill"] = row["rvq_prefill"] / row["fp16_prefill"]
                row["ratio_decode"] = row["rvq_decode"] / row["fp16_decode"]
                rows.append(row)
                print(f"{row['bits']} {name:28s} {n:6d} tok: fp16 {row['fp16_decode']:>11,} B, rvq {row['rvq_decode']:>10,} B "
                      f"-> {row['ratio_decode']:.3f}x (after prefill {row['ratio_prefill']:.3f}x)", flush=True)
    Path(args.json).write_text(json.dumps({"chunk": CHUNK, "decode_steps": DECODE, "rows": rows}, indent=1))
    lines = ["# RVQ sliding-window cache memory vs mlx-lm's float16 RotatingKVCache", "",
             f"`python tools/bench_rotating_memory.py`: float16 keys/values fed in {CHUNK}-token prefill chunks, then "
             f"{DECODE} decode tokens; `nbytes` (allocated) of one layer after the prefill and after decoding. "
             "The unbounded caches (mlx-lm KVCache fp16, RVQKVCache) show what a sliding layer costs without a window.", "",
             "| bits | layer (KV heads x head dim, window) | tokens | fp16 rotating | RVQ rotating | ratio after decode | "
             "ratio after prefill | KVCache fp16 (unbounded) | RVQKVCache (unbounded) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['bits']} | {r['geometry']} ({r['kv_heads']}x{r['head_dim']}, {r['window']}) | {r['tokens']:,} | "
                     f"{r['fp16_decode']:,} | {r['rvq_decode']:,} | **{r['ratio_decode']:.3f}x** | {r['ratio_prefill']:.3f}x | "
                     f"{r['kvcache_fp16']:,} | {r['rvqkvcache']:,} |")
    worst = {b: max(r["ratio_decode"] for r in rows if r["bits"] == b) for b in {r["bits"] for r in rows}}
    worst_p = {b: max(r["ratio_prefill"] for r in rows if r["bits"] == b) for b in {r["bits"] for r in rows}}
    lines += ["", "Worst ratio over every geometry and length: " + ", ".join(
        f"{b}: {worst[b]:.3f}x after decode, {worst_p[b]:.3f}x after prefill" for b in sorted(worst)) + "."]
    Path(args.md).write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-1:]))


if __name__ == "__main__":
    main()
