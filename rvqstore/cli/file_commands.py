"""CLI subcommands that read a ``.rvq`` file: ``inspect`` (header only) and ``verify`` (everything)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .registry import subcommand


# ---- helpers -------------------------------------------------------------------------------------
def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _jsonable(v: Any) -> Any:
    if isinstance(v, bytes):
        return v.hex()
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and v != v:  # NaN is not JSON
        return None
    return v


def _quantizer_summary(q: dict | None) -> dict | None:
    """The quantizer map with tables shortened to their shapes (the full map is in --json)."""
    if q is None:
        return None
    out: dict[str, Any] = {}
    for k, v in q.items():
        if isinstance(v, list):
            shape = [len(v)]
            if v and isinstance(v[0], list):
                shape.append(len(v[0]))
            out[k] = "x".join(map(str, shape)) + " values"
        elif isinstance(v, dict):
            out[k] = _quantizer_summary(v)
        elif isinstance(v, bytes):
            out[k] = v.hex()
        else:
            out[k] = v
    return out


def _quantizer_lines(q: dict | None) -> list[str]:
    pad = "            "
    if q is None:
        return ["quantizer   none (all layers dense)"]
    s = _quantizer_summary(q) or {}
    lines = [f"quantizer   {s.get('name')} v{s.get('version')}"]
    if q.get("name") == "turboquant-rvq":
        b2 = q.get("bits2")
        lines[0] += (f": dim {q.get('dim')}, bits {q.get('bits1')}+{b2}"
                     + (f", {q.get('residual')} residual" if b2 else " (single stage)")
                     + f", scales {q.get('scale_dtype')}")
        rot = s.get("rotation") or {}
        lines.append(f"{pad}rotation {rot.get('kind')}, prng {rot.get('prng')}, seed {rot.get('seed')}, "
                     f"signs {rot.get('signs')}")
        tables = [f"{k} {s[k]}" for k in ("centroids1", "boundaries1", "centroids2", "boundaries2") if k in s]
        lines.append(f"{pad}tables: " + ", ".join(tables) + " (--json prints them)")
        return lines
    for k, v in s.items():
        if k in ("name", "version"):
            continue
        if isinstance(v, dict):
            lines.extend(f"{pad}{k}.{k2} = {v2}" for k2, v2 in v.items())
        else:
            lines.append(f"{pad}{k} = {v}")
    return lines


def _codec_state(L) -> dict | None:
    """Sink positions and key mean of an rvq layer (or of its list children), None where none."""
    subs = [c for c in (L.children or (L,)) if c.sink_tokens or c.center_keys]
    if not subs:
        return None
    c = subs[0]
    return {"sink_tokens": c.sink_tokens, "n_sink": c.n_sink, "center_keys": c.center_keys,
            "key_mean": "keys.mean" in c.sections}


def _codec_state_lines(layers: list[dict]) -> list[str]:
    """One line per run of layers with the same codec state (inspect's table has no room for it)."""
    runs: list[tuple[int, int, dict]] = []
    for r in layers:
        st = r.get("codec_state")
        if st is None:
            continue
        if runs and runs[-1][2] == st and runs[-1][1] == r["index"] - 1:
            runs[-1] = (runs[-1][0], r["index"], st)
        else:
            runs.append((r["index"], r["index"], st))
    out = []
    for a, b, st in runs:
        what = []
        if st["sink_tokens"]:
            what.append(f"first {st['n_sink']} position(s) exact (sink_tokens {st['sink_tokens']})")
        if st["center_keys"]:
            what.append("keys centered " + ("by a stored per-head mean" if st["key_mean"] else "(no coded key yet)"))
        out.append(f"codec state  layer{'s' if b > a else ''} {a}" + (f"-{b}" if b > a else "") + ": " + "; ".join(what))
    return out


def describe(f) -> dict[str, Any]:
    """Everything ``inspect`` reports, from the header alone (no section is read)."""
    h = f.header
    by_name = {s.name: s for s in f.sections}
    layers = []
    tot = {"stored_bytes": 0, "resident_bytes": 0, "fp16_bytes": 0, "coordinates": 0, "vectors": 0}
    for L in f.layers:
        secs = [by_name[n] for n in L.sections.values()]
        stored = sum(s.length for s in secs)
        resident = sum(s.raw_length for s in secs)
        coords = sum(c.batch * c.n_kv_heads * c.n_tokens * (c.head_dim + c.value_head_dim)  # keys + values
                     for c in (L.children or (L,)) if c.is_attention)  # state arrays have no coordinates
        fp16 = 2 * coords
        row = {
            "index": L.index, "kind": L.kind, "n_tokens": L.n_tokens, "n_dense_tokens": L.n_dense_tokens,
            "batch": L.batch, "n_kv_heads": L.n_kv_heads, "head_dim": L.head_dim,
            "key_dtype": L.key_dtype, "value_dtype": L.value_dtype,
            "stored_bytes": stored, "resident_bytes": resident, "fp16_bytes": fp16,
            "ratio": (fp16 / stored) if stored else None,
            "bits_per_coordinate": (8 * stored / coords) if coords else None,
            "sections": {k: n for k, n in L.sections.items()},
            "codec_state": _codec_state(L),  # format 1.2: sink positions and key mean, None without
        }
        layers.append(row)
        tot["stored_bytes"] += stored
        tot["resident_bytes"] += resident
        tot["fp16_bytes"] += fp16
        tot["coordinates"] += coords
    tok = [s for s in f.sections if s.kind == "tokens"]
    other = [s for s in f.sections if s.layer == -1 or not s.known]
    totals = {
        "layers": len(layers),
        "stored_bytes": tot["stored_bytes"],
        "resident_bytes": tot["resident_bytes"],
        "fp16_bytes": tot["fp16_bytes"],
        "ratio": (tot["fp16_bytes"] / tot["stored_bytes"]) if tot["stored_bytes"] else None,
        "bits_per_coordinate": (8 * tot["stored_bytes"] / tot["coordinates"]) if tot["coordinates"] else None,
    }
    return {
        "file": f.path,
        "format_version": [h.major, h.minor],
        "flags": h.flags,
        "required_features": list(h.required_features),
        "file_bytes": h.file_length,
        "header_offset": h.header_offset,
        "header_bytes": h.header_length,
        "n_tokens": h.n_tokens,
        "token_ids_stored": bool(tok),
        "model": h.model,
        "metadata": h.metadata,
        "quantizer": h.quantizer,
        "quantizers": list(h.quantizers) if h.quantizers is not None else None,  # feature quantizer-table
        "layers": layers,
        "totals": totals,
        "memory": {
            "at_rest_bytes": h.file_length,
            "resident_packed_bytes": tot["resident_bytes"],
            "decoded_fp16_bytes": tot["fp16_bytes"],
        },
        "other_sections": [s.to_dict() for s in other],
        "sections": [s.to_dict() for s in f.sections],
    }


def _print_inspect(d: dict[str, Any], out) -> None:
    w = out.write
    w(f"file        {d['file']}\n")
    feats = ", ".join(d["required_features"]) or "none"
    w(f"format      rvq {d['format_version'][0]}.{d['format_version'][1]}  flags {d['flags']:#010x}  "
      f"required features: {feats}\n")
    w(f"size        {d['file_bytes']:,} bytes ({_fmt_bytes(d['file_bytes'])}); header {d['header_bytes']:,} bytes "
      f"at offset {d['header_offset']:,}; {len(d['sections'])} sections\n")
    m = d["model"]
    if m:
        w("model       " + "\n            ".join(f"{k} = {v}" for k, v in m.items()) + "\n")
    else:
        w("model       (no fingerprint recorded)\n")
    w(f"tokens      {d['n_tokens']:,}" + ("  (token ids stored)" if d["token_ids_stored"] else "  (no token ids)") + "\n")
    if d["metadata"]:
        w("metadata    " + "\n            ".join(f"{k} = {v}" for k, v in d["metadata"].items()) + "\n")
    if d.get("quantizers"):  # one quantizer per layer side (feature quantizer-table)
        for i, q in enumerate(d["quantizers"]):
            for line in _quantizer_lines(q):
                w(line.replace("quantizer  ", f"quantizer {i}", 1) if line.startswith("quantizer") else line)
                w("\n")
    else:
        for line in _quantizer_lines(d["quantizer"]):
            w(line + "\n")
    w("\n")
    hdr = (f"{'layer':>5} {'kind':<5} {'tokens':>8} {'dense':>6} {'batch':>5} {'heads':>5} {'dim':>5} "
           f"{'stored B':>14} {'fp16 B':>14} {'ratio':>7} {'bits/coord':>10}\n")
    w(hdr)
    for r in d["layers"]:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        bpc = f"{r['bits_per_coordinate']:.3f}" if r["bits_per_coordinate"] else "-"
        w(f"{r['index']:>5} {r['kind']:<5} {r['n_tokens']:>8,} {r['n_dense_tokens']:>6,} {r['batch'] or '-':>5} "
          f"{r['n_kv_heads'] or '-':>5} {r['head_dim'] or '-':>5} {r['stored_bytes']:>14,} {r['fp16_bytes']:>14,} {ratio:>7} {bpc:>10}\n")
    t = d["totals"]
    ratio = f"{t['ratio']:.2f}x" if t["ratio"] else "-"
    bpc = f"{t['bits_per_coordinate']:.3f}" if t["bits_per_coordinate"] else "-"
    w(f"{'total':>5} {'':<5} {'':>8} {'':>6} {'':>5} {'':>5} {'':>5} {t['stored_bytes']:>14,} "
      f"{t['fp16_bytes']:>14,} {ratio:>7} {bpc:>10}\n")
    state = _codec_state_lines(d["layers"])
    if state:
        w("\n" + "\n".join(state) + "\n")
    if d["other_sections"]:
        w("\nother sections: " + ", ".join(f"{s['name']} ({s['kind']}, {s['length']:,} B)" for s in d["other_sections"]) + "\n")
    mem = d["memory"]
    w("\nmemory\n")
    w(f"  at rest (file)                 {mem['at_rest_bytes']:>16,} B  {_fmt_bytes(mem['at_rest_bytes']):>11}\n")
    w(f"  resident as packed codes       {mem['resident_packed_bytes']:>16,} B  "
      f"{_fmt_bytes(mem['resident_packed_bytes']):>11}  (codes + scales + dense, uncompressed)\n")
    w(f"  decoded (fp16 keys + values)   {mem['decoded_fp16_bytes']:>16,} B  {_fmt_bytes(mem['decoded_fp16_bytes']):>11}\n")


# ---- inspect -------------------------------------------------------------------------------------------------
def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the .rvq file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


@subcommand("inspect", help="show what a .rvq file holds (reads only its header)", configure=_inspect_args)
def cmd_inspect(args: argparse.Namespace) -> int:
    from ..format import open_rvq

    with open_rvq(args.file) as f:
        d = describe(f)
    if args.json:
        json.dump(_jsonable(d), sys.stdout, indent=1, sort_keys=False)
        sys.stdout.write("\n")
    else:
        _print_inspect(d, sys.stdout)
    return 0


# ---- verify --------------------------------------------------------------------------------------------------
def _verify_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="the .rvq file")
    p.add_argument("--no-decode", action="store_true",
                   help="check checksums and section decoding only, skip decoding codes with the codec")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")


@subcommand("verify", help="check every checksum and decode every section of a .rvq file", configure=_verify_args)
def cmd_verify(args: argparse.Namespace) -> int:
    from ..format import open_rvq
    from ..format.quantizer import decode_layers

    decoded = {"vectors": 0}

    def decode(f) -> None:
        decoded["vectors"] = decode_layers(f)

    with open_rvq(args.file) as f:
        counts = f.verify(decode=None if args.no_decode else decode)
    if not args.quiet:
        msg = (f"OK {args.file}: {counts['sections']} sections, {counts['stored_bytes']:,} stored bytes checksummed, "
               f"{counts['raw_bytes']:,} bytes decoded")
        if not args.no_decode:
            msg += f", {decoded['vectors']:,} vectors decoded by the codec"
        print(msg)
    return 0
