#!/usr/bin/env python3
"""Regenerate the ``.rvq`` v1 test vectors in ``format_spec/vectors/`` byte for byte.

    python tools/make_format_vectors.py [OUT_DIR]          # default: format_spec/vectors
    python tools/make_format_vectors.py --worked-example   # print the spec's worked-example dump
    python tools/make_format_vectors.py --update-spec      # rewrite the generated blocks of the spec

The files are assembled here by a small, independent implementation of the container (it shares only
the constants with ``rvqstore.format``), so the vectors also cross-check the library's writer: a test
asserts that ``write_rvq`` produces the raw-only valid vectors byte for byte.  Everything is
deterministic: no clock, no random state, no zstd library (the zstd frames are hand-assembled from
raw and RLE blocks, so the bytes do not depend on the zstd version installed).

``valid/``: files every v1 reader MUST open and decode; each ``NAME.rvq`` has ``NAME.json`` with the
expected header fields and every section's decoded contents.  ``invalid/``: one file per failure kind;
``invalid/MANIFEST.json`` gives each file's reason, the error class a reader MUST raise, and the stage
where it must be raised (``open``: by ``open_rvq``; ``read``: by reading the section / ``verify()``;
``decode``: by ``rvqstore verify``'s codec decoding).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import struct
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

import msgpack
import xxhash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rvqstore.format import constants as C  # noqa: E402  (constants only)

XXH = xxhash.xxh3_64_intdigest


# ---- deterministic data ------------------------------------------------------------------------------
def splitmix(seed: int):
    s = seed & 0xFFFFFFFFFFFFFFFF
    while True:
        s = (s + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        yield z ^ (z >> 31)


def codes_words(seed: int, n_vectors: int, dim: int, bits: int) -> list[int]:
    """Packed words of pseudo-random codes, LSB-first, unused bits zero."""
    g = splitmix(seed)
    per = 32 // bits
    words_per = -(-dim // per)
    out = []
    for _ in range(n_vectors):
        for w in range(words_per):
            n = min(per, dim - w * per)
            word = 0
            for j in range(n):
                word |= (next(g) >> 61 & ((1 << bits) - 1)) << (j * bits)
            out.append(word)
    return out


def bf16_bits(values: list[float]) -> list[int]:
    """Round-to-nearest-even bfloat16 bit patterns of float32 values."""
    out = []
    for v in values:
        u = struct.unpack("<I", struct.pack("<f", v))[0]
        u += 0x7FFF + ((u >> 16) & 1)
        out.append((u >> 16) & 0xFFFF)
    return out


def f16_values(seed: int, n: int) -> list[float]:
    g = splitmix(seed)
    vals = []
    for _ in range(n):
        x = ((next(g) >> 40) / float(1 << 24)) * 4.0 - 2.0  # in [-2, 2)
        vals.append(struct.unpack("<e", struct.pack("<e", x))[0])
    return vals


def pack(fmt: str, values) -> bytes:
    return struct.pack("<" + fmt * len(values), *values)


# ---- the quantizer maps (literal copies of RVQCodec(...).to_header(); the file is self-describing) ---
Q_DIM8_1_1 = {
    "name": "turboquant-rvq", "version": 1, "dim": 8, "bits1": 1, "bits2": 1, "residual": "conditional",
    "scale_dtype": "bfloat16",
    "rotation": {"kind": "randomized-hadamard", "seed": 7, "prng": "splitmix64-msb-sign", "signs": b"\x0c"},
    "centroids1": [-0.7978845834732056, 0.7978845834732056],
    "boundaries1": [0.0],
    "centroids2": [[-1.5104175806045532, -0.4527800381183624], [0.4527800381183624, 1.5104175806045532]],
    "boundaries2": [[-0.9815987944602966], [0.9815987944602966]],
}
Q_DIM16_2_2 = {
    "name": "turboquant-rvq", "version": 1, "dim": 16, "bits1": 2, "bits2": 2, "residual": "conditional",
    "scale_dtype": "bfloat16",
    "rotation": {"kind": "randomized-hadamard", "seed": 1, "prng": "splitmix64-msb-sign", "signs": b"\xe7*"},
    "centroids1": [-1.5104175806045532, -0.4527800381183624, 0.4527800381183624, 1.5104175806045532],
    "boundaries1": [-0.9815987944602966, 0.0, 0.9815987944602966],
    "centroids2": [[-2.662278413772583, -1.9839154481887817, -1.5200012922286987, -1.1453282833099365],
                   [-0.8451938629150391, -0.5919278860092163, -0.3507535755634308, -0.11621203273534775],
                   [0.11621203273534775, 0.3507535755634308, 0.5919278860092163, 0.8451938629150391],
                   [1.1453282833099365, 1.5200012922286987, 1.9839154481887817, 2.662278413772583]],
    "boundaries2": [[-2.323096990585327, -1.7519583702087402, -1.3326648473739624],
                    [-0.7185608744621277, -0.47134071588516235, -0.23348279297351837],
                    [0.23348279297351837, 0.47134071588516235, 0.7185608744621277],
                    [1.3326648473739624, 1.7519583702087402, 2.323096990585327]],
}
Q_DIM12_3_0 = {
    "name": "turboquant-rvq", "version": 1, "dim": 12, "bits1": 3, "bits2": 0, "residual": "none",
    "scale_dtype": "bfloat16",
    "rotation": {"kind": "randomized-hadamard", "seed": 2, "prng": "splitmix64-msb-sign", "signs": b"\xcf\x02"},
    "centroids1": [-2.1519455909729004, -1.3439092636108398, -0.7560052871704102, -0.2450941801071167,
                   0.2450941801071167, 0.7560052871704102, 1.3439092636108398, 2.1519455909729004],
    "boundaries1": [-1.7479275465011597, -1.049957275390625, -0.5005497336387634, 0.0, 0.5005497336387634,
                    1.049957275390625, 1.7479275465011597],
}


# ---- zstd frames by hand (RFC 8878) ---------------------------------------------------------------------
def zstd_frame(blocks: list[tuple[str, bytes | tuple[int, int]]], content_size: int | None) -> bytes:
    """A single-segment zstd frame.  blocks: ("raw", data) or ("rle", (byte, count)).

    Frame_Header_Descriptor: FCS field of 8 bytes (flag 3) + Single_Segment when content_size is
    given; otherwise no FCS and a Window_Descriptor (single segment off).
    """
    out = bytearray(C.ZSTD_MAGIC)
    if content_size is not None:
        out.append(0xE0)  # FCS_flag=3 (8 bytes), Single_Segment=1, no checksum, no dictionary
        out += content_size.to_bytes(8, "little")
    else:
        out.append(0x00)  # FCS_flag=0, Single_Segment=0 -> Window_Descriptor follows, no FCS
        out.append(0x58)  # window log 10 + 11 = 21 (2 MiB)
    for i, (kind, payload) in enumerate(blocks):
        last = 1 if i == len(blocks) - 1 else 0
        if kind == "raw":
            assert isinstance(payload, bytes)
            out += ((len(payload) << 3) | (0 << 1) | last).to_bytes(3, "little") + payload
        else:
            byte, count = payload  # type: ignore[misc]
            out += ((count << 3) | (1 << 1) | last).to_bytes(3, "little") + bytes([byte])
    return bytes(out)


# ---- the independent assembler -----------------------------------------------------------------------------
def canon(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: canon(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [canon(v) for v in obj]
    return obj


def packb(obj: Any) -> bytes:
    return msgpack.packb(canon(obj), use_bin_type=True, use_single_float=False)


def sec(name: str, layer: int, kind: str, dtype: str, shape: list[int], data: bytes, codec: str = "raw",
        raw_length: int | None = None) -> dict:
    return {"name": name, "layer": layer, "kind": kind, "dtype": dtype, "shape": list(shape), "codec": codec,
            "raw_length": len(data) if raw_length is None else raw_length, "_data": data}


def align(n: int) -> int:
    return -(-n // C.ALIGNMENT) * C.ALIGNMENT


def assemble(
    content: dict,
    sections: list[dict],
    *,
    major: int = 1,
    minor: int = 0,
    flags: int = 0,
    features: list[str] | None = None,
    offsets: list[int] | None = None,
    edit_header: Callable[[dict], None] | None = None,
    header_bytes: Callable[[bytes], bytes] | None = None,
    header_offset: int | None = None,
    edit_preamble: Callable[[dict], None] | None = None,
    fix_preamble_checksum: bool = True,
    post: Callable[[bytes], bytes] | None = None,
) -> bytes:
    content = copy.deepcopy(content)  # edits must never leak into the shared literals
    entries, blobs = [], []
    pos = C.PREAMBLE_SIZE
    for i, s in enumerate(sections):
        data = s["_data"]
        off = offsets[i] if offsets is not None else align(pos)
        e = {k: v for k, v in s.items() if k != "_data"}
        e.update(offset=off, length=len(data), checksum=XXH(data))
        entries.append(e)
        blobs.append((off, data))
        pos = max(pos, off + len(data))
    if features is None:
        features = ["zstd"] if any(e["codec"] == "zstd" for e in entries) else []
    header = {"format_version": [major, minor], "required_features": list(features), "sections": entries}
    header.update(content)
    if edit_header is not None:
        edit_header(header)
    hb = packb(header)
    if header_bytes is not None:
        hb = header_bytes(hb)
    h_off = align(pos) if header_offset is None else header_offset
    body = bytearray(h_off + len(hb))
    for off, data in blobs:
        body[off: off + len(data)] = data
    body[h_off: h_off + len(hb)] = hb
    fields = {"magic": C.MAGIC, "major": major, "minor": minor, "flags": flags, "header_offset": h_off,
              "header_length": len(hb), "header_checksum": XXH(hb), "file_length": len(body), "reserved": 0,
              "preamble_checksum": None}
    if edit_preamble is not None:
        edit_preamble(fields)
    pre = struct.pack("<8sHHIQQQQQ", fields["magic"], fields["major"], fields["minor"], fields["flags"],
                      fields["header_offset"], fields["header_length"], fields["header_checksum"],
                      fields["file_length"], fields["reserved"])
    ck = fields["preamble_checksum"]
    if ck is None or not fix_preamble_checksum:
        ck = XXH(pre) if ck is None else ck
    body[0:64] = pre + ck.to_bytes(8, "little")
    out = bytes(body)
    return post(out) if post is not None else out


# ---- the valid files -----------------------------------------------------------------------------------------
def layer_map(index, kind, batch, heads, dim, n_tokens, n_dense, kd="float16", vd="float16") -> dict:
    return {"index": index, "kind": kind, "batch": batch, "n_kv_heads": heads, "head_dim": dim,
            "n_tokens": n_tokens, "n_dense_tokens": n_dense, "key_dtype": kd, "value_dtype": vd}


def rvq_sections(layer: int, q: dict, B: int, H: int, Tq: int, seed: int) -> list[dict]:
    dim, b1, b2 = q["dim"], q["bits1"], q["bits2"]
    out = []
    for side_i, side in enumerate(("keys", "values")):
        s0 = seed * 100 + side_i * 10
        w1 = codes_words(s0 + 1, B * H * Tq, dim, b1)
        out.append(sec(f"layers.{layer}.{side}.codes1", layer, f"{side}.codes1", "uint32",
                       [B, H, Tq, -(-dim // (32 // b1))], pack("I", w1)))
        if b2:
            w2 = codes_words(s0 + 2, B * H * Tq, dim, b2)
            out.append(sec(f"layers.{layer}.{side}.codes2", layer, f"{side}.codes2", "uint32",
                           [B, H, Tq, -(-dim // (32 // b2))], pack("I", w2)))
        scales = bf16_bits([1.0 + 0.25 * ((s0 + i) % 7) for i in range(B * H * Tq)])
        out.append(sec(f"layers.{layer}.{side}.scales", layer, f"{side}.scales", "bfloat16", [B, H, Tq],
                       pack("H", scales)))
    return out


def dense_bytes(dtype: str, seed: int, n: int) -> bytes:
    vals = f16_values(seed, n)
    if dtype == "float16":
        return pack("e", vals)
    if dtype == "bfloat16":
        return pack("H", bf16_bits(vals))
    return pack("f", vals)


def v_worked_example() -> tuple[dict, list[dict]]:
    """The spec's worked example: one rvq layer, dim 8, 1+1 bits, two tokens."""
    q = Q_DIM8_1_1
    content = {"n_tokens": 2, "layers": [layer_map(0, "rvq", 1, 1, 8, 2, 0)], "quantizer": q,
               "model": {"arch": "example"}, "metadata": {"note": "worked example"}}
    secs = [sec("tokens", -1, "tokens", "int32", [2], pack("i", [17, 42]))] + rvq_sections(0, q, 1, 1, 2, 1)
    return content, secs


