"""Uniform-grid (entropy-constrained) codes in `.rvq` files, on real SmolLM2-135M keys and values.

For each setting (Lloyd–Max tables, or a uniform grid of `step` with 5-7 bits in memory) the K/V of a
prefill of each text are coded, saved with `compress="best"` (rANS sections with per-coordinate
tables, spec 9.3) and `"auto"` (zstd), and measured:

- K/V relative error (sum ||x - x_hat||^2 / sum ||x||^2 over every layer);
- bits per coordinate on disk, whole file, everything counted;
- the empirical entropy of the code sections, per coordinate (what per-coordinate tables can reach):
  stage 1 and stage 2 coded apart (`H(i) + H(j)`, what the format's two sections code) and the joint
  index (`H(i, j)`, what coding stage 2 in the context of stage 1 could reach);
- what the rANS sections spend above that entropy: frequency tables, lane states, and the coder;
- load time (open + read every section; arms interleaved, medians).

Then the decode speed of one real section against the lane count (the writer's choice, spec 9.3).

    python tools/bench_ecsq_files.py [--tokens 1024] [--texts prose code] [--repeats 3]

Writes tools/results/ecsq-files.md and .json.
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

# (label, bits, step): Lloyd–Max references and grids of 5-7 bits in memory
SETTINGS = (
    ("LM 2+2", (2, 2), None),
    ("LM 4+2", (4, 2), None),
    ("grid 3+2 @0.25", (3, 2), 0.25),
    ("grid 4+2 @0.16", (4, 2), 0.16),
    ("grid 4+2 @0.12", (4, 2), 0.12),
    ("grid 4+3 @0.08", (4, 3), 0.08),
    ("grid 4+3 @0.06", (4, 3), 0.06),
)
MODES = ("auto", "best")
LANE_RULE_SETTINGS = ("LM 4+2", "grid 4+3 @0.08")  # whole files written with other lane counts


def read_all(path: str) -> float:
    from rvqstore.format import open_rvq

    t = time.perf_counter()
    with open_rvq(path) as f:
        for s in f.sections:
            f.read_section(s.name)
    return time.perf_counter() - t


def _entropy_bits(codes) -> float:
    """Total bits of per-coordinate empirical entropy: sum over coordinates of n * H(column)."""
    import numpy as np

    total = 0.0
    n = codes.shape[0]
    for j in range(codes.shape[1]):
        c = np.bincount(codes[:, j])
        p = c[c > 0] / n
        total -= n * float((p * np.log2(p)).sum())
    return total


def code_statistics(caches, bits) -> dict:
    """Empirical entropies (bits) of every layer side's codes, stage by stage and joint."""
    import numpy as np

    from rvqstore.format import rans

    b1, b2 = bits
    out = {"H1": 0.0, "H2": 0.0, "Hjoint": 0.0, "symbols": 0}
    for c in caches:
        st = c.state
        for side in (st[0:3], st[3:6]):
            dim = c.geometry[2]
            i1 = rans.unpack(np.array(side[1]).reshape(-1), b1, dim)
            out["H1"] += _entropy_bits(i1)
            out["symbols"] += i1.size
            if b2:
                i2 = rans.unpack(np.array(side[2]).reshape(-1), b2, dim)
                out["H2"] += _entropy_bits(i2)
                out["Hjoint"] += _entropy_bits((i1.astype(np.int64) << b2) | i2)
            else:
                out["Hjoint"] += out["H1"]
    return out


def rans_parts(path: str) -> dict:
    """Bytes of the rans sections by part: fixed header + frequency tables, lane states, stream words."""
    from rvqstore.format import open_rvq, rans

    parts = {"sections": 0, "tables": 0, "states": 0, "stream": 0, "symbols": 0}
    with open_rvq(path) as f:
        for s in f.sections:
            if s.codec != "rans":
                continue
            stored = f.read_stored(s.name)
            _, _, b, _, ctx, dim, lanes, n, n_words = rans.FIXED.unpack_from(bytes(stored[:32]), 0)
            parts["sections"] += 1
            parts["tables"] += 32 + 2 * (dim if ctx else 1) * (1 << b)
            parts["states"] += 4 * lanes
            parts["stream"] += 2 * n_words
            parts["symbols"] += n
    return parts


