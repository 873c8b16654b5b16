"""Entropy-coded `.rvq` files (section codec rans, spec 9.3) on real SmolLM2-135M snapshots: bits per
coordinate on disk (everything counted: codes, scales, tokens, header) for raw / zstd ("auto") /
rans / "best" files, and load time (reading every section, i.e. checksums + decompression / numpy rANS
decoding) on this CPU.

    python tools/bench_entropy_files.py [--tokens 2048] [--texts prose code] [--repeats 3]

Writes tools/results/entropy-files.md and .json.  Arms are interleaved per repeat; medians reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = ((2, 2), (4, 2), (2, 1), (4, 4))
MODES = ("none", "auto", "rans", "best")


def read_all(path: str) -> float:
    from rvqstore.format import open_rvq

    t = time.perf_counter()
    with open_rvq(path) as f:
        for s in f.sections:
            f.read_section(s.name)
    return time.perf_counter() - t


def section_scaling(path: str, repeats: int) -> list[dict]:
    """Decode speed against section size: the keys.codes1 sections of 1, 4 and 16 consecutive layers
    (real codes, one distribution per layer) concatenated into one section, raw vs zstd vs rans."""
    import numpy as np
    import zstandard

    from rvqstore.format import open_rvq, rans

    with open_rvq(path) as f:
        q = f.quantizer_for(0, "keys")
        parts = [f.read_section(f"layers.{i}.keys.codes1").reshape(-1) for i in range(len(f.layers))]
    out = []
    for n_layers in (1, 4, 16):
        raw = np.concatenate(parts[:n_layers]).tobytes()
        stored = min((rans.encode(raw, q["bits1"], q["dim"], contexts=c) for c in (1, 0)), key=len)
        frame = zstandard.ZstdCompressor(level=3).compress(raw)
        dctx = zstandard.ZstdDecompressor()
        t_r, t_z = [], []
        for _ in range(repeats):  # interleaved
            t = time.perf_counter()
            assert rans.decode(stored, len(raw)).tobytes() == raw
            t_r.append(time.perf_counter() - t)
            t = time.perf_counter()
            dctx.decompress(frame)
            t_z.append(time.perf_counter() - t)
        lanes = int.from_bytes(stored[12:16], "little")
        row = {"layers": n_layers, "raw_bytes": len(raw), "zstd_bytes": len(frame), "rans_bytes": len(stored),
               "lanes": lanes, "steps": -(-(len(raw) // 4 // -(-q["dim"] // (32 // q["bits1"])) * q["dim"]) // lanes),
               "rans_MBps": len(raw) / 1e6 / statistics.median(t_r), "zstd_MBps": len(raw) / 1e6 / statistics.median(t_z)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    from rvqstore.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--texts", nargs="+", default=["prose", "code"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "entropy-files"))
    args = ap.parse_args(argv)

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from quality.texts import DEFAULT_TEXTS, load_tokens
    from rvqstore.format import open_rvq
    from rvqstore.model import load_model
    from rvqstore.prompt_cache import save_prompt_cache

    model, tok = load_model()
    texts = {t.name: t for t in DEFAULT_TEXTS}
    rows, scaling = [], []
    tmp = tempfile.mkdtemp(prefix="bench_entropy_files_")
    for name in args.texts:
        ids = load_tokens(tok, texts[name], args.tokens)
        caches = [KVCache() for _ in model.layers]
        mx.eval(model.model(mx.array(ids)[None], cache=caches))
        k = caches[0].keys
        coords = len(caches) * 2 * k.shape[1] * args.tokens * k.shape[-1]
        for bits in CONFIGS:
            paths, write_s = {}, {}
            for mode in MODES:
                p = os.path.join(tmp, f"{name}_{bits[0]}{bits[1]}_{mode}.rvq")
                t = time.perf_counter()
                save_prompt_cache(p, caches, tokens=ids, bits=bits, compress=mode)
                write_s[mode] = time.perf_counter() - t
                paths[mode] = p
            loads = {m: [] for m in MODES}
            for _ in range(args.repeats):  # interleaved arms
                for m in MODES:
                    loads[m].append(read_all(paths[m]))
            for m in MODES:
                with open_rvq(paths[m]) as f:
                    codecs = {}
                    for s in f.sections:
                        codecs[s.codec] = codecs.get(s.codec, 0) + 1
                    rans_raw = sum(s.raw_length for s in f.sections if s.codec == "rans")
                size = os.path.getsize(paths[m])
                row = {"text": name, "bits": f"{bits[0]}+{bits[1]}", "mode": m, "file_bytes": size,
                       "bits_per_coord": 8 * size / coords, "load_s": statistics.median(loads[m]),
                       "write_s": write_s[m], "sections": codecs, "rans_raw_bytes": rans_raw}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if name == args.texts[0] and bits == (2, 2):
                scaling = section_scaling(paths["none"], args.repeats)
            for p in paths.values():
                os.unlink(p)
    out = Path(args.out)
    meta = {"tokens": args.tokens, "texts": args.texts, "repeats": args.repeats,
            "load_average": os.getloadavg(), "cpu_count": os.cpu_count()}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "section_scaling": scaling},
                                                   indent=1) + "\n")
    lines = [f"# Entropy-coded .rvq files: SmolLM2-135M, {args.tokens} tokens per text, all 30 layers",
             "",
             "Bits per coordinate on disk count the whole file (codes, bfloat16 scales, token ids, header).",
             "`none`: every section raw; `auto`: zstd where it saves >= 2 % (the default); `rans`: code",
             "sections entropy-coded where that shrinks them, the rest as auto; `best`: each section the",
             "smallest of raw/zstd/rans. Load = open + read every section (checksums, zstd, numpy rANS),",
             f"median of {args.repeats}, arms interleaved; load average during the run {meta['load_average'][0]:.1f}",
             f"on {meta['cpu_count']} cores (a shared machine: absolute times are inflated, ratios hold better).",
             "",
             "| text | bits | mode | bits/coord | vs none | load (ms) | load vs none | rans decode (MB/s raw) | write (s) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    base = {(r["text"], r["bits"]): r for r in rows if r["mode"] == "none"}
    for r in rows:
        b = base[(r["text"], r["bits"])]
        speed = (f"{r['rans_raw_bytes'] / 1e6 / r['load_s']:.2f}" if r["rans_raw_bytes"] else "-")
        lines.append(f"| {r['text']} | {r['bits']} | {r['mode']} | {r['bits_per_coord']:.3f} | "
                     f"{r['file_bytes'] / b['file_bytes']:.3f} | {1000 * r['load_s']:.0f} | "
                     f"{r['load_s'] / b['load_s']:.0f}x | {speed} | {r['write_s']:.1f} |")
    lines += ["", f"Decode speed against section size ({args.texts[0]}, 2+2, stage-1 key codes of 1, 4, 16 layers in one "
              "section; median of the interleaved repeats):", "",
              "| layers | raw bytes | zstd bytes | rans bytes | rans vs zstd | lanes | steps | rans MB/s | zstd MB/s |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in scaling:
        lines.append(f"| {r['layers']} | {r['raw_bytes']:,} | {r['zstd_bytes']:,} | {r['rans_bytes']:,} | "
                     f"{r['rans_bytes'] / r['zstd_bytes']:.3f} | {r['lanes']} | {r['steps']} | "
                     f"{r['rans_MBps']:.1f} | {r['zstd_MBps']:.0f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.md/.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