def v_dense_minimal() -> tuple[dict, list[dict]]:
    content = {"n_tokens": 2, "layers": [layer_map(0, "dense", 1, 1, 4, 2, 2)], "quantizer": None,
               "model": None, "metadata": {}}
    secs = [sec("tokens", -1, "tokens", "int32", [2], pack("i", [1, 2])),
            sec("layers.0.keys.dense", 0, "keys.dense", "float16", [1, 1, 2, 4], dense_bytes("float16", 5, 8)),
            sec("layers.0.values.dense", 0, "values.dense", "float16", [1, 1, 2, 4], dense_bytes("float16", 6, 8))]
    return content, secs


def v_full(zstd: bool = True) -> tuple[dict, list[dict]]:
    """Two rvq layers (dim 16, 2+2 bits, 2 heads, 3 tokens); layer 0 keeps its last token dense
    (keys float16, values bfloat16); tokens and one scales section are zstd frames."""
    q = Q_DIM16_2_2
    B, H, T = 1, 2, 3
    content = {
        "n_tokens": T,
        "layers": [layer_map(0, "rvq", B, H, 16, T, 1, "float16", "bfloat16"),
                   layer_map(1, "rvq", B, H, 16, T, 0, "float16", "bfloat16")],
        "quantizer": q,
        "model": {"arch": "llama", "n_layers": 2, "weights_sha256": "00" * 32},
        "metadata": {"prompt": "Hello, world", "saved_by": "make_format_vectors"},
    }
    tok = pack("i", [1, 15043, 29892])
    secs = [sec("tokens", -1, "tokens", "int32", [T], zstd_frame([("raw", tok)], len(tok)) if zstd else tok,
                "zstd" if zstd else "raw", len(tok))]
    l0 = rvq_sections(0, q, B, H, T - 1, 2)
    l0 += [sec("layers.0.keys.dense", 0, "keys.dense", "float16", [B, H, 1, 16], dense_bytes("float16", 9, B * H * 16)),
           sec("layers.0.values.dense", 0, "values.dense", "bfloat16", [B, H, 1, 16],
               dense_bytes("bfloat16", 10, B * H * 16))]
    l1 = rvq_sections(1, q, B, H, T, 3)
    if zstd:  # layer 1's value scales: all equal, as an RLE block (2 heads x 3 tokens of bf16 1.0 = 0x3f80)
        ones = pack("H", [0x3F80] * (B * H * T))
        for i, s in enumerate(l1):
            if s["kind"] == "values.scales":
                frame = zstd_frame([("raw", ones[:4]), ("raw", ones[4:])], len(ones))
                l1[i] = sec(s["name"], 1, s["kind"], "bfloat16", s["shape"], frame, "zstd", len(ones))
    return content, secs + l0 + l1


def v_single_stage_dim12() -> tuple[dict, list[dict]]:
    q = Q_DIM12_3_0
    content = {"n_tokens": 4, "layers": [layer_map(0, "rvq", 2, 1, 12, 4, 0, "bfloat16", "bfloat16")],
               "quantizer": q, "model": None, "metadata": {}}
    secs = [sec("tokens", -1, "tokens", "int32", [4], pack("i", [5, 6, 7, 8]))] + rvq_sections(0, q, 2, 1, 4, 4)
    return content, secs


def v_empty() -> tuple[dict, list[dict]]:
    return {"n_tokens": 0, "layers": [], "quantizer": None, "model": None, "metadata": {}}, []


def v_zero_tokens() -> tuple[dict, list[dict]]:
    q = Q_DIM8_1_1
    content = {"n_tokens": 0, "layers": [layer_map(0, "rvq", 1, 1, 8, 0, 0)], "quantizer": q, "model": None,
               "metadata": {}}
    return content, [sec("tokens", -1, "tokens", "int32", [0], b"")] + rvq_sections(0, q, 1, 1, 0, 5)


def v_newer_minor() -> bytes:
    """Minor version 7 with things a 1.0 reader must skip: an unknown top-level key, unknown keys in a
    section entry and a layer map, and a section of unknown kind."""
    content, secs = v_worked_example()
    content = dict(content)
    content["layers"] = [dict(content["layers"][0], future_layer_key=[1, 2, 3])]
    content["future_top_level_key"] = {"anything": ["goes", 1, 2.5, None, True, b"\x00"]}
    secs = list(secs) + [sec("future.blob", -1, "future.kind", "uint8", [5], b"hello")]
    secs[1] = dict(secs[1], future_section_key="ignored")
    return assemble(content, secs, minor=7)


# ---- decoded values: the reference decoder (exact arithmetic, one rounding) ------------------------------
#: The output formats: (precision in bits incl. the implicit one, minimum normal exponent, maximum exponent).
FORMATS = {"float32": (24, -126, 127), "float16": (11, -14, 15), "bfloat16": (8, -126, 127)}


def round_fraction(q: Fraction, dtype: str) -> int:
    """Bit pattern of the ``dtype`` value nearest to the exact rational ``q`` (ties to even)."""
    p, emin, emax = FORMATS[dtype]
    neg = q < 0
    a = -q if neg else q
    if a == 0:
        v = 0.0
    else:
        e = a.numerator.bit_length() - a.denominator.bit_length()  # floor(log2 a) or one more
        if Fraction(2) ** e > a:
            e -= 1
        e = max(e, emin)
        quantum = Fraction(2) ** (e - p + 1)
        n = a / quantum
        N = n.numerator // n.denominator
        rem = n - N
        if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and N % 2 == 1):
            N += 1
        v_exact = N * quantum
        v = float("inf") if v_exact >= Fraction(2) ** (emax + 1) else float(v_exact)  # exact: representable
    if neg:
        v = -v
    if dtype == "float32":
        return struct.unpack("<I", struct.pack("<f", v))[0]
    if dtype == "float16":
        return struct.unpack("<H", struct.pack("<e", v))[0]
    return struct.unpack("<I", struct.pack("<f", v))[0] >> 16  # representable: the low half is zero


NAN_BITS = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0}


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def _sylvester(i: int, j: int) -> int:
    return -1 if bin(i & j).count("1") % 2 else 1