def lane_sweep(caches, bits, repeats: int) -> list[dict]:
    """Decode speed and size of real code sections (stage 1 of the keys of 1 and of 8 layers in one
    section) against the lane count."""
    import numpy as np

    from rvqstore.format import rans

    dim = caches[0].geometry[2]
    rows = []
    for n_layers in (1, 8):
        raw = np.concatenate([np.array(c.state[1]).reshape(-1) for c in caches[:n_layers]]).tobytes()
        n = len(raw) // 4 // rans.words_per_vector(dim, bits[0]) * dim
        for lanes in sorted({dim, 4 * dim, 16 * dim, 64 * dim, rans.choose_lanes(n, dim, 1)}):
            stored = rans.encode(raw, bits[0], dim, contexts=1, lanes=lanes)
            ts = []
            for _ in range(repeats):
                t = time.perf_counter()
                out = rans.decode(stored, len(raw))
                ts.append(time.perf_counter() - t)
            assert out.tobytes() == raw
            t = statistics.median(ts)
            row = {"layers": n_layers, "symbols": n, "lanes": lanes, "steps": -(-n // lanes),
                   "writer_rule": lanes == rans.choose_lanes(n, dim, 1), "stored_bytes": len(stored),
                   "bits_per_symbol": 8 * len(stored) / n, "decode_ms": 1000 * t, "Msym_per_s": n / t / 1e6}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def lane_rule_files(caches, ids, tmp: str, repeats: int, label: str) -> list[dict]:
    """Whole `best` files written with the writer aiming at 2048 (its rule), 1024, 512 and 256 decode
    steps per section (lanes = symbols / steps, a multiple of dim): size against load time."""
    from rvqstore.format import rans
    from rvqstore.prompt_cache import save_prompt_cache

    paths = {}
    keep = rans.TARGET_STEPS
    try:
        for target in (2048, 1024, 512, 256):
            rans.TARGET_STEPS = target
            paths[target] = os.path.join(tmp, f"lanes_{target}.rvq")
            save_prompt_cache(paths[target], caches, tokens=ids, compress="best")
    finally:
        rans.TARGET_STEPS = keep
    loads = {t: [] for t in paths}
    for _ in range(repeats):
        for t, p in paths.items():
            loads[t].append(read_all(p))
    rows = []
    for t, p in paths.items():
        row = {"setting": label, "target_steps": t, "file_bytes": os.path.getsize(p),
               "load_ms": 1000 * statistics.median(loads[t]), "rans_parts": rans_parts(p)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        os.unlink(p)
    return rows


def main(argv=None) -> int:
    from rvqstore.blas import maybe_reexec_with_openblas

    maybe_reexec_with_openblas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--texts", nargs="+", default=["prose", "code"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "ecsq-files"))
    args = ap.parse_args(argv)

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from quality.texts import DEFAULT_TEXTS, load_tokens
    from rvqstore.model import load_model
    from rvqstore.prompt_cache import convert_prompt_cache, save_prompt_cache

    model, tok = load_model()
    texts = {t.name: t for t in DEFAULT_TEXTS}
    rows, sweep, lane_rule = [], [], []
    tmp = tempfile.mkdtemp(prefix="bench_ecsq_files_")
    for name in args.texts:
        ids = load_tokens(tok, texts[name], args.tokens)
        kv = [KVCache() for _ in model.layers]
        mx.eval(model.model(mx.array(ids)[None], cache=kv))
        originals = [(np.array(c.keys[..., :args.tokens, :]), np.array(c.values[..., :args.tokens, :])) for c in kv]
        coords = sum(k.size + v.size for k, v in originals)
        norms = [sum(float((o[s].astype(np.float64) ** 2).sum()) for o in originals) for s in (0, 1)]
        for label, bits, step in SETTINGS:
            caches = convert_prompt_cache(kv, bits, step=step)
            err = [0.0, 0.0]
            for c, o in zip(caches, originals):
                for s, x in enumerate(c.keys_and_values()):
                    err[s] += float(((np.array(x).astype(np.float64) - o[s]) ** 2).sum())
            stats = code_statistics(caches, bits)
            paths = {}
            for mode in MODES:
                paths[mode] = os.path.join(tmp, f"{name}_{bits[0]}{bits[1]}_{step}_{mode}.rvq")
                save_prompt_cache(paths[mode], caches, tokens=ids, compress=mode)
            loads = {m: [] for m in MODES}
            for _ in range(args.repeats):  # interleaved arms
                for m in MODES:
                    loads[m].append(read_all(paths[m]))
            parts = rans_parts(paths["best"])
            row = {"text": name, "setting": label, "bits": list(bits), "step": step,
                   "memory_bits_per_coord": caches[0]._keys.codec.bits_per_coordinate,
                   "key_rel_error": err[0] / norms[0], "value_rel_error": err[1] / norms[1],
                   "entropy_sep_bits_per_coord": (stats["H1"] + stats["H2"]) / coords,
                   "entropy_joint_bits_per_coord": stats["Hjoint"] / coords,
                   "rans_parts": parts,
                   **{f"{m}_bits_per_coord": 8 * os.path.getsize(paths[m]) / coords for m in MODES},
                   **{f"{m}_load_ms": 1000 * statistics.median(loads[m]) for m in MODES}}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if name == args.texts[0] and bits == (4, 3) and not sweep:
                sweep = lane_sweep(caches, bits, args.repeats)
            if name == args.texts[0] and label in LANE_RULE_SETTINGS:
                lane_rule += lane_rule_files(caches, ids, tmp, args.repeats, label)
            for p in paths.values():
                os.unlink(p)
    write_report(Path(args.out), args, rows, sweep, lane_rule)
    return 0


def write_report(out: Path, args, rows: list[dict], sweep: list[dict], lane_rule: list[dict]) -> None:
    meta = {"tokens": args.tokens, "texts": args.texts, "repeats": args.repeats,
            "load_average": os.getloadavg(), "cpu_count": os.cpu_count()}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "lane_sweep": sweep,
                                                   "lane_rule": lane_rule}, indent=1) + "\n")
    L = [f"# Uniform-grid codes in .rvq files: SmolLM2-135M, {args.tokens} tokens per text, all 30 layers",
         "",
         "`tools/bench_ecsq_files.py`. Bits per coordinate count the whole file (codes, bfloat16 scales, token ids,",
         "header). `H(i)+H(j)`: empirical entropy of the stage-1 and stage-2 codes, per coordinate (one",
         "table per coordinate, as the rans sections use), coded apart as the format's two sections are;",
         "`H(i,j)`: the joint index. `best - H`: what the file spends above `H(i)+H(j)` (scales, tokens,",
         "header, rANS tables, lane states, coder). Error: sum ||x - x_hat||^2 / sum ||x||^2.",
         f"Load: open + read every section, median of {args.repeats}, arms interleaved; load average "
         f"{meta['load_average'][0]:.1f} on {meta['cpu_count']} cores (shared machine).",
         "",
         "| text | setting | memory bits | K err | V err | auto bits | best bits | H(i)+H(j) | H(i,j) | best - H | "
         "load auto (ms) | load best (ms) |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        L.append(f"| {r['text']} | {r['setting']} | {r['memory_bits_per_coord']:.3f} | {r['key_rel_error']:.5f} | "
                 f"{r['value_rel_error']:.5f} | {r['auto_bits_per_coord']:.3f} | {r['best_bits_per_coord']:.3f} | "
                 f"{r['entropy_sep_bits_per_coord']:.3f} | {r['entropy_joint_bits_per_coord']:.3f} | "
                 f"{r['best_bits_per_coord'] - r['entropy_sep_bits_per_coord']:.3f} | {r['auto_load_ms']:.0f} | "
                 f"{r['best_load_ms']:.0f} |")
    L += ["", "rANS sections of the `best` files, by part (bytes; symbols = codes in rans sections):", "",
          "| text | setting | sections | symbols | tables | lane states | stream | tables+states per symbol (bits) |",
          "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p = r["rans_parts"]
        if p["sections"]:
            L.append(f"| {r['text']} | {r['setting']} | {p['sections']} | {p['symbols']:,} | {p['tables']:,} | "
                     f"{p['states']:,} | {p['stream']:,} | {8 * (p['tables'] + p['states']) / p['symbols']:.4f} |")
    if sweep:
        L += ["", f"Decode speed against lanes (numpy decoder, {args.texts[0]}, grid 4+3 stage-1 key codes; "
              "`writer` marks the writer's rule):", "",
              "| layers | symbols | lanes | steps | writer | stored bytes | bits/symbol | decode (ms) | M symbols/s |",
              "|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
        for r in sweep:
            L.append(f"| {r['layers']} | {r['symbols']:,} | {r['lanes']} | {r['steps']} | "
                     f"{'yes' if r['writer_rule'] else ''} | {r['stored_bytes']:,} | {r['bits_per_symbol']:.4f} | "
                     f"{r['decode_ms']:.1f} | {r['Msym_per_s']:.1f} |")
    if lane_rule:
        L += ["", f"Whole `best` files ({args.texts[0]}) with the writer aiming at fewer decode steps per section "
              "(more lanes):", "",
              "| setting | target steps | file bytes | vs 2048 | lane states (bytes) | load (ms) | load vs 2048 |",
              "|---|---:|---:|---:|---:|---:|---:|"]
        base = {r["setting"]: r for r in lane_rule if r["target_steps"] == 2048}
        for r in lane_rule:
            b0 = base[r["setting"]]
            L.append(f"| {r['setting']} | {r['target_steps']} | {r['file_bytes']:,} | "
                     f"{r['file_bytes'] / b0['file_bytes']:.4f} | {r['rans_parts']['states']:,} | {r['load_ms']:.0f} | "
                     f"{r['load_ms'] / b0['load_ms']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(L) + "\n")
    print(f"wrote {out}.md/.json")


if __name__ == "__main__":
    sys.exit(main())