def rotation_matrix(dim: int) -> list[list[int]]:
    """M = kron(A_m, S_(2^k)) for dim = m * 2^k, from the spec's appendix matrices."""
    from rvqstore.hadamard import BASE_MATRICES  # the appendix text (a test checks spec == code)

    m = next(m for m in (28, 20, 12, 1) if dim % m == 0 and (dim // m) & (dim // m - 1) == 0)
    A = [[1]] if m == 1 else [[1 if ch == "+" else -1 for ch in row] for row in BASE_MATRICES[m]]
    P = dim // m
    return [[A[r // P][c // P] * _sylvester(r % P, c % P) for c in range(dim)] for r in range(dim)]


def unpack_codes(words: list[int], dim: int, bits: int) -> list[int]:
    per = 32 // bits
    return [(words[j // per] >> ((j % per) * bits)) & ((1 << bits) - 1) for j in range(dim)]


def decode_reference(q: dict, scale_bits: int, w1: list[int], w2: list[int] | None, out_dtype: str) -> list[int]:
    """Bit patterns of one decoded vector (spec section 10, "Decoded values")."""
    dim, b1, b2 = q["dim"], q["bits1"], q["bits2"]
    if (scale_bits & 0x7F80) == 0x7F80 and scale_bits & 0x7F:  # NaN scale: the vector held NaN/Inf
        return [NAN_BITS[out_dtype]] * dim
    s = Fraction(struct.unpack("<f", struct.pack("<I", scale_bits << 16))[0])
    c1 = [f32(v) for v in q["centroids1"]]
    i = unpack_codes(w1, dim, b1)
    if b2:
        c2 = [[f32(v) for v in row] for row in q["centroids2"]]
        j = unpack_codes(w2, dim, b2)
        if q["residual"] == "conditional":
            y = [c2[a][b] for a, b in zip(i, j)]
        else:  # shared: the one float32 rounding before the rotation
            y = [f32(c1[a] + c2[a][b]) for a, b in zip(i, j)]
    else:
        y = [c1[a] for a in i]
    M = rotation_matrix(dim)
    signs = q["rotation"]["signs"]
    out = []
    for c in range(dim):
        u = sum(Fraction(y[r]) * M[c][r] for r in range(dim)) / dim
        sg = -1 if signs[c // 8] >> (c % 8) & 1 else 1
        out.append(round_fraction(u * sg * s, out_dtype))
    return out


#: Decoders may differ from the reference value r (in the output dtype) by at most
#: TOL_SCALE * s + one unit in the last place of the output dtype at r (spec section 10).
TOL_SCALE = 2.0 ** -20


# ---- vectors of the decode math (dims with non-symmetric base matrices, every stage width) ---------------
def codes_words_full(seed: int, n_vectors: int, dim: int, bits: int) -> list[int]:
    """Like codes_words, but every code value 0 .. 2^bits - 1 occurs (top bits of each draw)."""
    g = splitmix(seed)
    per = 32 // bits
    out = []
    for _ in range(n_vectors):
        for w in range(-(-dim // per)):
            word = 0
            for j in range(min(per, dim - w * per)):
                word |= (next(g) >> (64 - bits)) << (j * bits)
            out.append(word)
    return out


def quantizer(dim: int, bits: tuple[int, int], seed: int, residual: str = "conditional",
              step: float | None = None) -> dict:
    """The map RVQCodec(...).to_header() writes (its tables are data; the decode here is our own).
    With ``step``, a uniform grid: its tables are checked against :func:`grid_tables` first."""
    from rvqstore import RVQCodec

    q = RVQCodec(dim, bits, seed=seed, residual=residual, use_kernels=False, step=step).to_header()
    if step is not None:
        want = grid_tables(*bits, step)
        got = {"c1": q["centroids1"], "b1": q["boundaries1"]}
        if bits[1]:
            got |= {"c2": q["centroids2"], "b2": q["boundaries2"]}
        assert {k: json.loads(json.dumps(v)) for k, v in got.items()} == want, "grid tables differ from the rule"
    return json.loads(json.dumps({k: v for k, v in q.items() if k != "rotation"})) | {
        "rotation": dict(q["rotation"])}


def grid_tables(b1: int, b2: int, step: float) -> dict:
    """A uniform grid's tables written from its rule alone (spec section 10, "Uniform grids"): points
    (k - (L-1)/2) * step rounded once to float32, thresholds the float32 midpoints, stage-1 boundaries
    every 2^b2-th threshold, stage-1 centroids the float32 mean of each cell's points."""
    f32 = lambda v: struct.unpack("<f", struct.pack("<f", v))[0]  # noqa: E731
    L, l2 = 1 << (b1 + b2), 1 << b2
    pts = [f32((k - (L - 1) / 2.0) * step) for k in range(L)]
    th = [f32((pts[k] + pts[k + 1]) / 2.0) for k in range(L - 1)]
    if not b2:
        return {"c1": pts, "b1": th}
    cells = [pts[i * l2:(i + 1) * l2] for i in range(L // l2)]
    return {"c1": [f32(math.fsum(c) / l2) for c in cells], "b1": th[l2 - 1::l2], "c2": cells,
            "b2": [th[i * l2:i * l2 + l2 - 1] for i in range(L // l2)]}


def coded_sections(prefix: str, layer: int, q: dict, B: int, H: int, Tq: int, seed: int,
                   scale_values: list[float] | None = None, nan_at: int | None = None) -> list[dict]:
    """codes1/codes2/scales of one side, named ``layers.<layer>.<prefix>``."""
    dim, b1, b2 = q["dim"], q["bits1"], q["bits2"]
    kind = prefix
    n = B * H * Tq
    out = [sec(f"layers.{layer}.{kind}.codes1", layer, f"{kind}.codes1", "uint32",
               [B, H, Tq, -(-dim // (32 // b1))], pack("I", codes_words_full(seed + 1, n, dim, b1)))]
    if b2:
        out.append(sec(f"layers.{layer}.{kind}.codes2", layer, f"{kind}.codes2", "uint32",
                       [B, H, Tq, -(-dim // (32 // b2))], pack("I", codes_words_full(seed + 2, n, dim, b2))))
    vals = scale_values or [0.5 + 0.375 * ((seed + i) % 9) for i in range(n)]
    bits = bf16_bits(vals[:n])
    if nan_at is not None:
        bits[nan_at] = 0x7FC0
    out.append(sec(f"layers.{layer}.{kind}.scales", layer, f"{kind}.scales", "bfloat16", [B, H, Tq], pack("H", bits)))
    return out


def v_decode(dim: int, bits: tuple[int, int], residual: str, dtypes: tuple[str, str], seed: int,
             nan_at: int | None = None, T: int = 3, H: int = 2, step: float | None = None) -> tuple[dict, list[dict]]:
    q = quantizer(dim, bits, seed, residual, step)
    content = {"n_tokens": T, "layers": [layer_map(0, "rvq", 1, H, dim, T, 0, *dtypes)], "quantizer": q,
               "model": None, "metadata": {}}
    secs = [sec("tokens", -1, "tokens", "int32", [T], pack("i", list(range(100, 100 + T))))]
    secs += coded_sections("keys", 0, q, 1, H, T, seed * 10, nan_at=nan_at)
    secs += coded_sections("values", 0, q, 1, H, T, seed * 10 + 5)
    return content, secs


DECODE_VECTORS = {
    "dim20_shared_4_2_f32.rvq": lambda: v_decode(20, (4, 2), "shared", ("float32", "float32"), 11, nan_at=1),
    "dim24_2_2_bf16.rvq": lambda: v_decode(24, (2, 2), "conditional", ("bfloat16", "bfloat16"), 12),
    "dim28_4_0_f16.rvq": lambda: v_decode(28, (4, 0), "conditional", ("float16", "float32"), 13),
    "dim40_1_3_shared_f16.rvq": lambda: v_decode(40, (1, 3), "shared", ("float16", "bfloat16"), 14),
    "dim56_3_1_f32.rvq": lambda: v_decode(56, (3, 1), "conditional", ("float32", "float16"), 15, nan_at=0),
    # a uniform grid (RVQCodec(step=...)): ordinary conditional tables, decoded by the same rules
    "dim32_grid_3_2_f16.rvq": lambda: v_decode(32, (3, 2), "conditional", ("float16", "float16"), 16, step=0.15),
}


# ---- revision 1.1: layer kinds, per-side geometry, quantizer tables ------------------------------------------
def att_map(index, kind, B, H, D, T, nd, kd, vd, **extra) -> dict:
    return dict(layer_map(index, kind, B, H, D, T, nd, kd, vd), **extra)


def v_rotating() -> tuple[dict, list[dict]]:
    """An rvq-rotating layer (window 4 incl. 1 sink token, 9 tokens seen: 4 kept in temporal order) next
    to a plain rvq layer; one dense token in the window."""
    q = quantizer(20, (2, 2), 21)
    T = 9
    content = {"n_tokens": T, "quantizer": q, "model": None, "metadata": {},
               "layers": [att_map(0, "rvq", 1, 1, 20, T, 0, "float16", "float16"),
                          att_map(1, "rvq-rotating", 1, 1, 20, 4, 1, "float16", "float16",
                                  max_size=4, keep=1, offset=T)]}
    secs = [sec("tokens", -1, "tokens", "int32", [T], pack("i", list(range(1, T + 1))))]
    secs += coded_sections("keys", 0, q, 1, 1, T, 210) + coded_sections("values", 0, q, 1, 1, T, 215)
    secs += coded_sections("keys", 1, q, 1, 1, 3, 220) + coded_sections("values", 1, q, 1, 1, 3, 225)
    secs += [sec("layers.1.keys.dense", 1, "keys.dense", "float16", [1, 1, 1, 20], dense_bytes("float16", 226, 20)),
             sec("layers.1.values.dense", 1, "values.dense", "float16", [1, 1, 1, 20], dense_bytes("float16", 227, 20))]
    return content, secs


def v_arrays() -> tuple[dict, list[dict]]:
    """A recurrent layer: 3 state slots, slot 1 empty (no section), float32 and bfloat16 states."""
    content = {"n_tokens": 5, "quantizer": None, "model": None, "metadata": {},
               "layers": [{"index": 0, "kind": "arrays", "n_tokens": 5, "n_arrays": 3}]}
    secs = [sec("tokens", -1, "tokens", "int32", [5], pack("i", [9, 8, 7, 6, 5])),
            sec("layers.0.state.0", 0, "state.0", "float32", [1, 3, 4], dense_bytes("float32", 230, 12)),
            sec("layers.0.state.2", 0, "state.2", "bfloat16", [1, 2, 2, 2], dense_bytes("bfloat16", 231, 8))]
    return content, secs


def v_list() -> tuple[dict, list[dict]]:
    """A CacheList layer: child 0 an rvq attention cache, child 1 a recurrent state; then a plain layer."""
    q = quantizer(24, (2, 1), 24)
    T = 2
    child0 = att_map(0, "rvq", 1, 1, 24, T, 0, "bfloat16", "bfloat16")
    content = {"n_tokens": T, "quantizer": q, "model": None, "metadata": {},
               "layers": [{"index": 0, "kind": "list", "n_tokens": T,
                           "children": [child0, {"index": 1, "kind": "arrays", "n_tokens": T, "n_arrays": 1}]},
                          att_map(1, "rvq", 1, 1, 24, T, 0, "bfloat16", "bfloat16")]}
    secs = [sec("tokens", -1, "tokens", "int32", [T], pack("i", [3, 4]))]
    secs += coded_sections("c0.keys", 0, q, 1, 1, T, 240) + coded_sections("c0.values", 0, q, 1, 1, T, 245)
    secs += [sec("layers.0.c1.state.0", 0, "c1.state.0", "float16", [1, 8], dense_bytes("float16", 246, 8))]
    secs += coded_sections("keys", 1, q, 1, 1, T, 250) + coded_sections("values", 1, q, 1, 1, T, 255)
    return content, secs


def v_per_side() -> tuple[dict, list[dict]]:
    """Keys of head dim 56 at 4+2 bits, values of head dim 40 at 2+2 (MLA-like), and a second layer whose
    keys and values share one table entry but keep values in float32: per-side-geometry + quantizer-table."""
    qk, qv = quantizer(56, (4, 2), 31), quantizer(40, (2, 2), 32, "shared")
    T, H = 2, 1
    content = {"n_tokens": T, "quantizer": None, "quantizers": [qk, qv], "model": None, "metadata": {},
               "layers": [att_map(0, "rvq", 1, H, 56, T, 0, "bfloat16", "bfloat16", value_head_dim=40,
                                  key_quantizer=0, value_quantizer=1),
                          att_map(1, "rvq", 1, H, 40, T, 1, "float16", "float32", key_quantizer=1, value_quantizer=1)]}
    secs = [sec("tokens", -1, "tokens", "int32", [T], pack("i", [1, 2]))]
    secs += coded_sections("keys", 0, qk, 1, H, T, 310) + coded_sections("values", 0, qv, 1, H, T, 315)
    secs += coded_sections("keys", 1, qv, 1, H, T - 1, 320) + coded_sections("values", 1, qv, 1, H, T - 1, 325)
    secs += [sec("layers.1.keys.dense", 1, "keys.dense", "float16", [1, H, 1, 40], dense_bytes("float16", 326, 40)),
             sec("layers.1.values.dense", 1, "values.dense", "float32", [1, H, 1, 40], dense_bytes("float32", 327, 40))]
    return content, secs


def features_of(content: dict) -> list[str]:
    used = set()
    for row in content["layers"]:
        for r in [row] + row.get("children", []):
            if r["kind"] not in ("rvq", "dense"):
                used.add("layer-kinds")
            if "value_head_dim" in r:
                used.add("per-side-geometry")
            if "sink_tokens" in r or "center_keys" in r:
                used.add("codec-state")
    if "quantizers" in content:
        used.add("quantizer-table")
    return [f for f in ("per-side-geometry", "quantizer-table", "layer-kinds", "codec-state") if f in used]


def assemble_11(content: dict, secs: list[dict], **kw) -> bytes:
    kw.setdefault("features", features_of(content))
    return assemble(content, secs, minor=1, **kw)


def v_settled() -> tuple[dict, list[dict]]:
    """Rules revision 1.1 settles: a shape with a zero after a 2^40 entry has count 0; two sections of
    one unknown kind on one layer are fine; the stored signs (not the seed) define the rotation."""
    content, secs = v_worked_example()
    q = dict(Q_DIM8_1_1, rotation=dict(Q_DIM8_1_1["rotation"], signs=b"\xa5"))  # seed 7 gives 0x0c
    content = dict(content, quantizer=q)
    secs = list(secs) + [sec("future.a", 0, "future.kind", "uint8", [1 << 40, 2, 0], b""),
                         sec("future.b", 0, "future.kind", "uint8", [3], b"abc")]
    return content, secs


def v_dense_with_quantizer() -> tuple[dict, list[dict]]:
    """Every layer dense, yet a quantizer map: allowed (validated, used by nothing)."""
    content, secs = v_dense_minimal()
    return dict(content, quantizer=Q_DIM12_3_0), secs


# ---- revision 1.2: codec state (sink positions kept exact, a per-head key mean), spec 8.2 -----------------------
def state_bytes(dtype: str, seed: int, n: int, scale: float = 1.0) -> bytes:
    """``n`` values of ``dtype`` (float16 / bfloat16 / float32): the [-2, 2) draws of f16_values times
    ``scale``, rounded once to the dtype."""
    vals = [f32(v * scale) for v in f16_values(seed, n)]
    if dtype == "float16":
        return pack("e", vals)
    if dtype == "bfloat16":
        return pack("H", bf16_bits(vals))
    return pack("f", vals)


def state_sections(prefix: str, layer: int, B: int, H: int, D: int, Dv: int, S: int, mean: bool, seed: int,
                   dtypes: tuple[str, str, str], mean_scale: float = 1.0) -> list[dict]:
    """``keys.sink``, ``values.sink`` (if S > 0) and ``keys.mean`` (if ``mean``), named ``layers.<layer>.<prefix>``."""
    kd, vd, md = dtypes
    out = []
    if S:
        out.append(sec(f"layers.{layer}.{prefix}keys.sink", layer, f"{prefix}keys.sink", kd, [B, H, S, D],
                       state_bytes(kd, seed, B * H * S * D, 3.0)))
        out.append(sec(f"layers.{layer}.{prefix}values.sink", layer, f"{prefix}values.sink", vd, [B, H, S, Dv],
                       state_bytes(vd, seed + 1, B * H * S * Dv, 3.0)))
    if mean:
        out.append(sec(f"layers.{layer}.{prefix}keys.mean", layer, f"{prefix}keys.mean", md, [B, H, D],
                       state_bytes(md, seed + 2, B * H * D, mean_scale)))
    return out


def v_codec_state() -> tuple[dict, list[dict]]:
    """One rvq layer (float16, 2 heads, dim 20, 2+2 bits): 6 tokens = 2 sink positions + 3 coded + 1 dense;
    keys centered (a float16 mean per head); one NaN key scale (its vector decodes to NaN, mean or not)."""
    q = quantizer(20, (2, 2), 41)
    B, H, D, T, S, Td = 1, 2, 20, 6, 2, 1
    Tq = T - S - Td
    content = {"n_tokens": T, "quantizer": q, "model": None, "metadata": {},
               "layers": [att_map(0, "rvq", B, H, D, T, Td, "float16", "float16", sink_tokens=S, center_keys=True)]}
    secs = [sec("tokens", -1, "tokens", "int32", [T], pack("i", [1, 500, 501, 502, 503, 504]))]
    secs += coded_sections("keys", 0, q, B, H, Tq, 410, nan_at=4) + coded_sections("values", 0, q, B, H, Tq, 415)
    secs += [sec("layers.0.keys.dense", 0, "keys.dense", "float16", [B, H, Td, D], dense_bytes("float16", 416, B * H * Td * D)),
             sec("layers.0.values.dense", 0, "values.dense", "float16", [B, H, Td, D],
                 dense_bytes("float16", 417, B * H * Td * D))]
    secs += state_sections("", 0, B, H, D, D, S, True, 418, ("float16", "float16", "float16"))
    return content, secs


def v_codec_state_layers() -> tuple[dict, list[dict]]:
    """Codec state on every layer shape it can take (dim 24, 2+1 bits, 5 tokens, one head):
    0: bfloat16, one sink position (keys.sink bfloat16, values.sink float32: each array has its own dtype), no mean;
    1: float32, no sink, keys centered by a float32 mean of magnitude ~1000 (the float32 sum rounds);
    2: float16, sink_tokens 8 > n_tokens: all 5 positions are sinks, nothing coded, so no mean although centered;
    3: a list layer whose rvq child has a sink position, a dense tail and a mean, beside a recurrent state."""
    q = quantizer(24, (2, 1), 42)
    T, D = 5, 24
    child = att_map(0, "rvq", 1, 1, D, T, 1, "float16", "float16", sink_tokens=1, center_keys=True)
    content = {"n_tokens": T, "quantizer": q, "model": None, "metadata": {},
               "layers": [att_map(0, "rvq", 1, 1, D, T, 0, "bfloat16", "bfloat16", sink_tokens=1),
                          att_map(1, "rvq", 1, 1, D, T, 0, "float32", "float32", center_keys=True),
                          att_map(2, "rvq", 1, 1, D, T, 0, "float16", "float16", sink_tokens=8, center_keys=True),
                          {"index": 3, "kind": "list", "n_tokens": T,
                           "children": [child, {"index": 1, "kind": "arrays", "n_tokens": T, "n_arrays": 1}]}]}
    secs = [sec("tokens", -1, "tokens", "int32", [T], pack("i", [7, 8, 9, 10, 11]))]
    secs += coded_sections("keys", 0, q, 1, 1, 4, 420) + coded_sections("values", 0, q, 1, 1, 4, 421)
    secs += state_sections("", 0, 1, 1, D, D, 1, False, 422, ("bfloat16", "float32", ""))
    secs += coded_sections("keys", 1, q, 1, 1, 5, 430) + coded_sections("values", 1, q, 1, 1, 5, 431)
    secs += state_sections("", 1, 1, 1, D, D, 0, True, 432, ("", "", "float32"), mean_scale=517.3)
    secs += coded_sections("keys", 2, q, 1, 1, 0, 440) + coded_sections("values", 2, q, 1, 1, 0, 441)
    secs += state_sections("", 2, 1, 1, D, D, 5, False, 442, ("float16", "float16", ""))
    secs += coded_sections("c0.keys", 3, q, 1, 1, 3, 450) + coded_sections("c0.values", 3, q, 1, 1, 3, 451)
    secs += [sec("layers.3.c0.keys.dense", 3, "c0.keys.dense", "float16", [1, 1, 1, D], dense_bytes("float16", 452, D)),
             sec("layers.3.c0.values.dense", 3, "c0.values.dense", "float16", [1, 1, 1, D], dense_bytes("float16", 453, D))]
    secs += state_sections("c0.", 3, 1, 1, D, D, 1, True, 454, ("float16", "float16", "bfloat16"))
    secs += [sec("layers.3.c1.state.0", 3, "c1.state.0", "float32", [1, 4], dense_bytes("float32", 455, 4))]
    return content, secs


def assemble_12(content: dict, secs: list[dict], **kw) -> bytes:
    kw.setdefault("features", features_of(content))
    kw.setdefault("minor", 2)
    return assemble(content, secs, **kw)


V12 = {
    "codec_state.rvq": v_codec_state,
    "codec_state_layers.rvq": v_codec_state_layers,
}


V11 = {
    "rotating_window.rvq": v_rotating,
    "arrays_state.rvq": v_arrays,
    "cache_list.rvq": v_list,
    "per_side_quantizers.rvq": v_per_side,
}


VALID: dict[str, Callable[[], bytes]] = {
    "worked_example.rvq": lambda: assemble(*v_worked_example()),
    "dense_minimal.rvq": lambda: assemble(*v_dense_minimal()),
    "two_layers_dense_tail_zstd.rvq": lambda: assemble(*v_full(True)),
    "two_layers_dense_tail_raw.rvq": lambda: assemble(*v_full(False)),
    "single_stage_dim12.rvq": lambda: assemble(*v_single_stage_dim12()),
    "empty.rvq": lambda: assemble(*v_empty()),
    "zero_tokens.rvq": lambda: assemble(*v_zero_tokens()),
    "newer_minor.rvq": v_newer_minor,
    **{name: (lambda b=b: assemble(*b())) for name, b in DECODE_VECTORS.items()},
    **{name: (lambda b=b: assemble_11(*b())) for name, b in V11.items()},
    "settled_rules.rvq": lambda: assemble(*v_settled()),
    "dense_with_quantizer.rvq": lambda: assemble(*v_dense_with_quantizer()),
    "entropy_coded.rvq": lambda: assemble(*v_entropy_coded(), minor=1, features=["entropy-coded"]),
    **{name: (lambda b=b: assemble_12(*b())) for name, b in V12.items()},
}

#: Valid vectors the library writer must reproduce byte for byte (raw codecs only), with its inputs.
WRITER_EQUIVALENT = {
    "worked_example.rvq": v_worked_example,
    "dense_minimal.rvq": v_dense_minimal,
    "two_layers_dense_tail_raw.rvq": lambda: v_full(False),
    "single_stage_dim12.rvq": v_single_stage_dim12,
    "empty.rvq": v_empty,
    "zero_tokens.rvq": v_zero_tokens,
    **DECODE_VECTORS,
    **V11,
    **V12,
}


# ---- revision 1.1: the rans section codec (feature entropy-coded, spec 9.3) ----------------------------------
# A scalar rANS coder written from the spec, one symbol at a time (independent of rvqstore.format.rans).
RANS_L = 1 << 16


def _rans_unpack(words: list[int], bits: int, dim: int) -> list[int]:
    per, w = 32 // bits, -(-dim // (32 // bits))
    return [(words[v * w + j // per] >> ((j % per) * bits)) & ((1 << bits) - 1)
            for v in range(len(words) // w) for j in range(dim)]


def _rans_pack(codes: list[int], bits: int, dim: int) -> list[int]:
    per, w = 32 // bits, -(-dim // (32 // bits))
    out = [0] * (len(codes) // dim * w)
    for i, c in enumerate(codes):
        v, j = divmod(i, dim)
        out[v * w + j // per] |= c << ((j % per) * bits)
    return out


def rans_freq(counts: list[int], prob_bits: int) -> list[int]:
    """The spec's frequency rule (9.3)."""
    m, n = 1 << prob_bits, sum(counts)
    if n == 0:
        return [m] + [0] * (len(counts) - 1)
    f = [max(1, c * m // n) if c else 0 for c in counts]
    r = m - sum(f)
    if r > 0:
        f[counts.index(max(counts))] += r
    while r < 0:
        s = f.index(max(f))
        d = min(-r, f[s] - 1)
        f[s] -= d
        r += d
    return f


def rans_encode(data: bytes, bits: int, dim: int, contexts: int, lanes: int, prob_bits: int) -> bytes:
    words = list(struct.unpack(f"<{len(data) // 4}I", data))
    sym = _rans_unpack(words, bits, dim)
    n, k = len(sym), 1 << bits
    tables = dim if contexts else 1
    counts = [[0] * k for _ in range(tables)]
    for i, s in enumerate(sym):
        counts[i % dim if contexts else 0][s] += 1
    freq = [rans_freq(c, prob_bits) for c in counts]
    cum = [[sum(f[:s]) for s in range(k)] for f in freq]
    x = [RANS_L] * lanes
    steps = -(-n // lanes)
    chunks: list[list[int]] = [[] for _ in range(steps)]
    for i in range(n - 1, -1, -1):  # reverse symbol order: lanes of one step in descending order
        lane, t, ctx = i % lanes, i // lanes, (i % dim if contexts else 0)
        f, c = freq[ctx][sym[i]], cum[ctx][sym[i]]
        if x[lane] >= f << (32 - prob_bits):
            chunks[t].insert(0, x[lane] & 0xFFFF)  # the decoder reads a step's words in ascending lanes
            x[lane] >>= 16
        x[lane] = ((x[lane] // f) << prob_bits) + x[lane] % f + c
    stream = [w for ch in chunks for w in ch]
    head = struct.pack("<4sBBBBIIQQ", b"rANS", 1, bits, prob_bits, contexts, dim, lanes, n, len(stream))
    return (head + struct.pack(f"<{tables * k}H", *[v for f in freq for v in f]) + struct.pack(f"<{lanes}I", *x)
            + struct.pack(f"<{len(stream)}H", *stream))


def rans_decode(stored: bytes, raw_length: int) -> bytes:
    """The reference decoder (valid streams only: the generator checks its own output with it)."""
    _, ver, bits, pb, contexts, dim, lanes, n, n_words = struct.unpack_from("<4sBBBBIIQQ", stored)
    k, tables = 1 << bits, (dim if contexts else 1)
    pos = 32
    flat = struct.unpack_from(f"<{tables * k}H", stored, pos)
    freq = [list(flat[t * k:(t + 1) * k]) for t in range(tables)]
    pos += 2 * tables * k
    x = list(struct.unpack_from(f"<{lanes}I", stored, pos))
    pos += 4 * lanes
    stream = struct.unpack_from(f"<{n_words}H", stored, pos)
    read, sym = 0, []
    for i in range(n):  # symbol order = step order, ascending lanes within a step
        lane, ctx = i % lanes, (i % dim if contexts else 0)
        slot = x[lane] & ((1 << pb) - 1)
        s, c = 0, 0
        while c + freq[ctx][s] <= slot:
            c += freq[ctx][s]
            s += 1
        x[lane] = freq[ctx][s] * (x[lane] >> pb) + slot - c
        if x[lane] < RANS_L:
            x[lane] = (x[lane] << 16) | stream[read]
            read += 1
        sym.append(s)
    assert read == n_words and all(v == RANS_L for v in x)
    words = _rans_pack(sym, bits, dim)
    assert len(words) * 4 == raw_length
    return struct.pack(f"<{len(words)}I", *words)


def codes_words_skewed(seed: int, n_vectors: int, dim: int, bits: int) -> list[int]:
    """Packed codes with a skewed, coordinate-dependent distribution (coordinates 0-3 always 0, so
    some tables have zero frequencies; elsewhere small codes are likelier)."""
    g = splitmix(seed)
    codes = []
    for _ in range(n_vectors):
        for j in range(dim):
            r = next(g) >> 56
            codes.append(0 if j < 4 else min((1 << bits) - 1, (r * r) >> (16 - bits) if j % 2 else r >> (8 - bits)))
    return _rans_pack(codes, bits, dim)


def _as_rans(s: dict, bits: int, dim: int, contexts: int, lanes: int, prob_bits: int) -> dict:
    stored = rans_encode(s["_data"], bits, dim, contexts, lanes, prob_bits)
    assert rans_decode(stored, len(s["_data"])) == s["_data"]
    return dict(s, codec="rans", raw_length=len(s["_data"]), _data=stored)


def v_entropy_coded() -> tuple[dict, list[dict]]:
    """One rvq layer, 2+2 bits, dim 24, 40 tokens: keys.codes1 rans with one table per coordinate and
    2 * dim lanes; keys.codes2 one table, 7 lanes (the last step partial), precision 2^15; values.codes1
    one table, one lane; values.codes2 raw."""
    content, secs = v_decode(24, (2, 2), "conditional", ("float16", "float16"), 16, T=40)
    by = {s["kind"]: i for i, s in enumerate(secs)}
    n = 2 * 40
    for kind, seed in (("keys.codes1", 1601), ("keys.codes2", 1602), ("values.codes1", 1603)):
        secs[by[kind]] = dict(secs[by[kind]], _data=pack("I", codes_words_skewed(seed, n, 24, 2)))
    secs[by["keys.codes1"]] = _as_rans(secs[by["keys.codes1"]], 2, 24, 1, 48, 12)
    secs[by["keys.codes2"]] = _as_rans(secs[by["keys.codes2"]], 2, 24, 0, 7, 15)
    secs[by["values.codes1"]] = _as_rans(secs[by["values.codes1"]], 2, 24, 0, 1, 12)
    return content, secs


def _rans_edit(edit: Callable[[bytearray], bytes | bytearray]) -> Callable[[], bytes]:
    """The entropy_coded vector with the stored bytes of keys.codes1 edited (checksum recomputed)."""
    def build() -> bytes:
        content, secs = v_entropy_coded()
        i = next(j for j, s in enumerate(secs) if s["kind"] == "keys.codes1")
        secs[i] = dict(secs[i], _data=bytes(edit(bytearray(secs[i]["_data"]))))
        return assemble(content, secs, minor=1, features=["entropy-coded"])
    return build


def _put(b: bytearray, off: int, fmt: str, v: int) -> bytearray:
    struct.pack_into(fmt, b, off, v)
    return b


def expected_json(data: bytes) -> dict:
    """The expected decoded contents of a valid file, computed from the assembler's own view."""
    pre = struct.unpack("<8sHHIQQQQQQ", data[:64])
    h_off, h_len = pre[4], pre[5]
    header = msgpack.unpackb(data[h_off: h_off + h_len], raw=False)

    def jsonable(v):
        if isinstance(v, bytes):
            return {"hex": v.hex()}
        if isinstance(v, dict):
            return {k: jsonable(x) for k, x in v.items()}
        if isinstance(v, list):
            return [jsonable(x) for x in v]
        return v

    fmt = {"uint8": "B", "int8": "b", "uint16": "H", "int16": "h", "uint32": "I", "int32": "i", "uint64": "Q",
           "int64": "q", "float16": "e", "bfloat16": "H", "float32": "f", "float64": "d"}
    sections = {}
    for e in header["sections"]:
        raw = data[e["offset"]: e["offset"] + e["length"]]
        if e["codec"] == "zstd":
            raw = _decode_handmade_zstd(raw)
        elif e["codec"] == "rans":
            raw = rans_decode(raw, e["raw_length"])
        n = e["raw_length"] // struct.calcsize("<" + fmt[e["dtype"]])
        values = list(struct.unpack("<" + fmt[e["dtype"]] * n, raw))
        sections[e["name"]] = {"kind": e["kind"], "layer": e["layer"], "dtype": e["dtype"], "shape": e["shape"],
                               "codec": e["codec"], "values": values}
    decoded = _decoded(header, sections)
    extra = {}
    if "codec-state" in header["required_features"]:  # revision 1.2: every position of every rvq layer
        extra["decoded_positions"] = _decoded_positions(header, sections, decoded)
    return {
        **extra,
        "decoded": decoded,
        "format_version": [pre[1], pre[2]],
        "file_length": len(data),
        "n_tokens": header["n_tokens"],
        "layers": jsonable(header["layers"]),
        "quantizer": jsonable(header["quantizer"]),
        "model": header["model"],
        "metadata": header["metadata"],
        "required_features": header["required_features"],
        "sections": sections,
    }


def _decoded(header: dict, sections: dict) -> dict:
    """Every coded layer side decoded by the reference decoder: bit patterns in the side's dtype."""
    out = {}
    table = header.get("quantizers")
    for row in header["layers"]:
        subs = [(f"c{j}.", c) for j, c in enumerate(row.get("children", []))] or [("", row)]
        for prefix, lm in subs:
            if lm["kind"] not in ("rvq", "rvq-rotating"):
                continue
            for side in ("keys", "values"):
                qi = lm.get("key_quantizer" if side == "keys" else "value_quantizer")
                q = header["quantizer"] if table is None else table[qi]
                dim = q["dim"]
                dtype = lm["key_dtype" if side == "keys" else "value_dtype"]
                base = f"layers.{row['index']}.{prefix}{side}"
                sc = sections[f"{base}.scales"]["values"]
                c1 = sections[f"{base}.codes1"]["values"]
                c2 = sections[f"{base}.codes2"]["values"] if q["bits2"] else None
                w1 = -(-dim // (32 // q["bits1"]))
                w2 = -(-dim // (32 // q["bits2"])) if q["bits2"] else 0
                bits = []
                for v in range(len(sc)):
                    bits += decode_reference(q, sc[v], c1[v * w1:(v + 1) * w1],
                                             None if c2 is None else c2[v * w2:(v + 1) * w2], dtype)
                out[base] = {"dtype": dtype, "shape": sections[f"{base}.scales"]["shape"] + [dim], "bits": bits}
    return out


def _exact(v: float | int, dtype: str) -> Fraction | None:
    """The exact value of one section element as expected_json lists it (None for NaN)."""
    if dtype == "bfloat16":
        v = struct.unpack("<f", struct.pack("<I", v << 16))[0]
    assert not math.isinf(v), "the vectors hold no infinite state values"
    return None if math.isnan(v) else Fraction(v)


def _bits_value(bits: int, dtype: str) -> float:
    if dtype == "float32":
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    if dtype == "float16":
        return struct.unpack("<e", struct.pack("<H", bits))[0]
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def _decoded_positions(header: dict, sections: dict, decoded: dict) -> dict:
    """Keys and values of every position of every rvq layer, in token order (spec 8.2): sink positions
    ``dtype(sink)``; coded positions the reference ``dec`` of section 10, and for keys of a centering
    layer ``key_dtype(float32(dec) + float32(mean))``, the float32 sum rounded exactly here; dense
    positions as stored.  Bit patterns of the side's dtype, shape ``[B, H, T, dim]``."""
    out = {}
    for row in header["layers"]:
        subs = [(f"c{j}.", c) for j, c in enumerate(row.get("children", []))] or [("", row)]
        for prefix, lm in subs:
            if lm["kind"] != "rvq":
                continue
            base = f"layers.{row['index']}.{prefix}"
            B, H, T, Td = lm["batch"], lm["n_kv_heads"], lm["n_tokens"], lm["n_dense_tokens"]
            S = min(T, lm.get("sink_tokens", 0))
            Tq = T - S - Td
            mean = sections.get(f"{base}keys.mean")
            entry = {}
            for side in ("keys", "values"):
                dtype = lm["key_dtype" if side == "keys" else "value_dtype"]
                dim = lm["head_dim"] if side == "keys" else lm.get("value_head_dim", lm["head_dim"])
                sink, dense = sections.get(f"{base}{side}.sink"), sections.get(f"{base}{side}.dense")
                dec = decoded[f"{base}{side}"]["bits"]
                bits = []
                for bh in range(B * H):
                    for t in range(T):
                        for c in range(dim):
                            if t < S:
                                x = _exact(sink["values"][(bh * S + t) * dim + c], sink["dtype"])
                                bits.append(NAN_BITS[dtype] if x is None else round_fraction(x, dtype))
                            elif t < S + Tq:
                                d = dec[(bh * Tq + t - S) * dim + c]
                                if side == "values" or mean is None:
                                    bits.append(d)
                                    continue
                                dv, m = _bits_value(d, dtype), _exact(mean["values"][bh * dim + c], mean["dtype"])
                                if math.isnan(dv) or m is None:
                                    bits.append(NAN_BITS[dtype])
                                    continue
                                s32 = _bits_value(round_fraction(Fraction(dv) + m, "float32"), "float32")
                                bits.append(round_fraction(Fraction(s32), dtype))
                            else:
                                v = dense["values"][(bh * Td + t - S - Tq) * dim + c]
                                bits.append(v if dtype == "bfloat16" else round_fraction(Fraction(v), dtype))
                entry[side] = {"dtype": dtype, "shape": [B, H, T, dim], "bits": bits}
            out[f"layers.{row['index']}" + (f".{prefix[:-1]}" if prefix else "")] = entry
    return out


def _decode_handmade_zstd(frame: bytes) -> bytes:
    """Decoder for the raw/RLE-block frames this tool writes (not a general zstd decoder)."""
    assert frame[:4] == C.ZSTD_MAGIC and frame[4] == 0xE0
    pos, out = 13, bytearray()
    while True:
        h = int.from_bytes(frame[pos: pos + 3], "little")
        pos += 3
        last, btype, size = h & 1, (h >> 1) & 3, h >> 3
        if btype == 0:
            out += frame[pos: pos + size]
            pos += size
        elif btype == 1:
            out += bytes([frame[pos]]) * size
            pos += 1
        else:
            raise AssertionError("compressed blocks are not used by the vectors")
        if last:
            return bytes(out)


# ---- the invalid files -------------------------------------------------------------------------------------------
def _edit_section(i: int, **kv):
    def f(h: dict) -> None:
        h["sections"][i].update(kv)
    return f


def _flip(data: bytes, pos: int, mask: int = 0x01) -> bytes:
    b = bytearray(data)
    b[pos] ^= mask
    return bytes(b)


def _map_header(n_extra: int, pairs_bytes: bytes, hb: bytes) -> bytes:
    """Re-open a canonical header map (map16/map32 or fixmap) and append raw key/value bytes."""
    first = hb[0]
    if 0x80 <= first <= 0x8F:
        n, rest = first & 0x0F, hb[1:]
    elif first == 0xDE:
        n, rest = int.from_bytes(hb[1:3], "big"), hb[3:]
    else:
        n, rest = int.from_bytes(hb[1:5], "big"), hb[5:]
    return b"\xde" + (n + n_extra).to_bytes(2, "big") + rest + pairs_bytes


def _worked(**kw) -> bytes:
    return assemble(*v_worked_example(), **kw)


def _full(**kw) -> bytes:
    return assemble(*v_full(True), **kw)


def _worked_content_edit(edit: Callable[[dict, list], None], **kw) -> bytes:
    content, secs = v_worked_example()
    content = json.loads(json.dumps({k: v for k, v in content.items() if k != "quantizer"}))
    content["quantizer"] = {**Q_DIM8_1_1, "rotation": dict(Q_DIM8_1_1["rotation"])}
    secs = [dict(s) for s in secs]
    edit(content, secs)
    return assemble(content, secs, **kw)


def _too_many_sections(hb: bytes) -> bytes:
    # replace the header with one whose "sections" array has MAX_SECTIONS + 1 nil entries
    obj = msgpack.unpackb(hb, raw=False)
    n = C.MAX_SECTIONS + 1
    items = b"\xdd" + n.to_bytes(4, "big") + b"\xc0" * n
    obj.pop("sections")
    pairs = packb("sections") + items
    return _map_header(1, pairs, packb(obj))


def _zstd_section(content_size: int | None = None, blocks=None, raw_length: int | None = None,
                  codec: str = "zstd", features=None, frame: bytes | None = None) -> bytes:
    content, secs = v_worked_example()
    tok = secs[0]["_data"]
    if frame is None:
        frame = zstd_frame(blocks or [("raw", tok)], len(tok) if content_size is None else content_size)
    secs = [dict(secs[0], _data=frame, codec=codec, raw_length=len(tok) if raw_length is None else raw_length)] + secs[1:]
    return assemble(content, secs, features=features)


def _invalid() -> list[tuple[str, str, str, str, Callable[[], bytes]]]:
    """(file, error class, stage, reason, builder)."""
    W = _worked
    last_sec_end = None  # computed lazily below

    def worked_section_offsets() -> list[int]:
        content, secs = v_worked_example()
        pos, offs = 64, []
        for s in secs:
            o = align(pos)
            offs.append(o)
            pos = o + len(s["_data"])
        return offs

    offs = worked_section_offsets()
    del last_sec_end
    lf_nl = lambda d: d.replace(b"\r\n", b"\n")  # noqa: E731
    tok = pack("i", [17, 42])
    return [
        # -- the preamble
        ("bad_magic.rvq", "BadMagicError", "open", "the first 8 bytes are a ZIP signature, not the .rvq magic",
         lambda: W(edit_preamble=lambda f: f.update(magic=b"PK\x03\x04\x14\x00\x00\x00"))),
        ("magic_crlf_to_lf.rvq", "BadMagicError", "open",
         "every CR LF was converted to LF (text-mode transfer); the magic's \\r\\n became \\n", lambda: lf_nl(W())),
        ("magic_lf_to_crlf.rvq", "BadMagicError", "open",
         "every LF was converted to CR LF (text-mode transfer); the magic's \\n became \\r\\n",
         lambda: W().replace(b"\n", b"\r\n")),
        ("magic_7bit.rvq", "BadMagicError", "open", "the high bit of every byte was cleared (7-bit transfer)",
         lambda: bytes(b & 0x7F for b in W())),
        ("empty_file.rvq", "TruncatedFileError", "open", "the file is empty", lambda: b""),
        ("truncated_in_magic.rvq", "TruncatedFileError", "open", "only the first 5 bytes of the magic",
         lambda: W()[:5]),
        ("truncated_preamble.rvq", "TruncatedFileError", "open", "the file ends inside the 64-byte preamble",
         lambda: W()[:40]),
        ("major_2.rvq", "UnsupportedVersionError", "open", "major version 2 (checksums valid)",
         lambda: W(major=2)),
        ("major_0.rvq", "UnsupportedVersionError", "open", "major version 0 (checksums valid)",
         lambda: W(major=0)),
        ("unknown_flag.rvq", "UnknownFeatureError", "open", "flag bit 5 is set; v1.0 defines no flag bits",
         lambda: W(flags=1 << 5)),
        ("preamble_checksum.rvq", "ChecksumMismatchError", "open",
         "one bit of the reserved field flipped after the preamble checksum was computed",
         lambda: _flip(W(), 48)),
        ("file_length_inflated.rvq", "TruncatedFileError", "open",
         "the preamble declares 64 bytes more than the file holds (as if truncated)",
         lambda: W(edit_preamble=lambda f: f.update(file_length=f["file_length"] + 64))),
        ("truncated_at_section_boundary.rvq", "TruncatedFileError", "open",
         "the file is cut right after its first section", lambda: W()[: offs[1]]),
        ("truncated_in_header.rvq", "TruncatedFileError", "open", "the file is cut 10 bytes before its end",
         lambda: W()[:-10]),
        ("trailing_bytes.rvq", "TrailingDataError", "open", "one byte appended after the declared end",
         lambda: W() + b"\x00"),
        ("header_length_inflated.rvq", "TruncatedFileError", "open",
         "the header length runs 1 byte past the end of the file",
         lambda: W(edit_preamble=lambda f: f.update(header_length=f["header_length"] + 1))),
        ("header_length_huge.rvq", "LimitExceededError", "open", "header length 2^40, beyond the 16 MiB limit",
         lambda: W(edit_preamble=lambda f: f.update(header_length=1 << 40))),
        ("header_length_zero.rvq", "MalformedHeaderError", "open", "header length 0",
         lambda: W(edit_preamble=lambda f: f.update(header_length=0))),
        ("header_offset_misaligned.rvq", "LayoutError", "open", "header offset not a multiple of 64",
         lambda: W(edit_preamble=lambda f: f.update(header_offset=f["header_offset"] + 8,
                                                    header_length=f["header_length"] - 8))),
        ("header_not_last.rvq", "LayoutError", "open",
         "the header is shorter than the bytes after its offset (it must end the file)",
         lambda: W(edit_preamble=lambda f: f.update(header_length=f["header_length"] - 1))),
        ("header_checksum.rvq", "ChecksumMismatchError", "open", "one header byte flipped",
         lambda: _flip(W(), len(W()) - 3)),
        # -- the msgpack header
        ("header_not_msgpack.rvq", "MalformedHeaderError", "open", "the header bytes are not msgpack (0xc1 is never used)",
         lambda: W(header_bytes=lambda hb: b"\xc1" + hb[1:])),
        ("header_not_map.rvq", "MalformedHeaderError", "open", "the header is a msgpack array",
         lambda: W(header_bytes=lambda hb: packb([1, 2, 3]))),
        ("header_trailing_msgpack.rvq", "MalformedHeaderError", "open", "a second msgpack object after the header map",
         lambda: W(header_bytes=lambda hb: hb + b"\xc0")),
        ("duplicate_key.rvq", "MalformedHeaderError", "open",
         "the header map has the key 'n_tokens' twice (msgpack-python would keep the last)",
         lambda: W(header_bytes=lambda hb: _map_header(1, packb("n_tokens") + packb(2), hb))),
        ("ext_type.rvq", "MalformedHeaderError", "open", "an ext-type value (type 5) in the header",
         lambda: W(header_bytes=lambda hb: _map_header(1, packb("x_ext") + b"\xd4\x05\x00", hb))),
        ("timestamp_ext.rvq", "MalformedHeaderError", "open",
         "a msgpack timestamp (ext type -1, which msgpack-python decodes without calling ext_hook)",
         lambda: W(header_bytes=lambda hb: _map_header(1, packb("x_ts") + b"\xd6\xff\x00\x00\x00\x00", hb))),
        ("non_string_key.rvq", "MalformedHeaderError", "open", "a map key that is an integer",
         lambda: W(header_bytes=lambda hb: _map_header(1, packb(7) + packb("x"), hb))),
        ("invalid_utf8.rvq", "MalformedHeaderError", "open", "a str value that is not valid UTF-8",
         lambda: W(header_bytes=lambda hb: _map_header(1, packb("x_bad") + b"\xa2\xff\xfe", hb))),
        ("deep_nesting.rvq", "MalformedHeaderError", "open", "a value nested 100 arrays deep (limit 32)",
         lambda: W(edit_header=lambda h: h.update(x_deep=json.loads("[" * 100 + "]" * 100)))),
        ("format_version_mismatch.rvq", "MalformedHeaderError", "open",
         "header.format_version says 1.1 while the preamble says 1.0",
         lambda: W(edit_header=lambda h: h.update(format_version=[1, 1]))),
        ("unknown_required_feature.rvq", "UnknownFeatureError", "open",
         "required_features lists 'teleportation'", lambda: W(features=["teleportation"])),
        ("missing_key.rvq", "MalformedHeaderError", "open", "the header has no 'n_tokens'",
         lambda: W(edit_header=lambda h: h.pop("n_tokens"))),
        ("bool_as_int.rvq", "MalformedHeaderError", "open", "layers[0].batch is the boolean true, not an integer",
         lambda: W(edit_header=lambda h: h["layers"][0].update(batch=True))),
        ("too_many_sections.rvq", "LimitExceededError", "open",
         f"the section table has {C.MAX_SECTIONS + 1} entries (limit {C.MAX_SECTIONS})",
         lambda: W(header_bytes=_too_many_sections)),
        ("too_many_layers.rvq", "LimitExceededError", "open", f"{C.MAX_LAYERS + 1} layers (limit {C.MAX_LAYERS})",
         lambda: W(edit_header=lambda h: h.update(layers=[None] * (C.MAX_LAYERS + 1)))),
        ("head_dim_limit.rvq", "LimitExceededError", "open", "layers[0].head_dim is 2^20 (limit 2^16)",
         lambda: W(edit_header=lambda h: h["layers"][0].update(head_dim=1 << 20))),
        ("ndim_limit.rvq", "LimitExceededError", "open", "a shape with 9 dimensions (limit 8)",
         lambda: W(edit_header=_edit_section(0, shape=[1] * 8 + [2]))),
        ("shape_overflow.rvq", "LimitExceededError", "open",
         "shape [2^40, 2^40, 2^40, 2^40]: the element count overflows 64 bits (limit 2^40)",
         lambda: W(edit_header=_edit_section(1, shape=[1 << 40] * 4, raw_length=0))),
        ("shape_size_mismatch.rvq", "MalformedHeaderError", "open",
         "raw_length 8 does not match shape [3] of int32 (12 bytes)",
         lambda: W(edit_header=_edit_section(0, shape=[3]))),
        ("raw_length_mismatch.rvq", "MalformedHeaderError", "open",
         "a raw section whose stored length differs from its raw_length",
         lambda: W(edit_header=_edit_section(0, raw_length=12, shape=[3]))),
        ("unknown_dtype.rvq", "MalformedHeaderError", "open", "dtype 'float8'",
         lambda: W(edit_header=_edit_section(0, dtype="float8"))),
        ("unknown_codec.rvq", "MalformedHeaderError", "open", "codec 'lz4'",
         lambda: W(edit_header=_edit_section(0, codec="lz4"))),
        ("negative_offset.rvq", "MalformedHeaderError", "open", "a section offset of -64",
         lambda: W(edit_header=_edit_section(0, offset=-64))),
        ("duplicate_section_name.rvq", "MalformedHeaderError", "open", "two sections named 'tokens'",
         lambda: W(edit_header=_edit_section(1, name="tokens"))),
        # -- layout
        ("sections_overlap.rvq", "LayoutError", "open", "the second section starts inside the first",
         lambda: W(offsets=[offs[0], offs[0]] + offs[2:])),
        ("sections_unsorted.rvq", "LayoutError", "open", "the table lists the sections out of offset order",
         lambda: W(edit_header=lambda h: h["sections"].insert(0, h["sections"].pop(2)))),
        ("section_misaligned.rvq", "LayoutError", "open", "a section offset 8 bytes past a 64-byte boundary",
         lambda: W(offsets=[offs[0], offs[1] + 8] + offs[2:])),
        ("section_hole.rvq", "LayoutError", "open", "64 bytes of gap before a section",
         lambda: W(offsets=[o + 64 * (i >= 1) for i, o in enumerate(offs)])),
        ("header_hole.rvq", "LayoutError", "open", "64 bytes of gap before the header",
         lambda: W(header_offset=align(offs[-1] + 4) + 64)),
        ("section_length_inflated.rvq", "LayoutError", "open",
         "the first section's shape/length are inflated (consistently) so it runs into the next one",
         lambda: W(edit_header=_edit_section(0, shape=[100], raw_length=400, length=400))),
        ("section_past_header.rvq", "LayoutError", "open", "the last section's length runs into the header",
         lambda: W(edit_header=_edit_section(6, shape=[1, 1, 200], raw_length=400, length=400))),
        ("nonzero_padding.rvq", "LayoutError", "read", "a padding byte between two sections is 0x01",
         lambda: (lambda d: d[: offs[1] - 1] + b"\x01" + d[offs[1]:])(W())),
        ("section_checksum.rvq", "ChecksumMismatchError", "read", "one bit flipped in a section's data",
         lambda: _flip(W(), offs[1])),
        # -- content rules
        ("missing_section.rvq", "MalformedHeaderError", "open", "layer 0 has no keys.scales section",
         lambda: _worked_content_edit(lambda c, s: s.pop(3))),
        ("wrong_dtype_for_kind.rvq", "MalformedHeaderError", "open", "keys.scales declared float16 instead of bfloat16",
         lambda: W(edit_header=_edit_section(3, dtype="float16"))),
        ("tokens_shape_mismatch.rvq", "MalformedHeaderError", "open", "n_tokens is 3 but the tokens section holds 2",
         lambda: W(edit_header=lambda h: h.update(n_tokens=3))),
        ("layer_out_of_range.rvq", "MalformedHeaderError", "open", "a section refers to layer 5 of a 1-layer file",
         lambda: W(edit_header=_edit_section(3, layer=5))),
        ("dense_section_without_dense_tokens.rvq", "MalformedHeaderError", "open",
         "an rvq layer with n_dense_tokens 0 has a keys.dense section",
         lambda: _worked_content_edit(lambda c, s: s.append(
             sec("layers.0.keys.dense", 0, "keys.dense", "float16", [1, 1, 0, 8], b"")))),
        ("codes_words_mismatch.rvq", "MalformedHeaderError", "open",
         "keys.codes1 has 2 words per vector (the second zero); 8 codes of 1 bit need 1: the only fault",
         lambda: _worked_content_edit(lambda c, s: s.__setitem__(1, dict(
             s[1], shape=[1, 1, 2, 2], _data=pack("I", [w for x in struct.unpack("<2I", s[1]["_data"])
                                                         for w in (x, 0)]))))),
        ("rvq_layer_without_quantizer.rvq", "MalformedHeaderError", "open", "an rvq layer but quantizer is nil",
         lambda: W(edit_header=lambda h: h.update(quantizer=None))),
        ("quantizer_version_unknown.rvq", "UnsupportedVersionError", "open", "turboquant-rvq version 2",
         lambda: W(edit_header=lambda h: h["quantizer"].update(version=2))),
        ("quantizer_table_unsorted.rvq", "MalformedHeaderError", "open", "centroids1 not increasing",
         lambda: W(edit_header=lambda h: h["quantizer"].update(centroids1=[0.5, -0.5]))),
        ("quantizer_signs_length.rvq", "MalformedHeaderError", "open", "rotation.signs has 2 bytes for dim 8",
         lambda: W(edit_header=lambda h: h["quantizer"]["rotation"].update(signs=b"\x0c\x00"))),
        ("quantizer_unknown_prng.rvq", "UnknownFeatureError", "open", "rotation.prng is 'mt19937'",
         lambda: W(edit_header=lambda h: h["quantizer"]["rotation"].update(prng="mt19937"))),
        ("codes_unused_bits.rvq", "MalformedSectionError", "decode",
         "a stage-1 word of a dim-8 1-bit code has bit 31 set (only bits 0..7 carry codes)",
         lambda: _worked_content_edit(lambda c, s: s.__setitem__(1, dict(s[1], _data=pack("I", [0x80000001, 0x5]))))),
        ("scale_inf.rvq", "MalformedSectionError", "decode",
         "a key scale is +Inf (bfloat16 0x7f80): only NaN marks a vector that was not finite",
         lambda: _worked_content_edit(lambda c, s: s.__setitem__(3, dict(s[3], _data=pack("H", [0x7F80, 0x3F80]))))),
        ("scale_negative.rvq", "MalformedSectionError", "decode", "a key scale is -1.0 (bfloat16 0xbf80)",
         lambda: _worked_content_edit(lambda c, s: s.__setitem__(3, dict(s[3], _data=pack("H", [0x3F80, 0xBF80]))))),
        ("scale_overflows_float16.rvq", "MalformedSectionError", "decode",
         "a finite key scale of 2^20 decodes to values beyond float16's range (the layer's key_dtype)",
         lambda: _worked_content_edit(lambda c, s: s.__setitem__(3, dict(s[3], _data=pack("H", [0x4980, 0x3F80]))))),
        ("header_padding_nonzero.rvq", "LayoutError", "open",
         "a padding byte just before the header is 0x01 (checked when the file is opened)",
         lambda: (lambda d, h: d[: h - 1] + b"\x01" + d[h:])(W(), struct.unpack("<Q", W()[16:24])[0])),
        ("section_layer_4096.rvq", "LimitExceededError", "open", "a section's layer is 4096 (limit 4095)",
         lambda: W(edit_header=_edit_section(3, layer=4096))),
        ("offset_over_2_63.rvq", "LimitExceededError", "open", "a section offset of 2^63 (limit 2^63-1)",
         lambda: W(edit_header=_edit_section(0, offset=1 << 63))),
        ("residual_unknown.rvq", "MalformedHeaderError", "open", "quantizer.residual is 'parallel'",
         lambda: W(edit_header=lambda h: h["quantizer"].update(residual="parallel"))),
        ("scale_dtype_unknown.rvq", "MalformedHeaderError", "open", "quantizer.scale_dtype is 'float16'",
         lambda: W(edit_header=lambda h: h["quantizer"].update(scale_dtype="float16"))),
        ("table_integer_not_float.rvq", "MalformedHeaderError", "open",
         "quantizer.boundaries1 is [0] (an integer where a float is required)",
         lambda: W(edit_header=lambda h: h["quantizer"].update(boundaries1=[0]))),
        # -- revision 1.1
        ("rans_without_feature.rvq", "MalformedHeaderError", "open",
         "a section with codec 'rans' in a file whose required_features lacks 'entropy-coded'",
         lambda: assemble(*v_entropy_coded(), minor=1, features=[])),
        ("rans_not_uint32.rvq", "MalformedHeaderError", "open",
         "a rans section of dtype int32 (rans holds packed uint32 codes only)",
         lambda: W(features=["entropy-coded"], minor=1, edit_header=_edit_section(0, codec="rans"))),
        ("rans_bad_magic.rvq", "MalformedSectionError", "read", "rans stream that does not start with 'rANS'",
         _rans_edit(lambda b: _put(b, 0, "<4s", b"rANZ"))),
        ("rans_version.rvq", "MalformedSectionError", "read", "rans stream version 2",
         _rans_edit(lambda b: _put(b, 4, "<B", 2))),
        ("rans_prob_bits_16.rvq", "MalformedSectionError", "read", "rans probability precision 16 (limit 15)",
         _rans_edit(lambda b: _put(b, 6, "<B", 16))),
        ("rans_lanes_not_multiple.rvq", "MalformedSectionError", "read",
         "one table per coordinate (contexts 1) with 47 lanes, not a multiple of dim 24",
         _rans_edit(lambda b: _put(b, 12, "<I", 47))),
        ("rans_symbol_count.rvq", "MalformedSectionError", "read",
         "n_symbols one less than raw_length holds (no loop runs past the section's symbols)",
         _rans_edit(lambda b: _put(b, 16, "<Q", struct.unpack_from("<Q", b, 16)[0] - 1))),
        ("rans_words_beyond_section.rvq", "MalformedSectionError", "read",
         "n_words counts one word more than the stored bytes hold",
         _rans_edit(lambda b: _put(b, 24, "<Q", struct.unpack_from("<Q", b, 24)[0] + 1))),
        ("rans_freq_sum.rvq", "MalformedSectionError", "read", "a frequency table summing to 2^12 + 1",
         _rans_edit(lambda b: _put(b, 32 + 2 * 4 * 5, "<H", struct.unpack_from("<H", b, 32 + 2 * 4 * 5)[0] + 1))),
        ("rans_state_low.rvq", "MalformedSectionError", "read", "a final lane state below 2^16",
         _rans_edit(lambda b: _put(b, 32 + 2 * 4 * 24 + 4 * 3, "<I", 0xFFFF))),
        ("rans_corrupt_stream.rvq", "MalformedSectionError", "read",
         "one word of the stream changed: a lane does not end in its initial state",
         _rans_edit(lambda b: _put(b, len(b) - 2, "<H", struct.unpack_from("<H", b, len(b) - 2)[0] ^ 0x0101))),
        ("layer_kind_without_feature.rvq", "MalformedHeaderError", "open",
         "an 'arrays' layer in a file whose required_features lacks 'layer-kinds'",
         lambda: assemble(*v_arrays(), minor=1, features=[])),
        ("value_head_dim_without_feature.rvq", "MalformedHeaderError", "open",
         "a layer with value_head_dim in a file whose required_features lacks 'per-side-geometry'",
         lambda: assemble(*v_per_side(), minor=1, features=["quantizer-table"])),
        ("quantizers_without_feature.rvq", "MalformedHeaderError", "open",
         "a 'quantizers' table in a file whose required_features lacks 'quantizer-table'",
         lambda: assemble(*v_per_side(), minor=1, features=["per-side-geometry"])),
        ("quantizer_and_table.rvq", "MalformedHeaderError", "open",
         "'quantizer' is a map although the file uses 'quantizers' (it must be nil)",
         lambda: assemble_11(*v_per_side(), edit_header=lambda h: h.update(quantizer=h["quantizers"][1]))),
        ("quantizer_index_out_of_range.rvq", "MalformedHeaderError", "open",
         "layers[1].value_quantizer is 2 but the table has 2 entries",
         lambda: assemble_11(*v_per_side(), edit_header=lambda h: h["layers"][1].update(value_quantizer=2))),
        ("value_head_dim_mismatch.rvq", "MalformedHeaderError", "open",
         "layers[0].value_head_dim is 56 but its value quantizer's dim is 40",
         lambda: assemble_11(*v_per_side(), edit_header=lambda h: h["layers"][0].update(value_head_dim=56))),
        ("rotating_over_capacity.rvq", "MalformedHeaderError", "open",
         "an rvq-rotating layer holds 4 tokens but its max_size is 3",
         lambda: assemble_11(*v_rotating(), edit_header=lambda h: h["layers"][1].update(max_size=3))),
        ("rotating_keep_over_max_size.rvq", "MalformedHeaderError", "open", "keep 5 exceeds max_size 4",
         lambda: assemble_11(*v_rotating(), edit_header=lambda h: h["layers"][1].update(keep=5))),
        ("rotating_offset_below_tokens.rvq", "MalformedHeaderError", "open",
         "offset 3 is below the layer's n_tokens 4",
         lambda: assemble_11(*v_rotating(), edit_header=lambda h: h["layers"][1].update(offset=3))),
        ("state_section_in_rvq_layer.rvq", "MalformedHeaderError", "open",
         "a 'state.0' section on an rvq layer",
         lambda: assemble_11(v_rotating()[0], v_rotating()[1] + [
             sec("layers.0.state.0", 0, "state.0", "float32", [1], pack("f", [1.0]))])),
        ("arrays_slot_out_of_range.rvq", "MalformedHeaderError", "open",
         "a 'state.2' section in an arrays layer with n_arrays 2",
         lambda: assemble_11(*v_arrays(), edit_header=lambda h: h["layers"][0].update(n_arrays=2))),
        ("list_child_out_of_range.rvq", "MalformedHeaderError", "open",
         "a 'c1.state.0' section in a list layer with one child",
         lambda: assemble_11(*v_list(), edit_header=lambda h: h["layers"][0].update(
             children=h["layers"][0]["children"][:1]))),
        ("list_in_list.rvq", "MalformedHeaderError", "open", "a child of a list layer is itself a list",
         lambda: assemble_11(*v_list(), edit_header=lambda h: h["layers"][0]["children"].__setitem__(
             1, {"index": 1, "kind": "list", "n_tokens": 2, "children": []}))),
        # -- revision 1.2: codec state
        ("codec_state_sink_missing.rvq", "MalformedHeaderError", "open",
         "sink_tokens 2 on a 6-token layer but no 'values.sink' section",
         lambda: _state_edit(lambda c, ss: ss.pop(_kind_at(ss, "values.sink")))),
        ("codec_state_sink_unexpected.rvq", "MalformedHeaderError", "open",
         "a 'keys.sink' section on a layer whose sink_tokens is 0 (layer 1 of codec_state_layers)",
         lambda: _state_layers_edit(lambda c, ss: ss.insert(_kind_at(ss, "keys.mean", 1) + 1, sec(
             "layers.1.keys.sink", 1, "keys.sink", "float32", [1, 1, 1, 24], state_bytes("float32", 9, 24))))),
        ("codec_state_wrong_sink_count.rvq", "MalformedHeaderError", "open",
         "keys.sink and values.sink hold 1 position where min(n_tokens, sink_tokens) is 2",
         lambda: _state_edit(_one_sink_position)),
        ("codec_state_dense_overlaps_sink.rvq", "MalformedHeaderError", "open",
         "n_dense_tokens 5 with 2 sink positions in a 6-token layer",
         lambda: _state_edit(lambda c, ss: c["layers"][0].update(n_dense_tokens=5))),
        ("codec_state_mean_without_centering.rvq", "MalformedHeaderError", "open",
         "a 'keys.mean' section on a layer without center_keys",
         lambda: _state_edit(lambda c, ss: c["layers"][0].pop("center_keys"))),
        ("codec_state_mean_missing.rvq", "MalformedHeaderError", "open",
         "center_keys with 3 coded positions but no 'keys.mean' section",
         lambda: _state_edit(lambda c, ss: ss.pop(_kind_at(ss, "keys.mean")))),
        ("codec_state_mean_without_codes.rvq", "MalformedHeaderError", "open",
         "a 'keys.mean' section on a centering layer whose positions are all sinks (nothing coded)",
         lambda: _state_layers_edit(lambda c, ss: ss.insert(_kind_at(ss, "values.sink", 2) + 1, sec(
             "layers.2.keys.mean", 2, "keys.mean", "float16", [1, 1, 24], state_bytes("float16", 9, 24))))),
        ("codec_state_mean_shape.rvq", "MalformedHeaderError", "open",
         "keys.mean of shape [1, 2, 1, 20] instead of [B, H, Dk] = [1, 2, 20]",
         lambda: _state_edit(lambda c, ss: ss[_kind_at(ss, "keys.mean")].update(shape=[1, 2, 1, 20]))),
        ("codec_state_mean_dtype.rvq", "MalformedHeaderError", "open",
         "keys.mean of dtype int16 (float16, bfloat16 or float32 only)",
         lambda: _state_edit(lambda c, ss: ss[_kind_at(ss, "keys.mean")].update(dtype="int16"))),
        ("codec_state_sink_dtype.rvq", "MalformedHeaderError", "open",
         "keys.sink of dtype uint16 (float16, bfloat16 or float32 only)",
         lambda: _state_edit(lambda c, ss: ss[_kind_at(ss, "keys.sink")].update(dtype="uint16"))),
        ("codec_state_mean_not_finite.rvq", "MalformedSectionError", "decode",
         "the first value of keys.mean is float16 +Inf (a mean must be finite)",
         lambda: _state_edit(lambda c, ss: ss[_kind_at(ss, "keys.mean")].update(
             _data=b"\x00\x7c" + ss[_kind_at(ss, "keys.mean")]["_data"][2:]))),
        ("codec_state_sink_tokens_limit.rvq", "LimitExceededError", "open", "sink_tokens 2^31 (limit 2^31 - 1)",
         lambda: _state_edit(lambda c, ss: c["layers"][0].update(sink_tokens=1 << 31))),
        ("codec_state_center_keys_not_bool.rvq", "MalformedHeaderError", "open",
         "center_keys is the integer 1, not a boolean",
         lambda: _state_edit(lambda c, ss: c["layers"][0].update(center_keys=1))),
        ("codec_state_on_rotating_layer.rvq", "MalformedHeaderError", "open",
         "sink_tokens on an rvq-rotating layer (codec state is defined for rvq layers only)",
         lambda: assemble_12(*_with(v_rotating, lambda c, ss: c["layers"][1].update(sink_tokens=1)))),
        ("codec_state_feature_missing.rvq", "MalformedHeaderError", "open",
         "a version 1.2 file with sink_tokens, center_keys and their sections whose required_features lacks "
         "'codec-state'", lambda: assemble_12(*v_codec_state(), features=[])),
        ("codec_state_feature_missing_v11.rvq", "MalformedHeaderError", "open",
         "the codec_state vector as version 1.1 without 'codec-state' (a 1.1 writer cannot make it)",
         lambda: assemble_12(*v_codec_state(), minor=1, features=[])),
        # -- zstd
        ("zstd_without_feature.rvq", "MalformedHeaderError", "open",
         "a zstd section in a file whose required_features lacks 'zstd'", lambda: _zstd_section(features=[])),
        ("zstd_huge_claim.rvq", "LimitExceededError", "open",
         "a 17-byte zstd frame (one RLE block) declares raw_length 2^40 (more than 32x its stored length; a reader must not allocate it)",
         lambda: _zstd_section_huge()),
        ("zstd_content_size_mismatch.rvq", "MalformedSectionError", "read",
         "the frame's content size (2^40) differs from the header's raw_length (8)",
         lambda: _zstd_section(content_size=1 << 40)),
        ("zstd_no_content_size.rvq", "MalformedSectionError", "read", "the frame has no content size field",
         lambda: _zstd_section(frame=zstd_frame([("raw", tok)], None))),
        ("zstd_decodes_short.rvq", "MalformedSectionError", "read",
         "the frame declares 8 bytes but its blocks hold 4",
         lambda: _zstd_section(frame=zstd_frame([("raw", tok[:4])], 8))),
        ("zstd_two_frames.rvq", "MalformedSectionError", "read", "two zstd frames back to back",
         lambda: _zstd_section(frame=zstd_frame([("raw", tok)], 8) + zstd_frame([("raw", b"\x00")], 1))),
        ("zstd_not_a_frame.rvq", "MalformedSectionError", "read", "the stored bytes do not start with the zstd magic",
         lambda: _zstd_section(frame=b"\x00" * 16)),
        ("zstd_skippable_frame.rvq", "MalformedSectionError", "read", "a skippable frame instead of a data frame",
         lambda: _zstd_section(frame=b"\x50\x2a\x4d\x18" + (8).to_bytes(4, "little") + tok)),
    ]


def _kind_at(secs: list[dict], kind: str, layer: int = 0) -> int:
    return next(i for i, s in enumerate(secs) if s["kind"] == kind and s["layer"] == layer)


def _with(build: Callable[[], tuple[dict, list[dict]]], edit: Callable[[dict, list], Any]) -> tuple[dict, list[dict]]:
    """``build()``'s content and sections (deep copies) after ``edit(content, sections)``."""
    content, secs = build()
    content = copy.deepcopy(content)
    secs = [dict(s) for s in secs]
    edit(content, secs)
    return content, secs


def _state_edit(edit) -> bytes:
    """The codec_state vector after ``edit`` (its features as the valid file has them)."""
    return assemble_12(*_with(v_codec_state, edit), features=["codec-state"])


def _state_layers_edit(edit) -> bytes:
    return assemble_12(*_with(v_codec_state_layers, edit), features=["layer-kinds", "codec-state"])


def _one_sink_position(content: dict, secs: list) -> None:
    for kind in ("keys.sink", "values.sink"):
        i = _kind_at(secs, kind)
        secs[i] = dict(secs[i], shape=[1, 2, 1, 20], _data=secs[i]["_data"][: len(secs[i]["_data"]) // 2],
                       raw_length=None)
        secs[i]["raw_length"] = len(secs[i]["_data"])


def _zstd_section_huge() -> bytes:
    content, secs = v_worked_example()
    frame = zstd_frame([("rle", (0, 1 << 17))], 1 << 40)
    secs = [dict(secs[0], _data=frame, codec="zstd", raw_length=1 << 40, shape=[1 << 38])] + secs[1:]
    return assemble(content, secs)


INVALID = _invalid()


# ---- the worked example dump --------------------------------------------------------------------------------------
def _hexlines(data: bytes, start: int) -> list[str]:
    out = []
    for i in range(0, len(data), 16):
        chunk = data[i: i + 16]
        out.append(f"{start + i:06x}  {' '.join(f'{b:02x}' for b in chunk)}")
    return out


def worked_example_dump(data: bytes) -> str:
    """A byte-range-by-byte-range listing of a file (used for the spec's worked example)."""
    f = struct.unpack("<8sHHIQQQQQQ", data[:64])
    names = ["magic", "major", "minor", "flags", "header_offset", "header_length", "header_checksum",
             "file_length", "reserved", "preamble_checksum"]
    sizes = [8, 2, 2, 4, 8, 8, 8, 8, 8, 8]
    lines = ["offset  bytes (hex)                                      field", ""]
    pos = 0
    for name, size, val in zip(names, sizes, f):
        hexs = " ".join(f"{b:02x}" for b in data[pos: pos + size])
        shown = repr(val)[1:] if isinstance(val, bytes) else (f"{val:#018x}" if "checksum" in name else str(val))
        lines.append(f"{pos:06x}  {hexs:<47}  {name} = {shown}")
        pos += size
    h_off, h_len = f[4], f[5]
    header = msgpack.unpackb(data[h_off: h_off + h_len], raw=False)
    for e in header["sections"]:
        if e["offset"] > pos:
            lines.append(f"{pos:06x}  ({e['offset'] - pos} zero bytes of padding)")
        lines.append("")
        lines.append(f"section {e['name']!r}: {e['dtype']} {e['shape']}, {e['codec']}, "
                     f"{e['length']} bytes, checksum {e['checksum']:#018x}")
        lines.extend(_hexlines(data[e["offset"]: e["offset"] + e["length"]], e["offset"]))
        pos = e["offset"] + e["length"]
    if h_off > pos:
        lines.append(f"{pos:06x}  ({h_off - pos} zero bytes of padding)")
    lines.append("")
    lines.append(f"header: {h_len} bytes of msgpack, checksum {f[6]:#018x}")
    lines.extend(_hexlines(data[h_off: h_off + h_len], h_off))
    lines.append(f"{h_off + h_len:06x}  (end of file)")
    return "\n".join(lines) + "\n"


def worked_example_header_json(data: bytes) -> str:
    """The decoded header, one top-level key (or one list entry) per line; bin values as <bin HEX>."""
    f = struct.unpack("<8sHHIQQQQQQ", data[:64])
    header = msgpack.unpackb(data[f[4]: f[4] + f[5]], raw=False)

    def conv(v):
        if isinstance(v, bytes):
            return f"<bin {v.hex()}>"
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, list):
            return [conv(x) for x in v]
        return v

    lines = ["{"]
    keys = list(header)
    for n, k in enumerate(keys):
        v = conv(header[k])
        end = "," if n < len(keys) - 1 else ""
        if isinstance(v, list) and v and isinstance(v[0], dict):
            lines.append(f" {json.dumps(k)}: [")
            for i, e in enumerate(v):
                lines.append("  " + json.dumps(e) + ("," if i < len(v) - 1 else ""))
            lines.append(" ]" + end)
        elif isinstance(v, dict) and len(json.dumps(v)) > 100:
            lines.append(f" {json.dumps(k)}: {{")
            items = list(v.items())
            for i, (k2, v2) in enumerate(items):
                lines.append(f"  {json.dumps(k2)}: {json.dumps(v2)}" + ("," if i < len(items) - 1 else ""))
            lines.append(" }" + end)
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}{end}")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---- main ----------------------------------------------------------------------------------------------------------
def generate(out: Path) -> list[Path]:
    """Write every vector under ``out`` (``valid/``, ``invalid/``); returns the files written."""
    written = []
    (out / "valid").mkdir(parents=True, exist_ok=True)
    (out / "invalid").mkdir(parents=True, exist_ok=True)
    valid_manifest = []
    for name, build in VALID.items():
        data = build()
        p = out / "valid" / name
        p.write_bytes(data)
        j = out / "valid" / (name[:-4] + ".json")
        j.write_text(json.dumps(expected_json(data), indent=1, sort_keys=True) + "\n")
        written += [p, j]
        valid_manifest.append({"file": name, "expected": j.name})
    m = out / "valid" / "MANIFEST.json"
    m.write_text(json.dumps(valid_manifest, indent=1) + "\n")
    written.append(m)
    manifest = []
    for name, err, stage, reason, build in INVALID:
        data = build()
        p = out / "invalid" / name
        p.write_bytes(data)
        written.append(p)
        manifest.append({"file": name, "error": err, "stage": stage, "reason": reason})
    m = out / "invalid" / "MANIFEST.json"
    m.write_text(json.dumps(manifest, indent=1) + "\n")
    written.append(m)
    return written


SPEC = ROOT / "format_spec" / "rvq-v1.md"


def spec_blocks() -> dict[str, str]:
    """The generated blocks of the spec, by marker name."""
    data = VALID["worked_example.rvq"]()
    we = ("```text\n" + worked_example_dump(data) + "```\n\nThe header, decoded (bin values shown as "
          "`<bin HEX>`):\n\n```json\n" + worked_example_header_json(data) + "```\n")
    from rvqstore.hadamard import BASE_MATRICES

    had = "```text\n" + "\n".join(f"A_{m}:\n" + "\n".join(rows) + "\n" for m, rows in sorted(BASE_MATRICES.items())) + "```\n"
    return {"worked-example": we, "hadamard-matrices": had}


def render_spec(text: str) -> str:
    """``text`` with every generated block replaced by its current rendering."""
    for name, body in spec_blocks().items():
        begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
        i, j = text.index(begin) + len(begin), text.index(end)
        text = text[:i] + "\n" + body + text[j:]
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=str(ROOT / "format_spec" / "vectors"))
    ap.add_argument("--worked-example", action="store_true", help="print the spec's worked-example dump")
    ap.add_argument("--update-spec", action="store_true",
                    help="rewrite the generated blocks of format_spec/rvq-v1.md (worked example, appendix)")
    args = ap.parse_args(argv)
    if args.worked_example:
        data = VALID["worked_example.rvq"]()
        sys.stdout.write(worked_example_dump(data))
        sys.stdout.write("\n")
        sys.stdout.write(worked_example_header_json(data))
        return 0
    if args.update_spec:
        SPEC.write_text(render_spec(SPEC.read_text()))
        print(f"updated {SPEC}")
        return 0
    files = generate(Path(args.out))
    print(f"wrote {len(files)} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
